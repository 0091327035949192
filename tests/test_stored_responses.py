"""Stored Responses API answers: vLLM with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` keeps each
``/v1/responses`` answer in the memory of the server that produced it, and answers 404 for a
``previous_response_id``, a ``GET /v1/responses/{id}`` or a cancel of an id it does not hold
(``openai/responses/serving.py``). Through the router, every such request reaches the holder,
over real HTTP to three workers that keep their answers as vLLM does."""

from __future__ import annotations

import itertools
import json
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from redis_server import redis_server
from test_router_support import config_for, serve_app, serve_router, stand_in_worker, until
from test_shared_sessions_limits import replicas

from router.stored_responses import owner_key, response_id_in, stored_path

_ids = itertools.count()


def _storing_worker(name: str) -> FastAPI:
    """A worker of vLLM's Responses API with its store on: answers carry a new id (or the
    request's ``request_id``), kept in this worker's memory only."""
    app = stand_in_worker()
    store: dict[str, dict] = {}

    def missing(rid: str) -> JSONResponse:
        err = {"message": f"Response with id '{rid}' not found.", "code": 404}
        return JSONResponse({"error": err}, status_code=404)

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        body = await request.json()
        prev = body.get("previous_response_id")
        if prev is not None and prev not in store:
            return missing(prev)
        rid = body.get("request_id") or f"resp_{next(_ids):032x}"
        doc = {"id": rid, "object": "response", "status": "completed", "worker": name}
        store[rid] = doc
        if body.get("stream"):

            async def events():  # type: ignore[no-untyped-def]
                created = {"response": doc, "sequence_number": 0, "type": "response.created"}
                yield f"event: response.created\ndata: {json.dumps(created)}\n\n".encode()
                yield b'event: response.completed\ndata: {"type": "response.completed"}\n\n'

            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse(doc)

    @app.get("/v1/responses/{rid}")
    async def retrieve(rid: str) -> Response:
        return JSONResponse(store[rid]) if rid in store else missing(rid)

    @app.post("/v1/responses/{rid}/cancel")
    async def cancel(rid: str) -> Response:
        if rid not in store:
            return missing(rid)
        return JSONResponse({**store[rid], "status": "cancelled"})

    return app


def test_ids_and_paths_are_read_as_vllm_writes_them() -> None:
    assert response_id_in(b'{"id":"resp_ab12","object":"response"}') == "resp_ab12"
    created = b'event: response.created\ndata: {"response": {"id": "mine-7", "object": "resp'
    assert response_id_in(created) == "mine-7"
    assert response_id_in(b'{"object":"list"}') is None
    assert stored_path("/v1/responses/resp_1") == ("resp_1", False)
    assert stored_path("/v1/responses/resp_1/cancel") == ("resp_1", True)
    assert stored_path("/v1/responses") is None and stored_path("/v1/responses/a/b") is None


async def test_a_stored_response_is_found_through_the_router() -> None:
    async with (
        serve_app(_storing_worker("a")) as a,
        serve_app(_storing_worker("b")) as b,
        serve_app(_storing_worker("c")) as c,
        # No speculative entries and no events: by cache and load alone every request would go
        # to any of the three at random.
        serve_router(config_for([a, b, c], policy={"speculative_ttl_s": 0.0})) as (base, router),
        httpx.AsyncClient(timeout=30) as client,
    ):
        await until(lambda: all(w.models for w in router.registry.workers.values()), 10, "models")
        first = {"model": "m", "input": "hello"}
        chains = []
        for i in range(3):
            r = await client.post(base + "/v1/responses", json={**first, "input": f"q{i}"})
            assert r.status_code == 200, r.text
            chains.append((r.json()["id"], r.headers["x-kvrouter-worker"]))
        streamed = {**first, "input": "s", "stream": True}
        async with client.stream("POST", base + "/v1/responses", json=streamed) as r:
            raw = b"".join([x async for x in r.aiter_raw()])
        chains.append((response_id_in(raw), r.headers["x-kvrouter-worker"]))
        named = {**first, "input": "n", "request_id": "client-chosen-1"}
        r = await client.post(base + "/v1/responses", json=named)
        chains.append(("client-chosen-1", r.headers["x-kvrouter-worker"]))
        for rid, holder in chains:
            for turn in range(3):
                body = {"model": "m", "input": f"more {turn}", "previous_response_id": rid}
                r = await client.post(base + "/v1/responses", json=body)
                assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == holder, r.text
                rid = r.json()["id"]  # the chain goes on from the newest answer
            got = await client.get(base + f"/v1/responses/{rid}")
            assert got.status_code == 200 and got.headers["x-kvrouter-worker"] == holder
            assert got.json()["id"] == rid
            cancelled = await client.post(base + f"/v1/responses/{rid}/cancel")
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
            explained = await client.post(
                base + "/debug/route?path=/v1/responses",
                json={"model": "m", "input": "x", "previous_response_id": rid},
            )
            assert explained.json()["chosen"] == holder
            assert "holds the previous response" in explained.json()["routing"]
        # An id the router never saw answered goes by load: the worker's own 404 comes back.
        r = await client.get(base + "/v1/responses/resp_unknown")
        assert r.status_code == 404 and "not found" in r.text


async def test_a_holder_noted_on_one_replica_is_found_through_the_other() -> None:
    """Two router replicas sharing a real redis-server: the holder of an answer made through
    one is where the other sends the follow-up and the retrieval. The note is written to Redis
    off the request path; the client here waits for it as it waits between turns."""
    with redis_server() as srv:
        async with (
            serve_app(_storing_worker("a")) as a,
            serve_app(_storing_worker("b")) as b,
            serve_app(_storing_worker("c")) as c,
            replicas([a, b, c], srv.url, policy={"speculative_ttl_s": 0.0}) as (one, other),
            httpx.AsyncClient(timeout=30) as client,
        ):
            routers = (one[1], other[1])
            await until(
                lambda: all(w.models for r in routers for w in r.registry.workers.values()), 10
            )
            for i in range(4):
                r = await client.post(
                    one[0] + "/v1/responses", json={"model": "m", "input": f"{i}"}
                )
                rid, holder = r.json()["id"], r.headers["x-kvrouter-worker"]

                async def noted(rid: str = rid) -> bool:
                    return (
                        await other[1].sessions.lookup(owner_key(rid), time.monotonic()) is not None
                    )

                await until(noted, 10, "the note in Redis")
                body = {"model": "m", "input": "more", "previous_response_id": rid}
                r = await client.post(other[0] + "/v1/responses", json=body)
                assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == holder
                got = await client.get(other[0] + f"/v1/responses/{r.json()['id']}")
                assert got.status_code == 200 and got.headers["x-kvrouter-worker"] == holder


async def test_a_stored_response_wins_over_a_hard_session_binding() -> None:
    """``session.mode: hard`` pins a session's requests to its engine, but a request naming a
    stored answer can be served only where the answer is: it goes there."""
    async with (
        serve_app(_storing_worker("a")) as a,
        serve_app(_storing_worker("b")) as b,
        serve_app(_storing_worker("c")) as c,
        serve_router(
            config_for([a, b, c], policy={"speculative_ttl_s": 0.0}, session={"mode": "hard"})
        ) as (base, router),
        httpx.AsyncClient(timeout=30) as client,
    ):
        await until(lambda: all(w.models for w in router.registry.workers.values()), 10, "models")
        r = await client.post(base + "/v1/responses", json={"model": "m", "input": "first"})
        rid, holder = r.json()["id"], r.headers["x-kvrouter-worker"]
        for i in range(40):  # a session bound elsewhere (its first request lands at random)
            session = {"x-session-id": f"s{i}"}
            r = await client.post(
                base + "/v1/responses", json={"model": "m", "input": "x"}, headers=session
            )
            if r.headers["x-kvrouter-worker"] != holder:
                break
        bound = r.headers["x-kvrouter-worker"]
        assert bound != holder
        body = {"model": "m", "input": "more", "previous_response_id": rid}
        r = await client.post(base + "/v1/responses", json=body, headers=session)
        assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == holder, r.text
        r = await client.post(
            base + "/v1/responses", json={"model": "m", "input": "y"}, headers=session
        )
        assert r.headers["x-kvrouter-worker"] == bound  # the session stays pinned otherwise
