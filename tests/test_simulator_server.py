"""The simulator as a process: real HTTP and real ZMQ sockets on loopback.

Every wait is a poll with a deadline (no fixed sleeps); every test is bounded.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from simulator.hashing import RequestHasher
from simulator.testing import WorkerInfo, _ephemeral_range, find_port_block, running_fleet

DEADLINE = 10.0
_rng = random.Random(7)
_ids = itertools.count()


def toks(n: int) -> list[int]:
    return [_rng.randrange(200, 30000) for _ in range(n)]


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[WorkerInfo]]:
    with running_fleet(
        2, block_size=16, num_gpu_blocks=64, decode_ms=1, topic="kv", lora=["ad1"]
    ) as ws:
        yield ws


@pytest.fixture(scope="module")
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def complete(w: WorkerInfo, prompt: Any, max_tokens: int = 2, **extra: Any) -> dict[str, Any]:
    r = httpx.post(
        f"{w.url}/v1/completions",
        timeout=DEADLINE,
        json={"prompt": prompt, "max_tokens": max_tokens, **extra},
    )
    assert r.status_code == 200, r.text
    return r.json()


class Sub:
    """SUB socket with a warm-up: keeps sending fresh prompts until one batch arrives."""

    def __init__(self, ctx: zmq.Context, w: WorkerInfo, endpoint: str | None = None) -> None:
        self.w = w
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint or w.events_endpoint)

    def warm(self) -> None:
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            complete(self.w, toks(40), 1)
            if self.sock.poll(200):
                self.sync()
                return
        raise AssertionError("no event received")

    def sync(self) -> int:
        """Wait until every batch handed to the publisher so far has been received (or
        is known to be dropped); returns the next seq. Makes 'nothing arrives' checks
        immune to late deliveries on a loaded machine."""
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            st = httpx.get(self.w.url + "/sim/state", timeout=DEADLINE).json()["engines"][0]
            if st["next_seq"] == st["published"]:
                break
            self.sock.poll(20)
        else:
            raise AssertionError("publisher did not flush")
        self.drain()
        return int(st["published"])

    def recv(self, timeout: float = DEADLINE) -> tuple[bytes, int, list[Any]]:
        assert self.sock.poll(int(timeout * 1000)), "timed out waiting for a batch"
        topic, seq, payload = self.sock.recv_multipart()
        return topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)

    def drain(self) -> list[tuple[bytes, int, list[Any]]]:
        out = []
        while self.sock.poll(100):
            topic, seq, payload = self.sock.recv_multipart()
            out.append((topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
        return out

    def close(self) -> None:
        self.sock.close(0)


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[list[bytes]]:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    try:
        d.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            if not d.poll(500):
                continue
            frames = d.recv_multipart()
            assert frames[0] == b""
            if frames[-1] == b"":
                assert frames[1:] == [b"", b"\xff" * 8, b""]
                return out
            out.append(frames[1:])
        raise AssertionError("replay did not finish")
    finally:
        d.close(0)


# ---- HTTP surface ---------------------------------------------------------------------------
def test_http_endpoints(fleet: list[WorkerInfo]) -> None:
    w = fleet[0]
    with httpx.Client(base_url=w.url, timeout=DEADLINE) as c:
        assert c.get("/health").status_code == 200
        models = c.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["sim-model", "ad1"]
        src = c.get("/kv_event_sources").json()
        assert set(src) == {"0"}
        cfg = src["0"]
        assert cfg["endpoint"] == "tcp://*:" + w.events_endpoint.rsplit(":", 1)[1]
        assert cfg["replay_endpoint"] == "tcp://*:" + w.replay_endpoint.rsplit(":", 1)[1]
        assert cfg["topic"] == "kv" and cfg["enable_kv_cache_events"] is True
        assert {"publisher", "buffer_steps", "hwm", "max_queue_size"} <= set(cfg)
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi!"}]
        tk = c.post("/tokenize", json={"messages": msgs}).json()
        assert tk["count"] == len(tk["tokens"]) and tk["max_model_len"] == 131072
        assert tk["token_strs"] is None
        chat = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}).json()
        assert chat["usage"]["prompt_tokens"] == tk["count"]
        assert chat["choices"][0]["message"]["role"] == "assistant"
        plain = c.post("/tokenize", json={"prompt": "hello router", "return_token_strs": True})
        assert plain.json()["token_strs"] == ["hello", "\u0120router"]
        ids = plain.json()["tokens"]
        assert c.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "hello router"}
        nogen = c.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False})
        assert nogen.json()["count"] == tk["count"] - 2
        text = c.get("/metrics").text
        for name in (
            "vllm:num_requests_running{",
            "vllm:num_requests_waiting{",
            "vllm:kv_cache_usage_perc{",
            "vllm:prefix_cache_queries_total{",
            "vllm:prefix_cache_hits_total{",
            "# TYPE vllm:prefix_cache_hits counter",
        ):
            assert name in text
        assert 'engine="0",model_name="sim-model"' in text


def test_cached_tokens_in_usage_and_stream(fleet: list[WorkerInfo]) -> None:
    w = fleet[1]
    p = toks(100)
    assert complete(w, p)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(w, p)["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    body = {
        "messages": [{"role": "user", "content": "tell me a long story " * 10}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for _ in range(2):
        chunks = []
        with httpx.stream("POST", f"{w.url}/v1/chat/completions", json=body, timeout=DEADLINE) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    objs = [json.loads(x) for x in chunks[:-1]]
    assert objs[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(o["object"] == "chat.completion.chunk" for o in objs)
    assert objs[-2]["choices"][0]["finish_reason"] == "length"
    usage = objs[-1]["usage"]
    assert objs[-1]["choices"] == [] and usage["completion_tokens"] == 3
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize(
    "path,body,status",
    [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", b"[1,2]", 400),
        ("/v1/completions", b'{"prompt": 5}', 400),
        ("/v1/completions", b'{"prompt": []}', 400),
        ("/v1/completions", b'{"prompt": [1, -2]}', 400),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": -1}', 400),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 999999999}', 400),
        ("/v1/completions", b'{"prompt": "x", "model": "nope"}', 404),
        ("/v1/completions", b'{"prompt": "x", "cache_salt": 3}', 400),
        ("/v1/chat/completions", b'{"messages": "hi"}', 400),
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', 400),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "continue_final_message": true}',
            400,
        ),
        ("/tokenize", b"{}", 400),
        ("/detokenize", b'{"tokens": "abc"}', 400),
        ("/sim/faults", b'{"bogus": 1}', 400),
    ],
)
def test_bad_input_gets_openai_error(
    fleet: list[WorkerInfo], path: str, body: bytes, status: int
) -> None:
    r = httpx.post(
        fleet[0].url + path,
        content=body,
        timeout=DEADLINE,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and "type" in err


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([5, 70_000, 6], "token ids must be in [0, "),
        ([5, -1], "token ids must be in [0, "),
        ([5, True], "prompt must be a string or a list of token ids"),
        ([5, "a"], "prompt must be a string or a list of token ids"),
        ([5, 1.0], "prompt must be a string or a list of token ids"),
        ([], "prompt must not be empty"),
    ],
)
def test_bad_token_id_prompts_are_refused(
    fleet: list[WorkerInfo], prompt: list[Any], message: str
) -> None:
    """Token-id prompts are checked as vLLM checks them: ints in the vocabulary, nothing else."""
    r = httpx.post(
        fleet[0].url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 1},
        timeout=DEADLINE,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(message)
    ok = complete(fleet[0], [5, 31_999, 6], 1)
    assert ok["usage"]["prompt_tokens"] == 3


def test_body_too_large(fleet: list[WorkerInfo]) -> None:
    r = httpx.post(
        fleet[0].url + "/v1/completions", content=b"x" * (9 * 1024 * 1024), timeout=DEADLINE
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


# ---- events ------------------------------------------------------------------------------------
def test_live_events_replay_and_hashes(fleet: list[WorkerInfo], ctx: zmq.Context) -> None:
    w = fleet[0]
    sub = Sub(ctx, w)
    try:
        sub.warm()
        p = toks(70)
        complete(w, p, 1, cache_salt="salty")
        topic, seq, (ts, events, dp) = sub.recv()
        assert topic == b"kv" and dp == 0 and isinstance(ts, float)
        ev = events[0]
        h = RequestHasher(16, cache_salt="salty")
        h.extend(p)
        assert ev["type"] == "BlockStored" and ev["block_hashes"] == h.event_hashes
        assert ev["parent_block_hash"] is None and ev["token_ids"] == p[:64]
        assert ev["extra_keys"] == [["salty"], None, None, None]
        assert ev["medium"] == "GPU" and ev["group_idx"] == 0
        assert ev["kv_cache_spec_kind"] == "full_attention"
        # LoRA requests carry the adapter
        complete(w, toks(40), 1, model="ad1")
        _, seq2, (_, ev2, _) = sub.recv()
        assert seq2 == seq + 1
        assert ev2[0]["lora_name"] == "ad1" and ev2[0]["lora_id"] == 1
        assert ev2[0]["extra_keys"] == [["ad1"], ["ad1"]]
        # replay returns byte-identical batches, from the requested seq on
        rep = replay(ctx, w.replay_endpoint, seq)
        assert [int.from_bytes(f[1], "big") for f in rep] == [seq, seq2]
        assert all(f[0] == b"kv" for f in rep)
        assert msgspec.msgpack.decode(rep[0][2])[1] == events
        full = replay(ctx, w.replay_endpoint, 0)
        assert [int.from_bytes(f[1], "big") for f in full] == list(range(seq2 + 1))
    finally:
        sub.close()


def test_eviction_and_reset(fleet: list[WorkerInfo], ctx: zmq.Context) -> None:
    w = fleet[1]
    sub = Sub(ctx, w)
    try:
        sub.warm()
        seen_removed = False
        deadline = time.monotonic() + DEADLINE
        while not seen_removed and time.monotonic() < deadline:  # 64-block pool fills up
            complete(w, toks(300), 1)
            for _, _, (_, events, _) in sub.drain():
                rem = [e for e in events if e["type"] == "BlockRemoved"]
                if rem:
                    seen_removed = True
                    assert all(
                        len(e["block_hashes"]) == 1 and e["group_idx"] == 0 and e["medium"] == "GPU"
                        for e in rem
                    )
                    assert events.index(rem[0]) < len(events) - 1  # before the BlockStored
        assert seen_removed
        n = sub.sync()
        r = httpx.post(w.url + "/reset_prefix_cache", timeout=DEADLINE)
        assert r.json() == {"success": True}
        assert not sub.sock.poll(300)  # nothing published until the next step
        assert sub.sync() == n
        complete(w, toks(40), 1)
        _, _, (_, events, _) = sub.recv()
        assert events[0] == {"type": "AllBlocksCleared"}
        assert events[1]["type"] == "BlockStored"
    finally:
        sub.close()


def test_restart_publisher_resets_seq_and_buffer(fleet: list[WorkerInfo], ctx: zmq.Context) -> None:
    w = fleet[0]
    complete(w, toks(40), 1)
    assert replay(ctx, w.replay_endpoint, 0)
    assert httpx.post(w.url + "/sim/restart_publisher", timeout=DEADLINE).status_code == 200
    assert replay(ctx, w.replay_endpoint, 0) == []
    sub = Sub(ctx, w)
    try:
        sub.warm()
        rep = replay(ctx, w.replay_endpoint, 0)
        assert int.from_bytes(rep[0][1], "big") == 0
    finally:
        sub.close()


def test_faults(fleet: list[WorkerInfo], ctx: zmq.Context) -> None:
    w = fleet[1]
    sub = Sub(ctx, w)
    faults = w.url + "/sim/faults"
    try:
        sub.warm()
        # dropped batches leave a seq gap on the live stream; replay still has them
        first = sub.sync()
        httpx.post(faults, json={"drop_event_fraction": 1.0}, timeout=DEADLINE)
        complete(w, toks(40), 1)
        assert sub.sync() == first + 1  # published, sent nowhere
        httpx.post(faults, json={"drop_event_fraction": 0.0}, timeout=DEADLINE)
        complete(w, toks(40), 1)
        _, seq, _ = sub.recv()
        assert seq == first + 1
        rep = replay(ctx, w.replay_endpoint, seq - 1)
        assert [int.from_bytes(f[1], "big") for f in rep] == [seq - 1, seq]
        # events disabled: nothing is published and no seq is consumed
        httpx.post(faults, json={"events_enabled": False}, timeout=DEADLINE)
        complete(w, toks(40), 1)
        httpx.post(faults, json={"events_enabled": True}, timeout=DEADLINE)
        p = toks(40)
        complete(w, p, 1)
        _, seq2, _ = sub.recv()
        assert seq2 == seq + 1
        # unannounced reset: the cache is gone, no AllBlocksCleared
        httpx.post(faults, json={"unannounced_reset": True}, timeout=DEADLINE)
        assert complete(w, p, 1)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        _, _, (_, events, _) = sub.recv()
        assert all(e["type"] != "AllBlocksCleared" for e in events)
        # stalled HTTP: requests hang until the stall is lifted
        httpx.post(faults, json={"stall_http": True}, timeout=DEADLINE)
        with pytest.raises(httpx.TimeoutException):
            httpx.get(w.url + "/health", timeout=0.3)
        httpx.post(faults, json={"stall_http": False}, timeout=DEADLINE)
        assert httpx.get(w.url + "/health", timeout=DEADLINE).status_code == 200
        # slowdown makes steps slower
        httpx.post(faults, json={"slowdown": 50.0}, timeout=DEADLINE)
        t0 = time.monotonic()
        complete(w, toks(500), 1)
        slow = time.monotonic() - t0
        httpx.post(faults, json={"slowdown": 1.0}, timeout=DEADLINE)
        assert slow > 0.5  # 500 tokens at 20k tok/s = 25 ms, x50
        assert httpx.get(faults, timeout=DEADLINE).json()["slowdown"] == 1.0
    finally:
        httpx.post(
            faults,
            json={
                "stall_http": False,
                "drop_event_fraction": 0.0,
                "events_enabled": True,
                "slowdown": 1.0,
            },
            timeout=DEADLINE,
        )
        sub.close()


def test_a_chat_stream_starts_at_its_first_token_and_a_client_that_leaves_aborts(
    fleet: list[WorkerInfo],
) -> None:
    """As in vLLM: a chat stream's first chunk (the role) comes with the first token, not
    before the prefill, and a client that disconnects, streaming or not, aborts its request."""
    w = fleet[0]
    faults = w.url + "/sim/faults"

    def waiting() -> int:
        state = httpx.get(w.url + "/sim/state", timeout=DEADLINE).json()
        return sum(e["waiting"] for e in state["engines"])

    def until_empty() -> None:
        end = time.monotonic() + DEADLINE
        while waiting():
            assert time.monotonic() < end, "the abandoned request is still waiting"
            time.sleep(0.02)

    chat = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}
    url = w.url + "/v1/chat/completions"
    try:
        httpx.post(faults, json={"stall_scheduler": True}, timeout=DEADLINE)
        with httpx.Client(timeout=httpx.Timeout(DEADLINE, read=0.5)) as c:
            with c.stream("POST", url, json={**chat, "stream": True}) as r:
                assert r.status_code == 200  # the head comes at once
                with pytest.raises(httpx.ReadTimeout):
                    next(r.iter_raw())  # nothing before the first token
            until_empty()
            with pytest.raises(httpx.ReadTimeout):
                c.post(w.url + "/v1/completions", json={"prompt": toks(30), "max_tokens": 2})
            until_empty()
    finally:
        httpx.post(faults, json={"stall_scheduler": False}, timeout=DEADLINE)
    with httpx.stream("POST", url, json={**chat, "stream": True}, timeout=DEADLINE) as r:
        first = next(r.iter_lines())
    assert '"role":"assistant"' in first.replace(" ", "")


def test_restart_engine_clears_cache(fleet: list[WorkerInfo]) -> None:
    w = fleet[0]
    p = toks(64)
    complete(w, p, 1)
    assert complete(w, p, 1)["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    assert httpx.post(w.url + "/sim/restart_engine", timeout=DEADLINE).status_code == 200
    assert complete(w, p, 1)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# ---- flags ---------------------------------------------------------------------------------------
def test_misconfiguration_flags(ctx: zmq.Context) -> None:
    msgs = [{"role": "user", "content": "hello router"}]
    with (
        running_fleet(1, no_events=True) as (a,),
        running_fleet(
            1,
            chat_template="alt",
            event_block_size_lie=32,
            event_encoding="array",
            groups="full,swa:32",
        ) as (b,),
    ):
        assert httpx.get(a.url + "/kv_event_sources", timeout=DEADLINE).json() == {}
        ta = httpx.post(a.url + "/tokenize", json={"messages": msgs}, timeout=DEADLINE).json()
        tb = httpx.post(b.url + "/tokenize", json={"messages": msgs}, timeout=DEADLINE).json()
        assert ta["tokens"] != tb["tokens"]
        chat = httpx.post(
            b.url + "/v1/chat/completions",
            json={"messages": msgs, "max_tokens": 1},
            timeout=DEADLINE,
        ).json()
        assert chat["usage"]["prompt_tokens"] == tb["count"]
        sub = Sub(ctx, b)
        try:
            sub.warm()
            complete(b, toks(40), 1)
            _, _, (_, events, _) = sub.recv()
            assert isinstance(events[0], list) and events[0][0] == "BlockStored"
            assert events[0][4] == 32  # the lie; the real block size is 16
            assert {e[9] for e in events} == {0, 1}  # one event per group
        finally:
            sub.close()


def test_dp_ranks_publish_separately(ctx: zmq.Context) -> None:
    with running_fleet(1, dp_size=2, block_size=16) as (w,):
        src = httpx.get(w.url + "/kv_event_sources", timeout=DEADLINE).json()
        assert set(src) == {"0", "1"}
        p0 = int(src["0"]["endpoint"].rsplit(":", 1)[1])
        assert int(src["1"]["endpoint"].rsplit(":", 1)[1]) == p0 + 1
        subs = [Sub(ctx, w, w.rank_endpoints(r)[0]) for r in (0, 1)]
        try:
            ranks: set[int] = set()
            deadline = time.monotonic() + DEADLINE
            while ranks != {0, 1} and time.monotonic() < deadline:
                complete(w, toks(40), 1)
                for r, s in enumerate(subs):
                    for _, _, (_, _, dp) in s.drain():
                        assert dp == r
                        ranks.add(dp)
            assert ranks == {0, 1}
            for r in (0, 1):
                rep = replay(ctx, w.rank_endpoints(r)[1], 0)
                assert int.from_bytes(rep[0][1], "big") == 0
        finally:
            for s in subs:
                s.close()


def test_the_dp_rank_header_places_the_request_and_one_rank_can_stall() -> None:
    """vLLM honours ``X-data-parallel-rank``: the request runs on that rank (400 for a rank the
    worker does not have); ``stall_scheduler`` can stall one rank and leave the other serving."""
    with running_fleet(1, dp_size=2, block_size=16, decode_ms=1) as (w,):
        url = w.url + "/v1/completions"
        faults = w.url + "/sim/faults"

        def on(rank: str, **kw: Any) -> httpx.Response:
            body = {"prompt": toks(40), "max_tokens": 1}
            return httpx.post(url, json=body, headers={"x-data-parallel-rank": rank}, **kw)

        def waiting() -> list[int]:
            state = httpx.get(w.url + "/sim/state", timeout=DEADLINE).json()
            return [e["waiting"] for e in sorted(state["engines"], key=lambda e: e["dp_rank"])]

        assert on("2", timeout=DEADLINE).status_code == 400
        assert on("x", timeout=DEADLINE).status_code == 400
        bad = httpx.post(faults, json={"stall_scheduler": ["0"]}, timeout=DEADLINE)
        assert bad.status_code == 400
        assert httpx.post(faults, json={"stall_scheduler": [0]}, timeout=DEADLINE).is_success
        try:
            for _ in range(3):
                assert on("1", timeout=DEADLINE).status_code == 200  # rank 1 serves
            with pytest.raises(httpx.ReadTimeout):
                on("0", timeout=httpx.Timeout(DEADLINE, read=0.3))  # rank 0 admits nothing
            assert waiting()[1] == 0
        finally:
            httpx.post(faults, json={"stall_scheduler": False}, timeout=DEADLINE)
        assert on("0", timeout=DEADLINE).status_code == 200


def test_concurrent_load_with_preemption_completes() -> None:
    """Many concurrent long requests on a tiny pool: preemption, queueing, all answered."""
    import asyncio

    async def main(w: WorkerInfo) -> list[int]:
        async with httpx.AsyncClient(base_url=w.url, timeout=30.0) as c:

            async def one(i: int) -> int:
                r = await c.post(
                    "/v1/completions", json={"prompt": toks(150 + i), "max_tokens": 20}
                )
                return r.status_code

            return await asyncio.gather(*(one(i) for i in range(30)))

    with running_fleet(
        1, block_size=16, num_gpu_blocks=40, decode_ms=1, max_num_batched_tokens=256
    ) as (w,):
        codes = asyncio.run(main(w))
        assert codes == [200] * 30
        r = httpx.post(w.url + "/v1/completions", json={"prompt": "hi there"}, timeout=DEADLINE)
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        assert r.json()["usage"]["completion_tokens"] == 16
        m = httpx.get(w.url + "/metrics", timeout=DEADLINE).text
        assert 'vllm:num_requests_running{engine="0",model_name="sim-model"} 0.0' in m


def test_report_full_over_http(fleet: list[WorkerInfo], ctx: zmq.Context) -> None:
    w = fleet[0]
    sub = Sub(ctx, w)
    try:
        sub.warm()
        p = toks(64)
        complete(w, p, 1)
        sub.recv()
        complete(w, p, 1, vllm_xargs={"kv_cache_report_mode": "full"}, session_id="s1")
        _, _, (_, events, _) = sub.recv()
        assert events[0]["parent_block_hash"] is None and len(events[0]["block_hashes"]) == 3
        assert events[0]["session_id"] == "s1"
    finally:
        sub.close()


def test_bounded_queue_returns_503() -> None:
    import asyncio

    async def main(w: WorkerInfo) -> list[int]:
        async with httpx.AsyncClient(base_url=w.url, timeout=30.0) as c:

            async def one() -> int:
                r = await c.post("/v1/completions", json={"prompt": toks(20), "max_tokens": 4})
                if r.status_code != 200:
                    assert r.json()["error"]["code"] == r.status_code
                return r.status_code

            return await asyncio.gather(*(one() for _ in range(4)))

    with running_fleet(1, max_num_seqs=1, max_waiting=1, decode_ms=800) as (w,):
        codes = asyncio.run(main(w))
        assert 200 in codes and 503 in codes


def test_client_disconnect_mid_stream_frees_blocks() -> None:
    with running_fleet(1, block_size=16, num_gpu_blocks=128, decode_ms=50) as (w,):
        body = {"prompt": toks(200), "max_tokens": 500, "stream": True}
        with httpx.stream("POST", f"{w.url}/v1/completions", json=body, timeout=DEADLINE) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # leave after the first token
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            st = httpx.get(w.url + "/sim/state", timeout=DEADLINE).json()["engines"][0]
            if st["running"] == 0 and st["waiting"] == 0 and st["kv_usage"] == 0.0:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"request not aborted: {st}")


def test_legacy_replay_format(ctx: zmq.Context) -> None:
    """--legacy-replay: vLLM 0.23/0.24 replay bodies [seq, payload], end [END_SEQ, b'']."""
    with running_fleet(1, legacy_replay=True, event_encoding="array") as (w,):
        complete(w, toks(40), 1)
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(w.replay_endpoint)
        try:
            deadline = time.monotonic() + DEADLINE
            got: list[list[bytes]] = []
            while time.monotonic() < deadline:  # the batch may still be in the queue
                d.send_multipart([b"", (0).to_bytes(8, "big")])
                msgs = []
                while d.poll(2000):
                    f = d.recv_multipart()
                    msgs.append(f)
                    if f[-1] == b"":
                        break
                if len(msgs) > 1:
                    got = msgs
                    break
            assert got, "no replay"
            assert got[-1] == [b"", b"\xff" * 8, b""]
            assert len(got[0]) == 3 and int.from_bytes(got[0][1], "big") == 0
            batch = msgspec.msgpack.decode(got[0][2])
            assert batch[1][0][0] == "BlockStored"  # array-era event
        finally:
            d.close(0)


def test_completions_sse(fleet: list[WorkerInfo]) -> None:
    body = {
        "prompt": toks(30),
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{fleet[0].url}/v1/completions", json=body, timeout=DEADLINE) as r:
        data = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    objs = [json.loads(x) for x in data[:-1]]
    assert [o["object"] for o in objs] == ["text_completion"] * 4
    assert [o["choices"][0]["finish_reason"] for o in objs[:3]] == [None, None, "length"]
    assert objs[3]["choices"] == [] and objs[3]["usage"]["prompt_tokens"] == 30


def test_tokenize_gives_the_engine_tokens(fleet: list[WorkerInfo]) -> None:
    """/tokenize (chat form) returns exactly what /v1/chat/completions feeds the engine:
    replaying those ids as a completion hits every full block of the chat prompt."""
    w = fleet[1]
    msgs = [
        {"role": "system", "content": "you are a router test " * 8},
        {"role": "user", "content": [{"type": "text", "text": "question number 7"}]},
    ]
    with httpx.Client(base_url=w.url, timeout=DEADLINE) as c:
        ids = c.post("/tokenize", json={"messages": msgs}).json()["tokens"]
        chat = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}).json()
        assert chat["usage"]["prompt_tokens"] == len(ids)
        again = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 1}).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (
            (len(ids) - 1) // 16 * 16
        )


def test_test_ports_stay_out_of_the_ephemeral_range() -> None:
    """A port an outgoing connection can be given (the kernel's ephemeral range) is never handed
    to a server a test is about to start: the server's bind would lose that race (uvicorn exits
    3)."""
    eph_lo, eph_hi = _ephemeral_range()
    for n in (1, 3, 12):
        for _ in range(50):
            base = find_port_block(n)
            assert all(not eph_lo <= p <= eph_hi for p in range(base, base + n)), (base, n)
            assert base >= 20000 and base + n - 1 <= 65535
