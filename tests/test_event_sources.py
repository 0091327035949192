"""Where a worker's KV events come from: its ``/kv_event_sources`` in either shape vLLM serves,
else the endpoints discovery derived from annotations or the configured ports."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from test_router_support import config_for, serve_app, serve_router, until
from vllm_publisher import Chains, VllmPublisher

from router.config import KubernetesDiscoveryConfig, WorkerSpec
from router.discovery import pod_worker
from router.event_sources import EventSource, parse_event_sources


def test_both_shapes_parse_alike() -> None:
    by_rank = b"""{"1": {"endpoint": "tcp://*:5558", "replay_endpoint": null, "topic": "t"},
                   "0": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:6000",
                         "topic": "t", "publisher": "zmq"}}"""
    array = b"""[{"data_parallel_rank": 1, "endpoint": "tcp://*:5558", "replay_endpoint": null,
                  "topic": "t"},
                 {"data_parallel_rank": 0, "endpoint": "tcp://*:5557",
                  "replay_endpoint": "tcp://*:6000", "topic": "t"}]"""
    want = [
        EventSource(0, "tcp://*:5557", "tcp://*:6000", "t"),
        EventSource(1, "tcp://*:5558", None, "t"),
    ]
    assert parse_event_sources(by_rank) == want
    assert parse_event_sources(array) == want
    assert parse_event_sources(b"{}") == [] and parse_event_sources(b"[]") == []


@pytest.mark.parametrize(
    "bad",
    [
        b"not json",
        b"3",
        b'[{"endpoint": "tcp://*:1"}]',  # no rank
        b'{"0": {"replay_endpoint": "tcp://*:2"}}',  # no endpoint
        b'{"0": {"endpoint": "tcp://*:1"}, "2": {"endpoint": "tcp://*:3"}}',  # rank 1 missing
        b'{"x": {"endpoint": "tcp://*:1"}}',
    ],
)
def test_malformed_answers_are_refused_with_a_reason(bad: bytes) -> None:
    with pytest.raises(ValueError, match="kv_event_sources"):
        parse_event_sources(bad)


def _pod(annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "ns", "annotations": annotations or {}},
        "status": {
            "phase": "Running",
            "podIP": "10.1.2.3",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def test_pod_ports_come_from_annotations_then_configuration() -> None:
    cfg = KubernetesDiscoveryConfig(enabled=True, events_port=5556, replay_port=None)
    assert pod_worker(_pod(), cfg) == WorkerSpec(
        url="http://10.1.2.3:8000",
        events="tcp://10.1.2.3:5556",
        replay=None,
        prefer_event_sources=True,
    )
    ann = {"kvrouter.io/events-port": "7000", "kvrouter.io/replay-port": "None"}
    spec = pod_worker(_pod(ann), KubernetesDiscoveryConfig(enabled=True))
    assert spec is not None and (spec.events, spec.replay) == ("tcp://10.1.2.3:7000", None)
    spec = pod_worker(_pod(), KubernetesDiscoveryConfig(enabled=True))
    assert spec is not None
    assert (spec.events, spec.replay) == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558")


def _worker(sources: Any) -> FastAPI:
    """A worker whose ``/kv_event_sources`` answers ``sources`` (None: 404, an older vLLM)."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"data": [{"id": "m", "parent": None}]})

    @app.get("/kv_event_sources")
    async def kv_event_sources() -> Response:
        if sources is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return JSONResponse(sources)

    return app


async def _subscribed(spec: WorkerSpec, sources: Any) -> tuple[str | None, str | None, str]:
    async with serve_app(_worker(sources)) as url:
        spec = WorkerSpec(**{**_fields(spec), "url": url})
        async with serve_router(config_for([])) as (_base, router):
            await router.registry.add_worker(spec)
            w = router.registry.workers[url]
            await until(lambda: w.subscribed, 10, "the worker's events resolved")
            return w.events_endpoint, w.replay_endpoint, w.topic


def _fields(spec: WorkerSpec) -> dict[str, Any]:
    return {f: getattr(spec, f) for f in spec.__struct_fields__}


async def test_the_worker_is_asked_first_then_the_fallback_is_used() -> None:
    pod = WorkerSpec(url="x", events="tcp://127.0.0.1:1", replay=None, prefer_event_sources=True)
    array = [
        {
            "data_parallel_rank": 0,
            "endpoint": "tcp://*:2",
            "replay_endpoint": None,
            "topic": "kv@10.1.2.3:8000@m",
        }
    ]
    assert await _subscribed(pod, array) == ("tcp://*:2", None, "kv@10.1.2.3:8000@m")
    assert await _subscribed(pod, None) == ("tcp://127.0.0.1:1", None, "")
    assert await _subscribed(pod, {}) == ("tcp://127.0.0.1:1", None, "")
    static = WorkerSpec(url="x", events="tcp://127.0.0.1:3", replay="tcp://127.0.0.1:4")
    assert await _subscribed(static, array) == ("tcp://127.0.0.1:3", "tcp://127.0.0.1:4", "")


async def test_an_llm_d_style_worker_is_indexed_with_no_annotation() -> None:
    """Per-pod PUB bound on the configured events port, topic ``kv@<ip>:<port>@<model>``, no
    replay socket, and a vLLM too old for ``/kv_event_sources``."""
    pub = VllmPublisher("tcp://127.0.0.1:*", None, topic="kv@127.0.0.1:8000@m")
    try:
        cfg = KubernetesDiscoveryConfig(enabled=True, events_port=pub.port, replay_port=None)
        async with serve_app(_worker(None)) as url:
            spec = pod_worker(_pod(), cfg)
            assert spec is not None
            spec = WorkerSpec(**{**_fields(spec), "url": url, "events": pub.endpoint})
            async with serve_router(config_for([])) as (_base, router):
                await router.registry.add_worker(spec)
                engine = (url, 0)
                chains = Chains()
                batch = chains.request(n_blocks=4)

                def published_and_indexed() -> bool:
                    pub.publish(batch)
                    return router.index.resident_blocks(engine) >= 4

                await until(published_and_indexed, 15, "the llm-d-style stream indexed")
                w = router.registry.workers[url]
                assert (w.replay_endpoint, w.topic) == (None, "")
    finally:
        pub.close()
