"""Worker discovery: the static list plus vLLM pods found in Kubernetes by label.

    d = Discovery(cfg.discovery.kubernetes, static=cfg.workers, on_add=..., on_remove=...)
    await d.start()      # static workers are reported at once, pods as they become Ready
    ...
    await d.stop()

``on_add(WorkerSpec)`` is called when a worker joins (a static entry at start, a pod that is
Running and Ready with an IP) and ``on_remove(url)`` when it leaves (pod deleted, terminating,
no longer Ready, or its IP/ports changed: remove then add). Both may be plain functions or
coroutine functions; they are called from the event loop, in order, one at a time.

**Protocol.** The real Kubernetes list+watch: ``LIST`` the pods of ``namespace`` matching
``label_selector`` (paged with ``limit``/``continue``), reconcile, then ``WATCH`` from the
list's ``resourceVersion`` with ``allowWatchBookmarks=true``. Each event's object carries the
new resourceVersion; ``BOOKMARK`` only advances it. A watch that ends normally (the server's
``timeoutSeconds``) is resumed from the last resourceVersion; ``ERROR`` with code 410 (Gone:
the version was compacted) or an HTTP 410 means relist; other errors and broken connections
back off exponentially (0.2 s doubling to 10 s, with jitter) and resume.

**Why httpx and not the official client's ``watch.Watch``.** ``kubernetes_asyncio`` is not
available, and the sync client's watch blocks a thread in a read that cannot be interrupted
(stopping waits for the next event or the server timeout), hides the 410 handling, and would
put every callback on a foreign thread. So the official ``kubernetes`` package does what it is
best at (resolving credentials: in-cluster service-account token with rotation, CA bundle,
kubeconfig with tokens, client certificates or exec plugins), and the list+watch itself is a
small asyncio loop over ``httpx`` that is cancelled instantly and whose protocol handling is
visible and tested (against a fake API server in ``tests/test_discovery.py``).

**InferencePool mode** (``discovery.kubernetes.inference_pool``): the pool
(``inference.networking.k8s.io/v1``) is read first; its ``selector.matchLabels`` replaces
``label_selector`` and each ``targetPorts`` entry ``i`` makes one worker per pod, ``url =
http://<podIP>:<port_i>`` with events and replay at the annotated ports ``+ i`` (a vLLM DP rank
served by its own API server publishes at the configured port plus its rank) and ``dp_size`` 1.
The pool is read again whenever a watch ends (the server's ``timeoutSeconds``), so a changed
selector or port list applies within ``watch_timeout_s``.

**Pod to worker.** ``url = http://<podIP>:<port>``. Its event sources come from the pod's own
``GET /kv_event_sources`` first (as for static workers); only when that has none (an older
vLLM) are ``events = tcp://<podIP>:<events-port>``, ``replay = tcp://<podIP>:<replay-port>``
and ``dp_size`` taken from the annotations named in ``discovery.kubernetes``, else from its
``events_port`` / ``replay_port`` (defaults 5557, 5558; ``replay_port: null`` or the annotation
value ``none`` for no replay socket, as pods set up the llm-d way have). An unparsable
annotation falls back to the default with a warning. A pod with ``deletionTimestamp`` is
treated as gone. Several namespaces (``namespaces``) get one list+watch each; the router's
Role must then be bound in each of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from router.config import KubernetesDiscoveryConfig, WorkerSpec

__all__ = [
    "ApiAccess",
    "Discovery",
    "PoolMembers",
    "pod_worker",
    "pool_workers",
]

log = logging.getLogger("kvrouter.discovery")

OnAdd = Callable[[WorkerSpec], Awaitable[None] | None]
OnRemove = Callable[[str], Awaitable[None] | None]

_json = msgspec.json.Decoder()


@dataclass
class ApiAccess:
    """Where the API server is and how to authenticate (built from the official client's
    configuration loaders, or given explicitly)."""

    host: str
    token: Callable[[], str | None] = lambda: None
    """Returns the ``Authorization`` header value (``Bearer ...``), re-read on every request
    so rotated service-account tokens are picked up."""
    verify: ssl.SSLContext | bool | str = True
    cert: tuple[str, str] | None = None

    @classmethod
    def from_url(cls, url: str, token: str | None = None, verify: bool | str = True) -> ApiAccess:
        header = f"Bearer {token}" if token else None
        return cls(host=url.rstrip("/"), token=lambda: header, verify=verify)

    @classmethod
    def _from_configuration(cls, c: Any) -> ApiAccess:
        def token() -> str | None:
            v = c.get_api_key_with_prefix("BearerToken")  # runs the refresh hook, if any
            if v and not v.lower().startswith("bearer "):
                v = f"Bearer {v}"
            return v or None

        verify: ssl.SSLContext | bool | str = bool(c.verify_ssl)
        if c.verify_ssl and c.ssl_ca_cert:
            verify = ssl.create_default_context(cafile=c.ssl_ca_cert)
            if c.cert_file and c.key_file:
                verify.load_cert_chain(c.cert_file, c.key_file)
        cert = (c.cert_file, c.key_file) if c.cert_file and c.key_file else None
        if isinstance(verify, ssl.SSLContext):
            cert = None  # already in the context
        return cls(host=str(c.host).rstrip("/"), token=token, verify=verify, cert=cert)

    @classmethod
    def from_incluster(cls) -> ApiAccess:
        from kubernetes import client, config

        c = client.Configuration()
        config.load_incluster_config(client_configuration=c)
        return cls._from_configuration(c)

    @classmethod
    def from_kubeconfig(cls, path: str | None = None, context: str | None = None) -> ApiAccess:
        from kubernetes import client, config

        c = client.Configuration()
        config.load_kube_config(config_file=path, context=context, client_configuration=c)
        return cls._from_configuration(c)

    @classmethod
    def auto(cls) -> ApiAccess:
        """In-cluster when running in a pod (``KUBERNETES_SERVICE_HOST``), else kubeconfig
        (``KUBECONFIG`` or ``~/.kube/config``)."""
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            return cls.from_incluster()
        # Read KUBECONFIG now: the client's default is captured when it is first imported.
        return cls.from_kubeconfig(os.environ.get("KUBECONFIG") or None)


class _Gone(Exception):
    """The resourceVersion is too old (410): relist."""


def _port_annotation(
    annotations: dict[str, Any], name: str, default: int | None, pod: str
) -> int | None:
    """A port from an annotation; ``none`` (any case) means no such socket."""
    raw = annotations.get(name)
    if raw is None:
        return default
    if str(raw).strip().lower() == "none":
        return None
    return _int_annotation(annotations, name, default, pod)


def _int_annotation(annotations: dict[str, Any], name: str, default: Any, pod: str) -> Any:
    raw = annotations.get(name)
    if raw is None:
        return default
    try:
        value = int(str(raw).strip())
        if value < 1:
            raise ValueError
        return value
    except ValueError:
        log.warning("pod %s: annotation %s=%r is not a positive integer", pod, name, raw)
        return default


def _is_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or not status.get("podIP"):
        return False
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def pod_worker(pod: dict[str, Any], cfg: KubernetesDiscoveryConfig) -> WorkerSpec | None:
    """The worker a pod stands for, or None while it is not Running+Ready with an IP."""
    if not _is_ready(pod):
        return None
    meta = pod.get("metadata") or {}
    name = f"{meta.get('namespace', '')}/{meta.get('name', '?')}"
    ann = meta.get("annotations") or {}
    ip = str(pod["status"]["podIP"])
    host = f"[{ip}]" if ":" in ip else ip
    events = _port_annotation(ann, cfg.events_port_annotation, cfg.events_port, name)
    replay = _port_annotation(ann, cfg.replay_port_annotation, cfg.replay_port, name)
    dp = _int_annotation(ann, cfg.dp_size_annotation, 1, name)
    return WorkerSpec(
        url=f"http://{host}:{cfg.port}",
        events=None if events is None else f"tcp://{host}:{events}",
        replay=None if replay is None else f"tcp://{host}:{replay}",
        dp_size=dp,
        prefer_event_sources=True,
    )


POOL_API = "/apis/inference.networking.k8s.io/v1"


@dataclass(frozen=True)
class PoolMembers:
    """What an InferencePool says about its members: the pods' labels and the ports."""

    selector: str
    ports: tuple[int, ...]

    @classmethod
    def from_pool(cls, pool: dict[str, Any]) -> PoolMembers:
        spec = pool.get("spec") or {}
        labels = (spec.get("selector") or {}).get("matchLabels") or {}
        if not labels:
            raise ValueError("InferencePool has no selector.matchLabels")
        ports = tuple(int(p["number"]) for p in spec.get("targetPorts") or [])
        if not ports:
            raise ValueError("InferencePool has no targetPorts")
        return cls(",".join(f"{k}={v}" for k, v in sorted(labels.items())), ports)


def pool_workers(
    pod: dict[str, Any], cfg: KubernetesDiscoveryConfig, ports: tuple[int, ...]
) -> list[WorkerSpec | None]:
    """One worker per pool port (rank ``i`` at port ``ports[i]``, events/replay ``+ i``)."""
    base = pod_worker(pod, cfg)
    if base is None:
        return [None] * len(ports)
    host = base.url.rsplit(":", 1)[0]
    return [
        WorkerSpec(
            url=f"{host}:{port}",
            events=_offset_port(base.events, i),
            replay=_offset_port(base.replay, i),
            prefer_event_sources=True,
        )
        for i, port in enumerate(ports)
    ]


def _offset_port(endpoint: str | None, i: int) -> str | None:
    if endpoint is None:
        return None
    host, port = endpoint.rsplit(":", 1)
    return f"{host}:{int(port) + i}"


@dataclass
class _Status:
    lists: int = 0
    watches: int = 0
    relists_410: int = 0
    errors: int = 0
    events: int = 0
    bookmarks: int = 0
    resource_version: str | None = None
    last_error: str | None = None
    last_list_at: float | None = None
    connected: bool = False
    seen: dict[str, str] = field(default_factory=dict)


class Discovery:
    """Static workers plus (optionally) Kubernetes pods; see the module docstring."""

    def __init__(
        self,
        cfg: KubernetesDiscoveryConfig,
        *,
        on_add: OnAdd,
        on_remove: OnRemove,
        static: Iterable[WorkerSpec] = (),
        api: ApiAccess | Callable[[], ApiAccess] | None = None,
        watch_timeout_s: int = 300,
        request_timeout_s: float = 10.0,
        page_size: int = 500,
        backoff_s: tuple[float, float] = (0.2, 10.0),
    ) -> None:
        self.cfg = cfg
        self.on_add = on_add
        self.on_remove = on_remove
        self.static = {s.url.rstrip("/"): s for s in static}
        self._api_arg = api
        self.api: ApiAccess | None = None
        self.watch_timeout_s = watch_timeout_s
        self.request_timeout_s = request_timeout_s
        self.page_size = page_size
        self.backoff_s = backoff_s
        self._pods: dict[str, WorkerSpec] = {}
        """Pod (namespace/name) -> its worker, for pods currently Ready."""
        self._workers: dict[str, WorkerSpec] = {}
        """Every reported worker by URL (static + pods)."""
        # An InferencePool selects pods of its own namespace only.
        pool = bool(cfg.inference_pool)
        self.namespaces = [cfg.namespace] if pool else list(cfg.namespaces) or [cfg.namespace]
        self._tasks: list[asyncio.Task[None]] = []
        self._client: httpx.AsyncClient | None = None
        self.statuses = {ns: _Status() for ns in self.namespaces}
        self.status = self.statuses[self.namespaces[0]]
        """The first namespace's list+watch state (the only one, usually)."""
        self._synced = {ns: asyncio.Event() for ns in self.namespaces}
        self.pool: PoolMembers | None = None

    # ------------------------------------------------------------------ public

    def workers(self) -> dict[str, WorkerSpec]:
        return dict(self._workers)

    async def start(self) -> None:
        for spec in self.static.values():
            await self._add(spec)
        if not self.cfg.enabled:
            for ev in self._synced.values():
                ev.set()
            return
        api = self._api_arg
        if api is None:
            api = ApiAccess.auto()
        elif callable(api) and not isinstance(api, ApiAccess):
            api = api()
        self.api = api
        self._client = httpx.AsyncClient(
            base_url=api.host,
            verify=api.verify,
            cert=api.cert,
            timeout=httpx.Timeout(self.request_timeout_s),
            trust_env=False,
        )
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._run(ns), name=f"kvrouter-k8s-{ns}") for ns in self.namespaces
        ]

    async def wait_synced(self, timeout: float) -> bool:
        """Wait for the first successful LIST of every namespace (True) or the timeout."""
        try:
            async with asyncio.timeout(timeout):
                for ev in self._synced.values():
                    await ev.wait()
            return True
        except TimeoutError:
            return False

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def debug(self) -> dict[str, Any]:
        s = self.status
        return {
            "kubernetes": self.cfg.enabled,
            "namespace": self.namespaces[0],
            "namespaces": {
                ns: {"resource_version": st.resource_version, "watch_connected": st.connected}
                for ns, st in self.statuses.items()
            },
            "label_selector": self._selector,
            "inference_pool": self.cfg.inference_pool,
            "pool_ports": list(self.pool.ports) if self.pool else None,
            "api": self.api.host if self.api else None,
            "resource_version": s.resource_version,
            "watch_connected": s.connected,
            "lists": s.lists,
            "watches": s.watches,
            "relists_410": s.relists_410,
            "errors": s.errors,
            "events": s.events,
            "bookmarks": s.bookmarks,
            "last_error": s.last_error,
            "pods_ready": sorted(self._pods),
            "static": sorted(self.static),
        }

    # ------------------------------------------------------------------ reporting

    async def _call(self, fn: Callable[[Any], Any], arg: Any) -> None:
        try:
            res = fn(arg)
            if inspect.isawaitable(res):
                await res
        except Exception:
            log.exception("discovery callback for %s", arg)

    async def _add(self, spec: WorkerSpec) -> None:
        self._workers[spec.url] = spec
        log.info("worker joined: %s (events %s, dp %d)", spec.url, spec.events, spec.dp_size)
        await self._call(self.on_add, spec)

    async def _remove(self, url: str) -> None:
        if self._workers.pop(url, None) is None:
            return
        log.info("worker left: %s", url)
        await self._call(self.on_remove, url)

    async def _set_pod(self, key: str, spec: WorkerSpec | None) -> None:
        old = self._pods.get(key)
        if old == spec:
            return
        if old is not None:
            del self._pods[key]
            if old.url not in self.static and all(s.url != old.url for s in self._pods.values()):
                await self._remove(old.url)
        if spec is not None:
            self._pods[key] = spec
            if spec.url in self.static or spec.url in self._workers:
                return  # a static entry (or another pod object with the same IP) has it
            await self._add(spec)

    # ------------------------------------------------------------------ list + watch

    @property
    def _selector(self) -> str:
        return self.pool.selector if self.pool is not None else self.cfg.label_selector

    def _pod_specs(self, pod: dict[str, Any]) -> dict[str, WorkerSpec | None]:
        """Keys of ``_pods`` for one pod object and the worker behind each (None: not ready)."""
        key = _pod_key(pod)
        if self.pool is None:
            return {key: pod_worker(pod, self.cfg)}
        specs = pool_workers(pod, self.cfg, self.pool.ports)
        return {f"{key}#{i}": spec for i, spec in enumerate(specs)}

    async def _read_pool(self) -> bool:
        """Read the InferencePool; a changed selector or port list drops the pods seen so far
        (the relist that follows reports the new ones). True when it changed."""
        assert self._client is not None
        ns, name = self.cfg.namespace, self.cfg.inference_pool
        r = await self._client.get(
            f"{POOL_API}/namespaces/{ns}/inferencepools/{name}", headers=self._headers()
        )
        r.raise_for_status()
        members = PoolMembers.from_pool(_json.decode(r.content))
        if members != self.pool:
            for key in list(self._pods):
                await self._set_pod(key, None)
            log.info(
                "InferencePool %s/%s: pods %s, ports %s", ns, name, members.selector, members.ports
            )
            self.pool = members
            return True
        return False

    @staticmethod
    def _path(ns: str) -> str:
        return f"/api/v1/namespaces/{ns}/pods"

    def _headers(self) -> dict[str, str]:
        h = {"Accept": "application/json"}
        tok = self.api.token() if self.api else None
        if tok:
            h["Authorization"] = tok
        return h

    async def _run(self, ns: str) -> None:
        lo, hi = self.backoff_s
        delay = lo
        rv: str | None = None
        status = self.statuses[ns]
        while True:
            try:
                if rv is None:
                    if self.cfg.inference_pool:
                        await self._read_pool()
                    rv = await self._list(ns)
                    self._synced[ns].set()
                    delay = lo
                rv = await self._watch(ns, rv)
                delay = lo  # a watch that ended normally: resume at once
                if self.cfg.inference_pool and await self._read_pool():
                    rv = None  # the pool changed: list its (new) pods
                continue
            except asyncio.CancelledError:
                raise
            except _Gone:
                status.relists_410 += 1
                log.info("pod watch: resourceVersion %s is gone (410); relisting", rv)
                rv = None
                continue
            except Exception as exc:
                status.errors += 1
                status.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("pod list/watch failed (%s); retrying in %.1fs", exc, delay)
            finally:
                status.connected = False
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, hi)

    async def _list(self, ns: str) -> str:
        assert self._client is not None
        status = self.statuses[ns]
        seen: dict[str, WorkerSpec | None] = {}
        cont: str | None = None
        rv = ""
        while True:
            params: dict[str, Any] = {"labelSelector": self._selector}
            if self.page_size:
                params["limit"] = self.page_size
            if cont:
                params["continue"] = cont
            r = await self._client.get(self._path(ns), params=params, headers=self._headers())
            if r.status_code == 410:
                raise _Gone()  # the continue token expired: start over
            r.raise_for_status()
            body = _json.decode(r.content)
            for pod in body.get("items") or []:
                seen.update(self._pod_specs(pod))
            meta = body.get("metadata") or {}
            rv = str(meta.get("resourceVersion") or "")
            cont = meta.get("continue") or None
            if not cont:
                break
        for key in [k for k in self._pods if k.startswith(f"{ns}/") and k not in seen]:
            await self._set_pod(key, None)
        for key, spec in seen.items():
            await self._set_pod(key, spec)
        status.lists += 1
        status.last_list_at = time.time()
        status.resource_version = rv
        return rv

    async def _watch(self, ns: str, rv: str) -> str:
        assert self._client is not None
        status = self.statuses[ns]
        params = {
            "labelSelector": self._selector,
            "watch": "1",
            "resourceVersion": rv,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.watch_timeout_s),
        }
        timeout = httpx.Timeout(self.request_timeout_s, read=self.watch_timeout_s + 30.0)
        status.watches += 1
        async with self._client.stream(
            "GET", self._path(ns), params=params, headers=self._headers(), timeout=timeout
        ) as r:
            if r.status_code == 410:
                raise _Gone()
            if r.status_code != 200:
                await r.aread()
                raise httpx.HTTPStatusError(
                    f"watch returned {r.status_code}: {r.text[:200]}", request=r.request, response=r
                )
            status.connected = True
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                rv = await self._event(ns, _json.decode(line), rv)
        return rv

    async def _event(self, ns: str, ev: dict[str, Any], rv: str) -> str:
        status = self.statuses[ns]
        etype = ev.get("type")
        obj = ev.get("object") or {}
        if etype == "ERROR":
            code = obj.get("code")
            if code == 410:
                raise _Gone()
            raise RuntimeError(f"watch ERROR event: {obj.get('message') or obj}")
        new_rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
        status.resource_version = new_rv
        if etype == "BOOKMARK":
            status.bookmarks += 1
            return new_rv
        status.events += 1
        if etype in ("ADDED", "MODIFIED"):
            for key, spec in self._pod_specs(obj).items():
                await self._set_pod(key, spec)
        elif etype == "DELETED":
            for key in self._pod_specs(obj):
                await self._set_pod(key, None)
        return new_rv


def _pod_key(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"
