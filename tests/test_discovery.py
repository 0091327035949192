"""router.discovery against a fake Kubernetes API server on loopback that speaks the real
list+watch protocol (PodList with resourceVersion, newline-delimited watch events, BOOKMARK,
ERROR 410 Gone after compaction, label selectors, bearer tokens)."""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from test_router_support import until

from router.config import KubernetesDiscoveryConfig, WorkerSpec
from router.discovery import ApiAccess, Discovery, pod_worker

pytestmark = pytest.mark.timeout(60)

NS = "llm"


def make_pod(
    name: str,
    ip: str | None = "10.1.0.1",
    *,
    ready: bool = True,
    phase: str = "Running",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    namespace: str = NS,
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip:
        status["podIP"] = ip
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels if labels is not None else {"app": "vllm"},
            "annotations": annotations or {},
        },
        "status": status,
    }


class FakeKube:
    """Pods by namespace and name, a resourceVersion counter, an event log, and watchers."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.rv = 100
        self.log: list[tuple[int, str, dict[str, Any]]] = []
        self.compacted_below = 0
        self.cond = threading.Condition()
        self.requests: list[dict[str, Any]] = []
        self.auth_seen: list[str | None] = []
        self.fail_next_watches = 0
        self.closing = False
        self.kick = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                server.handle(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    # ---------------------------------------------------------------- test-side mutations

    def _emit(self, etype: str, pod: dict[str, Any]) -> None:
        with self.cond:
            self.rv += 1
            pod = copy.deepcopy(pod)
            pod["metadata"]["resourceVersion"] = str(self.rv)
            key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
            if etype == "DELETED":
                self.pods.pop(key, None)
            else:
                self.pods[key] = pod
            self.log.append((self.rv, etype, pod))
            self.cond.notify_all()

    def put(self, pod: dict[str, Any]) -> None:
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        self._emit("MODIFIED" if key in self.pods else "ADDED", pod)

    def delete(self, name: str, namespace: str = NS) -> None:
        self._emit("DELETED", self.pods[(namespace, name)])

    def bookmark(self) -> None:
        with self.cond:
            self.rv += 1
            self.log.append((self.rv, "BOOKMARK", {"metadata": {"resourceVersion": str(self.rv)}}))
            self.cond.notify_all()

    def compact_and_drop_watches(self) -> None:
        """Forget history (a watch from an older version gets 410) and end open watches."""
        with self.cond:
            self.compacted_below = self.rv + 1
            self.kick += 1
            self.cond.notify_all()

    # ---------------------------------------------------------------- HTTP

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(h.path)
        q = {k: v[0] for k, v in parse_qs(parts.query).items()}
        self.requests.append(q)
        self.auth_seen.append(h.headers.get("Authorization"))
        if self.token is not None and h.headers.get("Authorization") != f"Bearer {self.token}":
            return self._json(h, 401, {"kind": "Status", "code": 401, "message": "Unauthorized"})
        m = re.fullmatch(r"/api/v1/namespaces/([a-z0-9-]+)/pods", parts.path)
        if m is None:
            return self._json(h, 404, {"kind": "Status", "code": 404})
        ns = m.group(1)
        sel = q.get("labelSelector", "")
        if q.get("watch") in ("1", "true"):
            return self._watch(h, int(q.get("resourceVersion") or 0), sel, q, ns)
        with self.cond:
            items = [p for (pns, _), p in self.pods.items() if pns == ns and _matches(p, sel)]
            body = {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.rv)},
                "items": copy.deepcopy(items),
            }
        self._json(h, 200, body)

    def _json(self, h: BaseHTTPRequestHandler, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _watch(
        self, h: BaseHTTPRequestHandler, rv: int, sel: str, q: dict[str, str], ns: str
    ) -> None:
        with self.cond:
            if self.fail_next_watches > 0:
                self.fail_next_watches -= 1
                return self._json(h, 500, {"kind": "Status", "code": 500, "message": "boom"})
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.end_headers()  # HTTP/1.0: the body runs until the connection closes

        def send(obj: dict[str, Any]) -> None:
            h.wfile.write(json.dumps(obj).encode() + b"\n")
            h.wfile.flush()

        deadline = time.monotonic() + float(q.get("timeoutSeconds", "30"))
        with self.cond:
            if rv < self.compacted_below - 1:
                send(
                    {
                        "type": "ERROR",
                        "object": {
                            "kind": "Status",
                            "status": "Failure",
                            "reason": "Expired",
                            "code": 410,
                            "message": f"too old resource version: {rv}",
                        },
                    }
                )
                return
            kick = self.kick
            pos = rv
        while True:
            with self.cond:
                if self.closing or kick != self.kick or time.monotonic() > deadline:
                    return
                pending = [e for e in self.log if e[0] > pos]
                if not pending:
                    self.cond.wait(0.1)
                    continue
            for erv, etype, obj in pending:
                pos = erv
                if etype == "BOOKMARK":
                    if q.get("allowWatchBookmarks") == "true":
                        send({"type": "BOOKMARK", "object": obj})
                    continue
                if obj["metadata"]["namespace"] == ns and _matches(obj, sel):
                    send({"type": etype, "object": obj})

    def __enter__(self) -> FakeKube:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()


def _matches(pod: dict[str, Any], selector: str) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    for term in filter(None, selector.split(",")):
        k, _, v = term.partition("=")
        if labels.get(k) != v:
            return False
    return True


class Seen:
    def __init__(self) -> None:
        self.added: list[WorkerSpec] = []
        self.removed: list[str] = []
        self.current: dict[str, WorkerSpec] = {}

    def add(self, spec: WorkerSpec) -> None:
        assert spec.url not in self.current, f"added twice: {spec.url}"
        self.added.append(spec)
        self.current[spec.url] = spec

    async def remove(self, url: str) -> None:  # async callbacks are supported too
        assert url in self.current, f"removed unknown {url}"
        self.removed.append(url)
        del self.current[url]


def kcfg(**kw: Any) -> KubernetesDiscoveryConfig:
    return KubernetesDiscoveryConfig(enabled=True, namespace=NS, label_selector="app=vllm", **kw)


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube() as k:
        yield k


def test_pod_worker_mapping() -> None:
    cfg = kcfg(port=9000, dp_size_annotation="example.com/dp")
    p = make_pod(
        "a",
        "10.0.0.7",
        annotations={
            "kvrouter.io/events-port": "6000",
            "kvrouter.io/replay-port": "6001",
            "example.com/dp": "2",
        },
    )
    assert pod_worker(p, cfg) == WorkerSpec(
        url="http://10.0.0.7:9000",
        events="tcp://10.0.0.7:6000",
        replay="tcp://10.0.0.7:6001",
        dp_size=2,
        prefer_event_sources=True,
    )
    d = pod_worker(make_pod("b", "fd00::5", annotations={"kvrouter.io/dp-size": "x"}), cfg)
    assert d is not None and d.url == "http://[fd00::5]:9000" and d.dp_size == 1
    assert d.events == "tcp://[fd00::5]:5557" and d.replay == "tcp://[fd00::5]:5558"
    assert pod_worker(make_pod("c", None), cfg) is None
    assert pod_worker(make_pod("d", ready=False), cfg) is None
    assert pod_worker(make_pod("e", phase="Pending"), cfg) is None
    gone = make_pod("f")
    gone["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert pod_worker(gone, cfg) is None


async def test_list_then_watch_add_modify_delete_bookmark(kube: FakeKube) -> None:
    kube.put(make_pod("ready", "10.0.0.1", annotations={"kvrouter.io/dp-size": "2"}))
    kube.put(make_pod("pending", None, phase="Pending"))
    kube.put(make_pod("notready", "10.0.0.3", ready=False))
    kube.put(make_pod("other-app", "10.0.0.4", labels={"app": "web"}))
    seen = Seen()
    static = WorkerSpec(url="http://static:8000")
    d = Discovery(
        kcfg(),
        on_add=seen.add,
        on_remove=seen.remove,
        static=[static],
        api=ApiAccess.from_url(kube.url),
    )
    await d.start()
    try:
        assert await d.wait_synced(10)
        assert set(seen.current) == {"http://static:8000", "http://10.0.0.1:8000"}
        assert seen.current["http://10.0.0.1:8000"].dp_size == 2
        assert kube.requests[0]["labelSelector"] == "app=vllm"
        list_rv = d.status.resource_version
        await until(lambda: d.status.connected, 10, "watch to start")
        watch_q = next(q for q in kube.requests if q.get("watch"))
        assert watch_q["resourceVersion"] == list_rv and watch_q["allowWatchBookmarks"] == "true"

        # Pending pod gets an IP and becomes Ready: joins.
        kube.put(make_pod("pending", "10.0.0.2"))
        await until(lambda: "http://10.0.0.2:8000" in seen.current, 10, "pending pod to join")
        # A Ready pod becomes not Ready: leaves.
        kube.put(make_pod("ready", "10.0.0.1", ready=False))
        await until(lambda: "http://10.0.0.1:8000" in seen.removed, 10, "not-ready pod to leave")
        # Not-ready pod becomes Ready, then is deleted.
        kube.put(make_pod("notready", "10.0.0.3"))
        await until(lambda: "http://10.0.0.3:8000" in seen.current, 10)
        kube.delete("notready")
        await until(lambda: "http://10.0.0.3:8000" in seen.removed, 10, "deleted pod to leave")
        # Annotation change (new events port): removed and added again with the new spec.
        kube.put(make_pod("pending", "10.0.0.2", annotations={"kvrouter.io/events-port": "7000"}))
        await until(
            lambda: (
                (s := seen.current.get("http://10.0.0.2:8000")) is not None
                and s.events == "tcp://10.0.0.2:7000"
            ),
            10,
        )
        # A pod of another app never shows up; a bookmark advances the version only.
        kube.put(make_pod("other-app", "10.0.0.4", labels={"app": "web"}))
        kube.bookmark()
        await until(lambda: d.status.bookmarks >= 1, 10, "bookmark")
        assert d.status.resource_version == str(kube.rv)
        assert set(seen.current) == {"http://static:8000", "http://10.0.0.2:8000"}
        assert d.status.lists == 1  # all of it over one watch, no relist
    finally:
        await d.stop()
    assert "http://static:8000" not in seen.removed


async def test_410_gone_relists_and_reconciles(kube: FakeKube) -> None:
    kube.put(make_pod("a", "10.0.0.1"))
    kube.put(make_pod("b", "10.0.0.2"))
    seen = Seen()
    d = Discovery(kcfg(), on_add=seen.add, on_remove=seen.remove, api=ApiAccess.from_url(kube.url))
    await d.start()
    try:
        await until(lambda: d.status.connected and len(seen.current) == 2, 10)
        # While history is compacted (these events never reach a watch): b dies, c appears.
        with kube.cond:
            kube.delete("b")
            kube.put(make_pod("c", "10.0.0.3"))
            kube.compact_and_drop_watches()  # a watch from any older version now gets 410
        await until(lambda: d.status.relists_410 >= 1, 10, "a 410 relist")
        await until(
            lambda: set(seen.current) == {"http://10.0.0.1:8000", "http://10.0.0.3:8000"},
            10,
            "reconciled state after relist",
        )
        assert seen.removed == ["http://10.0.0.2:8000"]
        assert [s.url for s in seen.added].count("http://10.0.0.1:8000") == 1  # not re-added
        assert d.status.lists == 2
        # Watching again from the new list.
        kube.put(make_pod("d", "10.0.0.4"))
        await until(lambda: "http://10.0.0.4:8000" in seen.current, 10)
    finally:
        await d.stop()


async def test_watch_errors_back_off_and_resume_from_last_version(kube: FakeKube) -> None:
    kube.put(make_pod("a", "10.0.0.1"))
    seen = Seen()
    d = Discovery(
        kcfg(),
        on_add=seen.add,
        on_remove=seen.remove,
        api=ApiAccess.from_url(kube.url),
        backoff_s=(0.05, 0.2),
        watch_timeout_s=1,  # watches end normally every second and are resumed
    )
    kube.fail_next_watches = 2
    await d.start()
    try:
        await until(lambda: d.status.connected, 10, "watch after two failures")
        assert d.status.errors == 2 and d.status.lists == 1
        await until(lambda: d.status.watches >= 5, 10, "watches resumed after timeouts")
        kube.put(make_pod("b", "10.0.0.2"))
        await until(lambda: "http://10.0.0.2:8000" in seen.current, 10)
        assert d.status.lists == 1  # resumed from the last version, never relisted
        resumed = [q["resourceVersion"] for q in kube.requests if q.get("watch")]
        assert all(int(rv) >= int(resumed[0]) for rv in resumed)
    finally:
        await d.stop()


async def test_kubeconfig_with_token_and_stop_is_prompt(tmp_path: Path) -> None:
    with FakeKube(token="s3cret") as kube:
        kube.put(make_pod("a", "10.0.0.1"))
        cfgfile = tmp_path / "kubeconfig"
        cfgfile.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
                    "users": [{"name": "u", "user": {"token": "s3cret"}}],
                    "contexts": [{"name": "c", "context": {"cluster": "fake", "user": "u"}}],
                    "current-context": "c",
                }
            )
        )
        seen = Seen()
        d = Discovery(
            kcfg(),
            on_add=seen.add,
            on_remove=seen.remove,
            api=lambda: ApiAccess.from_kubeconfig(str(cfgfile)),
        )
        await d.start()
        try:
            await until(lambda: "http://10.0.0.1:8000" in seen.current, 10)
            await until(lambda: d.status.connected, 10)
            assert set(kube.auth_seen) == {"Bearer s3cret"}
        finally:
            t = time.monotonic()
            await d.stop()
            assert time.monotonic() - t < 2.0  # cancels a watch that is waiting for events


async def test_disabled_reports_static_only() -> None:
    seen = Seen()
    d = Discovery(
        KubernetesDiscoveryConfig(enabled=False),
        on_add=seen.add,
        on_remove=seen.remove,
        static=[WorkerSpec(url="http://s1:8000"), WorkerSpec(url="http://s2:8000")],
    )
    await d.start()
    assert await d.wait_synced(1)
    assert set(seen.current) == {"http://s1:8000", "http://s2:8000"}
    await d.stop()


async def test_router_follows_pods_without_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router picks a Ready pod up, routes to it, drops it when it stops being Ready and
    takes it back, all from the pod watch (fake API server, simulated vLLM worker)."""
    import httpx
    from test_router_support import serve_router

    from router.config import Config
    from simulator.testing import running_fleet

    with running_fleet(1, decode_ms=1, prefill_tps=400000) as fleet, FakeKube() as kube:
        w = fleet[0]
        events_port = w.events_endpoint.rpartition(":")[2]
        replay_port = w.replay_endpoint.rpartition(":")[2]
        pod = make_pod("vllm-0", "127.0.0.1")  # no annotation: the worker says where
        kube.put(pod)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
                    "users": [{"name": "u", "user": {}}],
                    "contexts": [{"name": "c", "context": {"cluster": "fake", "user": "u"}}],
                    "current-context": "c",
                }
            )
        )
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        cfg = Config()
        cfg.discovery.kubernetes = kcfg(port=w.port)
        body = {"model": "sim-model", "prompt": "hello pods", "max_tokens": 2}
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: c.get(base + "/ready"), 20)

            async def ready() -> bool:
                return (await c.get(base + "/ready")).status_code == 200

            await until(ready, 20, "router ready on the discovered pod")
            r = await c.post(base + "/v1/completions", json=body)
            assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == w.url
            d = (await c.get(base + "/debug/index")).json()
            assert d["discovery"]["pods_ready"] == [f"{NS}/vllm-0"]
            assert d["workers"][0]["events_endpoint"] == f"tcp://*:{events_port}"
            assert d["workers"][0]["replay_endpoint"] == f"tcp://*:{replay_port}"

            kube.put(make_pod("vllm-0", "127.0.0.1", ready=False))
            await until(lambda: not router.registry.workers, 10, "worker dropped")
            r = await c.post(base + "/v1/completions", json=body)
            assert r.status_code == 503
            assert not router.index.engines()

            kube.put(pod)
            await until(ready, 20, "worker back")
            r = await c.post(base + "/v1/completions", json=body)
            assert r.status_code == 200


async def test_several_namespaces_are_watched_each_on_its_own(kube: FakeKube) -> None:
    kube.put(make_pod("a", "10.0.0.1"))
    kube.put(make_pod("b", "10.0.0.2", namespace="team-b"))
    kube.put(make_pod("c", "10.0.0.3", namespace="not-watched"))
    seen = Seen()
    d = Discovery(
        kcfg(namespaces=[NS, "team-b"]),
        on_add=seen.add,
        on_remove=seen.remove,
        api=ApiAccess.from_url(kube.url),
    )
    await d.start()
    try:
        assert await d.wait_synced(10)
        assert sorted(seen.current) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
        await until(lambda: all(st.connected for st in d.statuses.values()), 10, "both watches")
        kube.delete("b", namespace="team-b")
        await until(lambda: "http://10.0.0.2:8000" not in seen.current, 10, "b removed")
        kube.put(make_pod("b2", "10.0.0.4", namespace="team-b"))
        await until(lambda: "http://10.0.0.4:8000" in seen.current, 10, "b2 added")
        # A relist of one namespace reconciles that namespace only.
        kube.compact_and_drop_watches()
        await until(lambda: d.statuses[NS].relists_410 >= 1, 10, "a 410 relist of one")
        assert sorted(seen.current) == ["http://10.0.0.1:8000", "http://10.0.0.4:8000"]
        assert set(d.debug()["namespaces"]) == {NS, "team-b"}
    finally:
        await d.stop()
