"""Worker registry: health, load (own accounting + the worker's /metrics), event sources.

One :class:`Worker` per vLLM API server (base URL); one *engine* ``(url, dp_rank)`` per
data-parallel rank, which is what the index and the policy see. Background loops per worker:

* ``GET /health`` and ``GET /metrics`` every ``poll_interval_s`` with bounded timeouts; a worker
  that fails its health check is skipped until it passes again, and so is one whose /metrics
  has shown an engine with requests waiting and none running for ``stall_after_s`` (a stalled
  scheduler: vLLM's deadlock under KV pressure keeps /health answering while nothing runs),
  and at once one that /metrics shows asleep (vLLM's sleep mode: requests wait for a wake-up);
  the requests this router has waiting there for a first token are told (``StallListener``),
  and the proxy takes them back; each poll's count of first tokens
  (``vllm:time_to_first_token_seconds_count``) releases the queued prefill of requests whose
  answer comes whole (``Worker.observe_first_tokens``);
* event-source discovery: ``workers[].events`` from config, else ``GET /kv_event_sources``
  (vLLM >= 0.32: ``{"0": {"endpoint", "replay_endpoint", "topic", ...}}`` per DP rank, ``*``
  replaced by the worker's host), retried until it answers, then handed to the subscriber.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from indexer.index import EngineId
from router.config import WorkerSpec
from router.event_sources import parse_event_sources
from router.load import EngineLoad
from router.lora import LoraSlots, parse_lora_info
from router.upstream import UpstreamClient

__all__ = [
    "NOT_REPORTED",
    "BufferedRequest",
    "ModelNames",
    "StallListener",
    "Worker",
    "WorkerRegistry",
    "parse_prefix_caching",
    "parse_retention",
    "parse_vllm_metrics",
    "serving_engines",
]

log = logging.getLogger("kvrouter.workers")

_WANTED = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
    # counters (verification: deltas vs the router's predictions; going back = restart)
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    # one per request at its first token: releases buffered requests' prefill (see Worker)
    "vllm:time_to_first_token_seconds_count": "first_tokens",
    "vllm:time_to_first_token_seconds_sum": "ttft_sum",
    # sleep mode: sleep_awake 0 while asleep; sleep_weights_offloaded / sleep_discard_all 1 at
    # levels 1 / 2, which drop the prefix cache
    "vllm:engine_sleep_state": "sleep",
}
_SLEEP = "sleep"


def parse_vllm_metrics(text: str) -> dict[int, dict[str, float]]:
    """Per DP engine index, the load gauges kvrouter uses from a worker's /metrics text."""
    out: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        name = line[:brace] if brace >= 0 else line.split(" ", 1)[0]
        field_name = _WANTED.get(name)
        if field_name is None:
            continue
        engine = 0
        if brace >= 0:
            end = line.find("}", brace)
            labels = line[brace + 1 : end]
            if field_name == _SLEEP:  # one line per state: its field is the state's name
                pos = labels.find('sleep_state="')
                if pos < 0:
                    continue
                field_name = "sleep_" + labels[pos + 13 : labels.find('"', pos + 13)]
            pos = labels.find('engine="')
            if pos >= 0:
                val = labels[pos + 8 : labels.find('"', pos + 8)]
                with contextlib.suppress(ValueError):
                    engine = int(val)
            rest = line[end + 1 :].split()
        else:
            rest = line.split()[1:]
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        slot = out.setdefault(engine, {})
        slot[field_name] = slot.get(field_name, 0.0) + value
    return out


NOT_REPORTED = -1
"""``Worker.retention`` of a worker whose /metrics does not say (the configuration applies)."""
_CACHE_INFO = "vllm:cache_config_info{"


def _cache_info(text: str, label: str) -> str | None:
    """One label of ``vllm:cache_config_info`` (vLLM's CacheConfig, exported once at
    start-up), or None when the worker does not report it."""
    pos = text.find(_CACHE_INFO)
    if pos < 0:
        return None
    end = text.find("}", pos)
    at = text.find(f'{label}="', pos, end)
    if at < 0:
        return None
    at += len(label) + 2
    return text[at : text.find('"', at, end)]


def parse_retention(text: str) -> int | None:
    """The ``prefix_cache_retention_interval`` label of ``vllm:cache_config_info``: an
    interval, None (vLLM's "None": every block kept), or ``NOT_REPORTED``."""
    value = _cache_info(text, "prefix_cache_retention_interval")
    if value == "None":
        return None
    return int(value) if value is not None and value.isdigit() else NOT_REPORTED


def parse_prefix_caching(text: str) -> bool | None:
    """The ``enable_prefix_caching`` label of ``vllm:cache_config_info``: whether the worker
    caches prefixes at all (vLLM turns it off for some models, e.g. MLA on CPU), None when
    not reported."""
    value = _cache_info(text, "enable_prefix_caching")
    return None if value is None else value == "True"


class StallListener(Protocol):
    """A request sent to an engine that has not had its first token (router/proxy.py)."""

    uncached: int
    """Its prefill tokens not cached there, as routed."""
    sent_s: float
    """When it was sent (``time.monotonic()``)."""

    @property
    def prefill_pending(self) -> bool:
        """No first token yet, as far as the router knows (an answer that comes whole is
        released by the engine's first-token count before it is back)."""
        ...

    def stall(self, reason: str) -> None:
        """The engine's scheduler is stalled: nothing there will run this request."""


class BufferedRequest(Protocol):
    """A request whose answer comes whole, so the router never sees its first token."""

    sent_s: float
    """When it was sent (the clock ``now`` is read on)."""
    sequences: int
    """Its ``n``: vLLM counts a first token, and a waiting request, per choice."""

    def engine_first_token(self, now: float | None = None) -> None:
        """The engine's counters show it has had its first token: release its prefill (``now``:
        when the first token was, as far as the poll can tell; ``time.monotonic()`` unless
        given)."""


def _oldest_started(
    pending: list[BufferedRequest], first_tokens: int, waiting: int
) -> tuple[list[BufferedRequest], int]:
    """The oldest of ``pending`` (in sending order) that ``first_tokens`` account for, each
    taking one per sequence, never one of the newest that hold the ``waiting`` sequences; and
    the first tokens left toward the next one, when fewer than its sequences (else 0)."""
    cut, held = len(pending), 0
    while cut and held < waiting:
        cut -= 1
        held += pending[cut].sequences
    out: list[BufferedRequest] = []
    for request in pending[:cut]:
        if first_tokens < request.sequences:
            return out, max(first_tokens, 0)
        first_tokens -= request.sequences
        out.append(request)
    return out, 0


@dataclass
class Worker:
    spec: WorkerSpec
    client: UpstreamClient
    healthy: bool = True
    last_health_error: str | None = None
    dp_size: int = 1
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str = ""
    subscribed: bool = False
    models: list[dict[str, Any]] = field(default_factory=list)
    loads: dict[int, EngineLoad] = field(default_factory=dict)
    metrics_ts: float = 0.0
    lora_slots: LoraSlots | None = None
    """The worker's ``vllm:lora_requests_info`` at the last poll (router/lora.py)."""
    retention: int | None = NOT_REPORTED
    """Its ``--prefix-cache-retention-interval``, as its /metrics reports it
    (router/speculative.py)."""
    prefix_caching: bool | None = None
    """Whether it caches prefixes, as its /metrics reports it (None: not reported)."""
    stalled: str | None = None
    """Why engines of the worker are skipped although its /health answers (see
    ``WorkerRegistry.routable``), None while none is."""
    stalled_ranks: frozenset[int] = frozenset()
    """The DP ranks skipped as stalled (:func:`serving_engines` leaves them out)."""
    unseen_ranks: int = 0
    """DP ranks the worker's /metrics shows beyond ``dp_size``: a worker configured with
    ``events=`` and no ``dp_size`` runs more engines than the router subscribes to and routes
    to, and vLLM's own balancer sends the router's requests to them too, where no prediction
    holds. 0 while the two agree."""
    priority_refused: str | None = None
    """Why the worker gets no request ``priority`` (its self-check's probe with one was
    refused: vLLM's V0 engine without ``--scheduling-policy priority``), None while it takes
    them."""
    stuck_since: dict[int, float] = field(default_factory=dict)
    """Per DP rank, since when every poll showed it with requests waiting and none running."""
    awaiting_first: dict[int, set[StallListener]] = field(default_factory=dict)
    """Per DP rank, this router's requests there without a first token: the ones told when
    that rank's scheduler is found stalled."""
    prefilling: dict[int, dict[StallListener, None]] = field(default_factory=dict)
    """Per DP rank, this router's requests there still counted as queued prefill, in the order
    they were sent: the first is the one the engine is prefilling (``EngineLoad.head_tokens``)."""
    buffered: dict[int, dict[BufferedRequest, None]] = field(default_factory=dict)
    """Per DP rank, this router's requests there that are answered whole and have no first
    token yet, in the order they were sent (see :meth:`observe_first_tokens`)."""
    first_tokens_seen: dict[int, tuple[int, float]] = field(default_factory=dict)
    """Per DP rank, first tokens this router saw itself (streams, answers that came whole)
    since the last poll, and the summed times to first token of those it saw as they came
    (streams)."""
    first_tokens_reported: dict[int, int] = field(default_factory=dict)
    """Per DP rank, the engine's own count of first tokens at the last poll."""
    first_tokens_partial: dict[int, int] = field(default_factory=dict)
    """Per DP rank, first tokens of the oldest buffered request's choices counted so far, too
    few to release it (a poll fell between its children's first tokens)."""
    ttft_reported: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Per DP rank, the engine's sum of times to first token at the last poll, and when that
    poll was (see :meth:`observe_first_tokens`)."""
    on_load_change: Callable[[], None] | None = None
    """Told whenever this router's load record of one of its engines changes (a send, a
    prefill released, an answer's end: ``proxy.Ticket``), so that other router replicas hear
    of it at once (``SharedState.loads_changed``)."""

    def load_changed(self) -> None:
        if self.on_load_change is not None:
            self.on_load_change()

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def host(self) -> str:
        return self.spec.host

    def engines(self) -> list[EngineId]:
        return [(self.url, r) for r in range(self.dp_size)]

    def load(self, rank: int) -> EngineLoad:
        """The live load record of engine ``rank`` (created on first use)."""
        ld = self.loads.get(rank)
        if ld is None:
            ld = self.loads[rank] = EngineLoad()
        return ld

    def saw_first_token(self, rank: int, ttft_s: float | None = None, sequences: int = 1) -> None:
        """A first token of engine ``rank`` this router saw itself (a stream's first chunk, an
        answer back, its self-check's probe): not one of its buffered requests'. ``ttft_s``:
        its time to first token where the router saw the token itself (a stream), None where
        it saw only the whole answer. ``sequences``: the request's ``n``, each of which vLLM
        counts (with about the same time to first token)."""
        n, ttft = self.first_tokens_seen.get(rank, (0, 0.0))
        self.first_tokens_seen[rank] = (n + sequences, ttft + (ttft_s or 0.0) * sequences)

    def observe_first_tokens(
        self,
        rank: int,
        count: int,
        waiting: int = 0,
        now: float | None = None,
        ttft_sum: float | None = None,
    ) -> int:
        """A poll's ``vllm:time_to_first_token_seconds_count`` of engine ``rank``: release the
        oldest buffered requests there, one per first token the engine counted since the last
        poll beyond those this router saw itself, and never one of the newest ``waiting`` (the
        same poll's ``vllm:num_requests_waiting``: requests not scheduled yet, which are the
        last sent). A request with ``n`` choices is ``n`` child requests to vLLM, in both
        counts. Returns how many were released.

        vLLM observes that histogram once per (child) request, at its first token, and each engine
        admits its waiting requests first come first served, so the oldest buffered requests
        are the ones that got theirs. Without this, a buffered request counts as queued
        prefill until its whole answer is back: through every decode step, many times its
        prefill, so the policy reads a busy engine where the prefill is long done, and the
        admission queue holds requests behind engines with room. First tokens of requests
        this router did not send (other routers, clients) release its buffered ones early, but
        never more than it has nor one still waiting; its self-check's are counted as seen. A
        count that went back (a restarted engine) only sets the baseline. ``now``: the poll's
        time (``time.monotonic()`` unless given: the routing bench's clock is simulated).

        When each first token was: ``ttft_sum`` (the same histogram's ``_sum``) grew since
        the last poll by the times to first token of every request that got its first token
        since then; less those of the streams the router saw (``saw_first_token``), over the
        first tokens it did not see, it is about their mean (high by a whole answer's the router
        saw, left in the sum as it is not known; low by the network between router and engine,
        as the streams' are measured here). A released request's first token is taken at its
        send plus that mean, never before the last poll (the count did not hold it then) nor
        after this one. That time restarts the engine's prefill clock and ends the request's
        sample of the engine's rate (``proxy.Ticket``): taken at the poll instead, a short
        prefill's sample would hold the rest of the poll interval, idle or decoding, and the
        rate learned from answers that come whole would be a fraction of the engine's (against
        vLLM 0.32: a sixth on a small model's prompts of a few hundred tokens). Without
        ``ttft_sum`` (a server that does not export it) the poll's own time stands."""
        now = time.monotonic() if now is None else now
        seen, seen_ttft = self.first_tokens_seen.pop(rank, (0, 0.0))
        last = self.first_tokens_reported.get(rank)
        self.first_tokens_reported[rank] = count
        last_ttft = self.ttft_reported.pop(rank, None)
        if ttft_sum is not None:
            self.ttft_reported[rank] = (ttft_sum, now)
        if last is None or count < last:
            return 0
        unseen = count - last - seen
        carried = self.first_tokens_partial.pop(rank, 0)
        oldest, partial = _oldest_started(
            list(self.buffered.get(rank, {})), unseen + carried, waiting
        )
        if partial:
            self.first_tokens_partial[rank] = partial
        window = None  # (the unseen first tokens' mean time to first token, the last poll)
        if (
            unseen > 0
            and ttft_sum is not None
            and last_ttft is not None
            and ttft_sum >= last_ttft[0]
        ):
            window = (max(ttft_sum - last_ttft[0] - seen_ttft, 0.0) / unseen, last_ttft[1])
        for request in oldest:  # each release leaves ``self.buffered``
            at = now
            if window is not None:
                mean_ttft, since = window
                at = min(max(request.sent_s + mean_ttft, since), now)
            request.engine_first_token(at)
        return len(oldest)

    @property
    def inflight(self) -> int:
        return sum(x.inflight_requests for x in self.loads.values())

    @property
    def served(self) -> frozenset[str]:
        """Every model name the worker answers to: base names and loaded LoRA adapters."""
        return frozenset(m["id"] for m in self.models if isinstance(m.get("id"), str))

    def serves(self, model: Any) -> bool:
        """Whether a request for ``model`` may go here (True while its models are unknown)."""
        return not self.models or not isinstance(model, str) or model in self.served

    @property
    def base_model(self) -> str | None:
        """The worker's first base (non-adapter) model name: its engines' prefix namespace."""
        return next(
            (m["id"] for m in self.models if not m.get("parent") and isinstance(m.get("id"), str)),
            None,
        )


class ModelNames:
    """Request ``model`` -> namespace: LoRA adapters are their own, base aliases map to one."""

    def __init__(self, configured: str | None) -> None:
        self.configured = configured
        self.base: str | None = configured
        self.aliases: set[str] = set()
        self.loras: set[str] = set()
        self.entries: list[dict[str, Any]] = []

    def learn(self, data: list[dict[str, Any]]) -> None:
        for m in data:
            mid = m.get("id")
            if not isinstance(mid, str):
                continue
            if m.get("parent"):
                self.loras.add(mid)
            else:
                self.aliases.add(mid)
                if self.base is None:
                    self.base = mid
            if all(e.get("id") != mid for e in self.entries):
                self.entries.append(m)

    def namespace(self, model: Any, workers: Any = ()) -> str:
        """The prefix namespace of a request for ``model``: an adapter's own name; for a base
        name, the first base name of a worker serving it (``model.name`` when configured),
        so that requests and that worker's events agree; else the fleet's first base name."""
        if isinstance(model, str) and model in self.loras:
            return model
        if self.configured is None and isinstance(model, str):
            for w in workers:
                if model in w.served and w.base_model is not None:
                    return str(w.base_model)
        return self.base or (model if isinstance(model, str) else "")

    def namespace_of(self, w: Any) -> str:
        """The namespace of worker ``w``'s engines (its events carry no model name)."""
        return self.configured or w.base_model or self.base or ""


MODELS_EVERY_POLLS = 10
"""A worker's /v1/models is re-read every this many health polls (10 s by default)."""


def serving_engines(workers: Iterable[Worker]) -> list[tuple[Worker, EngineId]]:
    """The engines of ``workers`` whose schedulers are not stalled, with their worker: where
    requests may go (every engine of ``workers`` while each one is stalled)."""
    pool = list(workers)
    serving = [(w, e) for w in pool for e in w.engines() if e[1] not in w.stalled_ranks]
    return serving or [(w, e) for w in pool for e in w.engines()]


class WorkerRegistry:
    def __init__(
        self,
        specs: list[WorkerSpec],
        *,
        model_name: str | None = None,
        connect_timeout_s: float = 5.0,
        first_byte_timeout_s: float = 600.0,
        max_connections: int = 256,
        pool_timeout_s: float = 5.0,
        poll_interval_s: float = 1.0,
        probe_timeout_s: float = 1.0,
        on_events_ready: Callable[[Worker], None] | None = None,
        upstream_api_key: str | None = None,
        stall_after_s: float = 30.0,
    ) -> None:
        """``upstream_api_key``: sent as ``Authorization: Bearer`` on every call to a worker
        (proxied requests, /tokenize, health, metrics, discovery), whatever the client sent.
        ``stall_after_s``: how long an engine may show requests waiting and none running before
        its worker is taken out of routing (0: never)."""
        self.poll_interval_s = poll_interval_s
        self.stall_after_s = stall_after_s
        self._authorization = None if upstream_api_key is None else f"Bearer {upstream_api_key}"
        self.probe_timeout_s = probe_timeout_s
        self.models = ModelNames(model_name)
        self.on_events_ready = on_events_ready
        self.on_metrics: Callable[[str, dict[int, dict[str, float]]], None] | None = None
        """Called with every parsed /metrics poll (the verifier's counter deltas)."""
        self.on_load_change: Callable[[], None] | None = None
        """Called whenever this router's load on any engine changes (``Worker.on_load_change``
        of every worker, present and future)."""
        self._max_connections = max_connections
        self._connect_timeout_s = connect_timeout_s
        self._first_byte_timeout_s = first_byte_timeout_s
        self._pool_timeout_s = pool_timeout_s
        self.workers: dict[str, Worker] = {}
        for spec in specs:
            self.workers[spec.url] = self._new_worker(spec)
        self._probe = httpx.AsyncClient(
            headers={} if self._authorization is None else {"authorization": self._authorization},
            timeout=httpx.Timeout(probe_timeout_s),
            limits=httpx.Limits(max_connections=max(4 * len(specs), 64)),
            trust_env=False,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._worker_tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._started = False
        self._rr = 0

    def _new_worker(self, spec: WorkerSpec) -> Worker:
        # The request path (proxy, /tokenize) uses the lean upstream pool (router/upstream.py
        # says why); health and /metrics polling use the shared httpx probe client.
        client = UpstreamClient(
            spec.url,
            max_connections=self._max_connections,
            connect_timeout=self._connect_timeout_s,
            first_byte_timeout=self._first_byte_timeout_s,
            pool_timeout=self._pool_timeout_s,
            authorization=self._authorization,
        )
        w = Worker(spec=spec, client=client, dp_size=spec.dp_size, topic=spec.topic)
        w.on_load_change = self._load_changed
        if not spec.prefer_event_sources:
            w.events_endpoint = spec.events
            w.replay_endpoint = spec.replay
        return w

    def _load_changed(self) -> None:
        if self.on_load_change is not None:
            self.on_load_change()

    def _start_loops(self, w: Worker) -> None:
        tasks = [
            asyncio.create_task(self._poll_loop(w)),
            asyncio.create_task(self._discover_loop(w)),
        ]
        self._worker_tasks[w.url] = tasks
        self._tasks.extend(tasks)

    # ---------------------------------------------------------------- dynamic membership

    async def add_worker(self, spec: WorkerSpec) -> Worker | None:
        """A worker joined (discovery): probe it, start its loops. None if already known."""
        if spec.url in self.workers:
            return None
        w = self.workers[spec.url] = self._new_worker(spec)
        if self._started:
            await self.check(w)
            if self.workers.get(spec.url) is w:  # not removed while probing
                self._start_loops(w)
        return w

    def remove_worker(self, url: str) -> Worker | None:
        """A worker left (discovery): stop routing to it and stop its loops. Requests still in
        flight there finish; its HTTP client is closed once they have (bounded wait)."""
        w = self.workers.pop(url, None)
        if w is None:
            return None
        for t in self._worker_tasks.pop(url, []):
            t.cancel()
            with contextlib.suppress(ValueError):
                self._tasks.remove(t)
        self._tasks.append(asyncio.create_task(self._close_when_idle(w)))
        return w

    async def _close_when_idle(self, w: Worker) -> None:
        deadline = time.monotonic() + 600.0
        try:
            while w.inflight > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
        finally:
            await w.client.aclose()

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers.values()))
        for w in list(self.workers.values()):
            self._start_loops(w)
        self._started = True

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        await asyncio.gather(*(w.client.aclose() for w in self.workers.values()))
        await self._probe.aclose()

    # ---------------------------------------------------------------- selection

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.healthy]

    def routable(self) -> list[Worker]:
        """Healthy workers with an engine whose scheduler is not stalled: where requests may
        go (to those engines: :func:`serving_engines`)."""
        return [
            w
            for w in self.workers.values()
            if w.healthy and len(w.stalled_ranks) < max(w.dp_size, 1)
        ]

    def tokenizer_workers(self, among: list[Worker] | None = None) -> list[Worker]:
        """Healthy workers (of ``among`` when given: the ones serving the request's model,
        whose tokenizer is the one that counts), rotated so /tokenize calls spread out."""
        ws = self.healthy() if among is None else [w for w in among if w.healthy]
        if not ws:
            return []
        self._rr = (self._rr + 1) % len(ws)
        return ws[self._rr :] + ws[: self._rr]

    async def post_admin(
        self, w: Worker, path: str, params: dict[str, str], timeout_s: float
    ) -> httpx.Response:
        """POST one of vLLM's admin endpoints (no body) on ``w``, with the probe client."""
        return await self._probe.post(w.url + path, params=params, timeout=timeout_s)

    # ---------------------------------------------------------------- loops

    async def refresh_models(self, w: Worker) -> None:
        """Re-read ``w``'s /v1/models: adapters come and go (vLLM's dynamic LoRA loading)."""
        r = await self._probe.get(w.url + "/v1/models")
        r.raise_for_status()
        data = r.json().get("data") or []
        w.models = [m for m in data if isinstance(m, dict)]
        self.models.learn(w.models)

    def fleet_models(self) -> list[dict[str, Any]]:
        """Every model card the workers serve, once each, healthy workers first."""
        seen: dict[str, dict[str, Any]] = {}
        workers = sorted(self.workers.values(), key=lambda w: not w.healthy)
        for m in (m for w in workers for m in w.models):
            seen.setdefault(m["id"], m)
        return list(seen.values()) or list(self.models.entries)

    async def check(self, w: Worker) -> None:
        """Probe ``w``'s /health and, when healthy, read its /metrics gauges."""
        try:
            r = await self._probe.get(w.url + "/health")
            ok = r.status_code == 200
            w.last_health_error = None if ok else f"/health returned {r.status_code}"
        except httpx.HTTPError as exc:
            ok = False
            w.last_health_error = f"{type(exc).__name__}: {exc}"
        if ok != w.healthy:
            log.info(
                "worker %s is %s", w.url, "healthy" if ok else f"unhealthy ({w.last_health_error})"
            )
        w.healthy = ok
        if not ok:
            return
        try:
            r = await self._probe.get(w.url + "/metrics")
            if r.status_code == 200:
                parsed = parse_vllm_metrics(r.text)
                for rank, vals in parsed.items():
                    w.load(rank).set_gauges(
                        int(vals.get("waiting", 0)),
                        int(vals.get("running", 0)),
                        float(vals.get("kv_usage", 0.0)),
                    )
                    if "first_tokens" in vals:
                        waiting = int(vals.get("waiting", 0))
                        w.observe_first_tokens(
                            rank, int(vals["first_tokens"]), waiting, ttft_sum=vals.get("ttft_sum")
                        )
                self._check_ranks(w, parsed)
                w.lora_slots = parse_lora_info(r.text)
                w.retention = parse_retention(r.text)
                w.prefix_caching = parse_prefix_caching(r.text)
                w.metrics_ts = time.monotonic()
                self._observe_stall(w, parsed, w.metrics_ts)
                if self.on_metrics is not None:
                    self.on_metrics(w.url, parsed)
        except httpx.HTTPError:
            pass

    @staticmethod
    def _check_ranks(w: Worker, parsed: dict[int, dict[str, float]]) -> None:
        unseen = max(max(parsed, default=0) + 1 - w.dp_size, 0)
        if unseen and unseen != w.unseen_ranks:
            log.error(
                "worker %s runs %d DP ranks (its /metrics) but is configured with dp_size=%d: "
                "the other ranks' caches are not indexed and requests reach them unpinned; "
                "set dp_size=%d on the worker (or drop events= to read /kv_event_sources)",
                w.url,
                w.dp_size + unseen,
                w.dp_size,
                w.dp_size + unseen,
            )
        w.unseen_ranks = unseen

    def _observe_stall(self, w: Worker, parsed: dict[int, dict[str, float]], now: float) -> None:
        """Take an engine of ``w`` out of routing while it has had requests waiting and none
        running for ``stall_after_s``, or at once while it sleeps (vLLM's sleep mode); back in
        at the first poll that shows otherwise.

        An engine with nothing running admits a waiting request at its next step unless its
        scheduler cannot: a CPU load in flight takes milliseconds to seconds, a deadlocked
        scheduler (vLLM under KV pressure, with /health still answering) for ever. Requests
        sent there would wait until ``first_byte_timeout_s``: the ones waiting on a rank found
        stalled are told (the proxy aborts them and tries the next engine, or answers 503); its
        cache stays indexed, since the engine keeps it. Other ranks of the worker keep serving."""
        stuck = {
            rank
            for rank, v in parsed.items()
            if v.get("waiting", 0.0) > 0 and v.get("running", 0.0) == 0
        }
        if self.stall_after_s <= 0:
            stuck = set()
        for rank in list(w.stuck_since):
            if rank not in stuck:
                del w.stuck_since[rank]
        for rank in stuck:
            w.stuck_since.setdefault(rank, now)
        # vLLM's sleep mode: an engine asleep takes requests and runs none until woken.
        asleep = frozenset(r for r, v in parsed.items() if v.get("sleep_awake", 1.0) == 0)
        stuck_long = {r for r, t in w.stuck_since.items() if now - t >= self.stall_after_s}
        stalled = asleep | stuck_long
        if stalled == w.stalled_ranks:
            return
        new = stalled - w.stalled_ranks
        w.stalled_ranks = stalled
        if not stalled:
            w.stalled = None
            log.warning("worker %s runs requests again: routable", w.url)
            return
        why = []
        if asleep:
            why.append(
                f"DP rank(s) {sorted(asleep)} asleep (vLLM sleep mode): nothing runs there "
                "until POST /wake_up"
            )
        if stuck_long - asleep:
            ranks = sorted(stuck_long - asleep)
            waiting = sum(int(parsed[r].get("waiting", 0)) for r in ranks)
            age = max(now - w.stuck_since[r] for r in ranks)
            why.append(
                f"DP rank(s) {ranks}: {waiting} requests waiting and none running for "
                f"{age:.0f} s; its scheduler admits nothing (vLLM deadlocks this way under KV "
                "pressure while /health answers): restart the worker"
            )
        w.stalled = "; ".join(why)
        log.warning("worker %s: engines skipped as stalled: %s", w.url, w.stalled)
        for rank in new:
            for waiting_request in list(w.awaiting_first.get(rank, ())):
                waiting_request.stall(w.stalled)

    def mark_failed(self, w: Worker, why: str) -> None:
        """A connect failure seen by the proxy: skip the worker until its next good probe."""
        if w.healthy:
            log.warning("worker %s marked unhealthy: %s", w.url, why)
        w.healthy = False
        w.last_health_error = why

    async def _poll_loop(self, w: Worker) -> None:
        polls = 0
        while True:
            await asyncio.sleep(self.poll_interval_s)
            polls += 1
            try:
                await self.check(w)
                if w.healthy and w.models and polls % MODELS_EVERY_POLLS == 0:
                    await self.refresh_models(w)
            except Exception:  # never let one bad answer kill the loop
                log.exception("health/metrics poll of %s failed", w.url)

    async def _discover_loop(self, w: Worker) -> None:
        delay = 0.2
        while True:
            try:
                if await self._discover(w):
                    return
            except Exception as exc:
                log.debug("discovery of %s: %s", w.url, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _discover(self, w: Worker) -> bool:
        if not w.models:
            await self.refresh_models(w)
        if w.events_endpoint is None and not await self._ask_event_sources(w):
            spec = w.spec
            if not (spec.prefer_event_sources and spec.events):
                return True  # routable by load alone; nothing to subscribe to
            log.info("worker %s: no /kv_event_sources; using %s", w.url, spec.events)
            w.events_endpoint, w.replay_endpoint = spec.events, spec.replay
        if self.on_events_ready is not None:
            self.on_events_ready(w)
        w.subscribed = True
        return True

    async def _ask_event_sources(self, w: Worker) -> bool:
        """Take ``w``'s event endpoints from its ``/kv_event_sources``; False if it has none."""
        r = await self._probe.get(w.url + "/kv_event_sources")
        if r.status_code == 404:
            log.warning("worker %s has no /kv_event_sources", w.url)
            return False
        r.raise_for_status()
        try:
            sources = parse_event_sources(r.content)
        except ValueError as exc:
            log.warning("worker %s: %s", w.url, exc)
            return False
        if not sources:
            log.warning("worker %s publishes no KV events (empty /kv_event_sources)", w.url)
            return False
        first = sources[0]
        w.events_endpoint = first.endpoint
        w.replay_endpoint = first.replay_endpoint
        w.topic = first.topic or w.topic
        w.dp_size = max(len(sources), w.spec.dp_size)
        return True
