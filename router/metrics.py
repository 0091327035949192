"""Prometheus metrics of one router app (own CollectorRegistry, so apps can share a process).

The names are a contract with deploy/grafana/kvrouter-dashboard.json; do not rename.
Per-worker state that lives elsewhere (subscriber counters, index residency, health, in-flight)
is read at scrape time by a custom collector from :func:`fleet_state`, so the numbers can never
drift from the source.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from indexer.index import PrefixIndex
    from indexer.subscriber import SourceStatus
    from router.workers import ModelNames, Worker

__all__ = ["AdmissionMetrics", "RouterMetrics", "fleet_state", "model_label", "version"]

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
_DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025)
_ERROR_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)


class _StateCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        s = self._snapshot()
        inflight = GaugeMetricFamily(
            "kvrouter_worker_inflight_requests", "Requests in flight per worker", labels=["worker"]
        )
        healthy = GaugeMetricFamily(
            "kvrouter_worker_healthy", "1 if the worker's /health answers", labels=["worker"]
        )
        stalled = GaugeMetricFamily(
            "kvrouter_worker_stalled",
            "1 while engines of the worker are skipped: they have had requests waiting and none "
            "running for server.worker_stall_s",
            labels=["worker"],
        )
        degraded = GaugeMetricFamily(
            "kvrouter_worker_degraded",
            "1 if the index of this worker cannot be trusted (gap without replay, overflow)",
            labels=["worker"],
        )
        resident = GaugeMetricFamily(
            "kvrouter_index_resident_blocks",
            "Blocks the index holds per worker and medium",
            labels=["worker", "medium"],
        )
        events = CounterMetricFamily(
            "kvrouter_events", "KV events received per worker", labels=["worker"]
        )
        gaps = CounterMetricFamily(
            "kvrouter_event_gaps", "Sequence gaps seen per worker", labels=["worker"]
        )
        replays = CounterMetricFamily(
            "kvrouter_replays", "Replay attempts per worker and result", labels=["worker", "result"]
        )
        decode = CounterMetricFamily(
            "kvrouter_decode_errors", "Undecodable event payloads per worker", labels=["worker"]
        )
        restarts = CounterMetricFamily(
            "kvrouter_publisher_restarts", "Event publisher restarts per worker", labels=["worker"]
        )
        resync_restarts = CounterMetricFamily(
            "kvrouter_publisher_restarts_during_resync",
            "Event publisher restarts found while its events were being resynced",
            labels=["worker"],
        )
        for w in s.get("workers", []):
            url = w["url"]
            inflight.add_metric([url], w.get("inflight", 0))
            healthy.add_metric([url], 1.0 if w.get("healthy") else 0.0)
            stalled.add_metric([url], 1.0 if w.get("stalled") else 0.0)
            degraded.add_metric([url], 1.0 if w.get("degraded") else 0.0)
            for medium, n in w.get("resident", {}).items():
                resident.add_metric([url, medium], n)
            events.add_metric([url], w.get("events", 0))
            gaps.add_metric([url], w.get("gaps", 0))
            replays.add_metric([url, "ok"], w.get("replays_ok", 0))
            replays.add_metric([url, "failed"], w.get("replays_failed", 0))
            decode.add_metric([url], w.get("decode_errors", 0))
            restarts.add_metric([url], w.get("restarts", 0))
            resync_restarts.add_metric([url], w.get("resync_restarts", 0))
        yield from (inflight, healthy, stalled, degraded, resident, events, gaps, replays, decode)
        yield from (restarts, resync_restarts)


def _redis_fallbacks(r: CollectorRegistry) -> Counter:
    return Counter(
        "kvrouter_redis_fallbacks_total",
        "Operations on state shared through Redis served from this replica's own instead, "
        "Redis being unreachable: state=sessions (a lookup or binding kept local), "
        "state=limits (a per-key bucket taken locally: the limit holds per replica)",
        ["state"],
        registry=r,
    )


class RouterMetrics:
    def __init__(self, snapshot: Callable[[], dict[str, Any]] | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvrouter_requests_total",
            "Client requests by policy and outcome",
            ["policy", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            "kvrouter_request_duration_seconds",
            "Time from request arrival to the end of the response",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvrouter_ttft_seconds",
            "Time to first token: request arrival to the first chunk of a streamed answer "
            "(buffered answers: kvrouter_request_duration_seconds)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.route_decision = Histogram(
            "kvrouter_route_decision_seconds",
            "Time to tokenize (cache hit or worker call), match and choose",
            buckets=(*_DECISION_BUCKETS, 0.05, 0.1, 0.25, 1.0),
            registry=r,
        )
        self.predicted_hit_tokens = Counter(
            "kvrouter_predicted_hit_tokens_total",
            "Prompt tokens predicted to be served from cache on the chosen worker",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvrouter_prompt_tokens_total", "Prompt tokens routed", registry=r
        )
        self.prediction_error = Histogram(
            "kvrouter_prediction_error_tokens",
            "|predicted hit - cached_tokens the worker reported|",
            buckets=_ERROR_BUCKETS,
            registry=r,
        )
        self.redis_up = Gauge(
            "kvrouter_redis_up", "1 if Redis shared state is reachable", registry=r
        )
        self.redis_fallbacks = _redis_fallbacks(r)
        self.tokenize_failures = Counter(
            "kvrouter_tokenize_failures_total",
            "Requests routed by load alone because tokenization failed",
            registry=r,
        )
        self.model_prompt_tokens = Counter(
            "kvrouter_model_prompt_tokens_total",
            "Prompt tokens of the requests served (200), per model (model_label): the usage the "
            "worker reported, else the router's own count",
            ["model"],
            registry=r,
        )
        self.model_completion_tokens = Counter(
            "kvrouter_model_completion_tokens_total",
            "Completion tokens the workers reported in usage, per model (model_label); streams "
            "report it only when the client asked for usage",
            ["model"],
            registry=r,
        )
        Gauge(
            "kvrouter_build_info", "Always 1; the router's version", ["version"], registry=r
        ).labels(version()).set(1)
        self.prefill_priority = Counter(
            "kvrouter_prefill_priority_total",
            "Requests sent with the vLLM priority policy.prefill_priority wrote, by that class and "
            "whether it was lifted (lifted=true) to the class of a request waiting past "
            "policy.prefill_priority_max_wait_s on the same engine",
            ["class", "lifted"],
            registry=r,
        )
        self.upstream_failures = Counter(
            "kvrouter_upstream_failures_total",
            "Failed attempts to forward a request to a worker, by reason (router.proxy."
            "FAILURE_REASONS); only worker_gone, pool_timeout, connect, declined and stalled are "
            "retried",
            ["reason"],
            registry=r,
        )
        if snapshot is not None:
            r.register(_StateCollector(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _QueueDepth(Collector):
    """The admission queue's depth, read at scrape time: in total, and per priority waiting
    (only the priorities that have requests waiting, so clients cannot grow the label set)."""

    def __init__(self, depths: Callable[[], Mapping[int, int]]) -> None:
        self._depths = depths

    def collect(self) -> Iterable[Metric]:
        d = self._depths()
        total = GaugeMetricFamily(
            "kvrouter_admission_queue_depth", "Requests waiting in the admission queue"
        )
        total.add_metric([], sum(d.values()))
        by = GaugeMetricFamily(
            "kvrouter_admission_queue_depth_by_priority",
            "Requests waiting in the admission queue per request priority (lower is served first)",
            labels=["priority"],
        )
        for p, n in d.items():
            by.add_metric([str(p)], n)
        yield from (total, by)


class AdmissionMetrics:
    """The admission queue's metrics (router/admission.py); registered only when it is on."""

    def __init__(
        self, registry: CollectorRegistry, depths: Callable[[], Mapping[int, int]]
    ) -> None:
        self.wait = Histogram(
            "kvrouter_admission_wait_seconds",
            "Time requests admitted from the admission queue waited there",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        admitted = Counter(
            "kvrouter_admission_admitted_total",
            "Requests admitted: at once (via=direct) or after waiting (via=queue)",
            ["via"],
            registry=registry,
        )
        rejected = Counter(
            "kvrouter_admission_rejected_total",
            "Requests refused with 429 by admission: queue_full (max_queue waiting) or deadline "
            "(waited max_wait_s)",
            ["reason"],
            registry=registry,
        )
        abandoned = Counter(
            "kvrouter_admission_abandoned_total",
            "Requests whose client disconnected while they waited in the admission queue",
            registry=registry,
        )
        self._counters = {
            "direct": admitted.labels("direct"),
            "queue": admitted.labels("queue"),
            "queue_full": rejected.labels("queue_full"),
            "deadline": rejected.labels("deadline"),
            "abandoned": abandoned,
        }
        registry.register(_QueueDepth(depths))

    def count(self, what: str) -> None:
        """One more of ``what``: direct, queue, queue_full, deadline or abandoned."""
        self._counters[what].inc()


def version() -> str:
    """The installed kvrouter distribution's version ("unknown" when run from a bare tree)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kvrouter")
    except PackageNotFoundError:
        return "unknown"


def model_label(models: ModelNames, name: Any) -> str:
    """The ``model`` label of a request: its model name when the fleet serves it (the base
    model's names and its LoRA adapters), the base model's when it names none, else "other", so
    clients cannot grow the label set."""
    if name is None:
        return models.base or "other"
    if isinstance(name, str) and (
        name == models.base or name in models.aliases or name in models.loras
    ):
        return name
    return "other"


def fleet_state(
    workers: Iterable[Worker], index: PrefixIndex, status: Mapping[str, list[SourceStatus]]
) -> dict[str, Any]:
    """What the state collector exports, per worker: health, in-flight requests, resident
    blocks per medium (from the index), and the event counters of its sources (``status``:
    the subscriber's rows by worker URL)."""
    out = []
    for w in workers:
        rows = status.get(w.url, [])
        resident: dict[str, int] = {}
        for e in w.engines():
            st = index.engine_stats(e)
            if st is None:
                continue
            for key, n in st.resident.items():
                medium = key.split("/", 1)[1]
                resident[medium] = resident.get(medium, 0) + n
        out.append(
            {
                "url": w.url,
                "healthy": w.healthy,
                "stalled": w.stalled is not None,
                "inflight": w.inflight,
                "degraded": any(r.degraded for r in rows),
                "resident": resident,
                "events": sum(r.events for r in rows),
                "gaps": sum(r.gaps for r in rows),
                "replays_ok": sum(r.replays_ok for r in rows),
                "replays_failed": sum(r.replays_failed for r in rows),
                "decode_errors": sum(r.decode_errors for r in rows),
                "restarts": sum(r.restarts for r in rows),
                "resync_restarts": sum(r.resync_restarts for r in rows),
            }
        )
    return {"workers": out}
