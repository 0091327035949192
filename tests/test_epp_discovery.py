"""InferencePool discovery: the pool's selector and targetPorts, against a fake API server
that speaks the real list+watch protocol (tests/test_discovery.py's FakeKube)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

import pytest

from router.config import KubernetesDiscoveryConfig
from router.discovery import ApiAccess, Discovery
from tests.test_discovery import NS, FakeKube, Seen, make_pod
from tests.test_router_support import until

POOL_PATH = f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools/llama"


class PoolKube(FakeKube):
    """FakeKube that also serves one InferencePool."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: dict[str, Any] = {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "llama", "namespace": NS},
            "spec": {
                "selector": {"matchLabels": {"app": "llama", "tier": "gpu"}},
                "targetPorts": [{"number": 8000}, {"number": 8001}],
                "endpointPickerRef": {"name": "kvrouter-epp", "port": {"number": 9002}},
            },
        }
        self.pool_reads = 0

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        if urlsplit(h.path).path == POOL_PATH:
            self.pool_reads += 1
            return self._json(h, 200, json.loads(json.dumps(self.pool)))
        return super().handle(h)


@pytest.fixture
def kube() -> Iterator[PoolKube]:
    with PoolKube() as k:
        yield k


async def test_pool_members_are_its_selector_pods_one_worker_per_target_port(kube) -> None:
    pool_labels = {"app": "llama", "tier": "gpu"}
    kube.put(make_pod("a", "10.0.0.1", labels=pool_labels))
    kube.put(make_pod("b", "10.0.0.2", labels={"app": "llama"}))  # not the pool's
    kube.put(make_pod("c", "10.0.0.3", labels=pool_labels, ready=False))
    seen = Seen()
    cfg = KubernetesDiscoveryConfig(
        enabled=True, namespace=NS, label_selector="app=ignored", inference_pool="llama"
    )
    d = Discovery(cfg, on_add=seen.add, on_remove=seen.remove, api=ApiAccess.from_url(kube.url))
    await d.start()
    try:
        assert await d.wait_synced(10)
        assert set(seen.current) == {"http://10.0.0.1:8000", "http://10.0.0.1:8001"}
        rank1 = seen.current["http://10.0.0.1:8001"]
        assert (rank1.events, rank1.replay, rank1.dp_size) == (
            "tcp://10.0.0.1:5558",
            "tcp://10.0.0.1:5559",
            1,
        )
        assert kube.requests[0]["labelSelector"] == "app=llama,tier=gpu"
        kube.put(make_pod("c", "10.0.0.3", labels=pool_labels))  # becomes Ready: both ports
        await until(lambda: "http://10.0.0.3:8001" in seen.current, 10, "pod c to join")
        kube.delete("a")
        await until(
            lambda: {"http://10.0.0.1:8000", "http://10.0.0.1:8001"} <= set(seen.removed),
            10,
            "pod a to leave on both ports",
        )
        # The pool drops a port: at the end of the watch it is read again and applied.
        kube.pool["spec"]["targetPorts"] = [{"number": 8000}]
        kube.compact_and_drop_watches()
        await until(lambda: set(seen.current) == {"http://10.0.0.3:8000"}, 10, "the new port list")
        assert kube.pool_reads >= 2
        assert d.debug()["pool_ports"] == [8000]
    finally:
        await d.stop()
