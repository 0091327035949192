"""Self-verification: how right is the index?

For every proxied request the router knows the hit it predicted on the engine that served it
(the index's GPU hit plus CPU extension, ``PrefixMatch.gpu_tokens + cpu_tokens``) and the worker
tells it what it really found (``usage.prompt_tokens_details.cached_tokens``, which in vLLM counts
local and connector-loaded tokens alike) and how many prompt tokens it saw
(``usage.prompt_tokens``). :class:`Verifier` compares the two per engine:

* metrics: ``kvrouter_prediction_error_tokens`` (|predicted - cached|), ``kvrouter_predictions_total
  {worker,result=exact|over|under}``, ``kvrouter_worker_prediction_accuracy{worker}`` (fraction of
  the last ``verify.window`` requests predicted within one block), ``kvrouter_worker_unverified
  {worker}``, ``kvrouter_index_resets_total{worker,reason}``;
* drift: with at least ``verify.min_samples`` samples and an accuracy below
  ``verify.min_accuracy`` an engine is **unverified**: it gets no prefix credit (routed by load
  only), ``/debug/index`` shows it with a diagnosed cause, and ONE warning is logged. Measuring
  goes on (the index is still matched for it); once a fresh window is accurate again the flag is
  cleared (re-verified).
* under-predictions on an engine with a chunked-local-attention group whose chunk the router
  was not told count as right: the index reads that group as full attention on purpose
  (``model.attention_chunk_tokens``; the self-check names it);
* causes, in the order they are checked: ``no_events`` (the subscriber has received nothing from
  a worker that reports cache hits), ``tokens_differ`` (the worker's ``prompt_tokens`` differ
  from the router's count), ``block_size_mismatch`` (``cached_tokens`` are not multiples of the
  block size the events declare), ``lost_events`` (sequence gaps, failed replays, resets, a
  degraded source), else ``unknown``.
* resets vLLM does not announce (yet): the worker's prefix-cache counters going backwards (a
  process restart the subscriber has not seen yet), the engine seen asleep at level 1 or 2
  (``vllm:engine_sleep_state``; vLLM announces the cache it dropped only after waking), or
  ``verify.reset_after_misses`` consecutive requests
  whose predicted hit collapsed (the worker found nothing, or nothing of the predicted CPU
  extension) make the router drop that engine from the index (``index.clear_engine``). Why not
  ``vllm:kv_cache_usage_perc``: vLLM counts cached-but-unused blocks as free, so that gauge is ~0
  on every idle worker whether or not its cache holds anything; it cannot tell a reset.

The hot path (:meth:`Verifier.observe`) is O(1) per request and needs no extra round trip: the
usage numbers come from the response the proxy already reads (last SSE chunk or the JSON body).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from indexer.index import EngineId, PrefixIndex

__all__ = [
    "EngineVerification",
    "Sample",
    "StreamUsageFilter",
    "Verifier",
    "VerifyCollector",
    "VerifyParams",
    "with_stream_usage",
]

log = logging.getLogger("kvrouter.verify")

NO_EVENTS = "no_events"
TOKENS_DIFFER = "tokens_differ"
BLOCK_SIZE = "block_size_mismatch"
LOST_EVENTS = "lost_events"
UNKNOWN = "unknown"


@dataclass(slots=True)
class VerifyParams:
    window: int = 50
    min_samples: int = 20
    min_accuracy: float = 0.8
    reset_after_misses: int = 3
    default_block_size: int = 16


@dataclass(slots=True)
class Sample:
    predicted: int
    cached: int
    ok: bool
    """Exact or within one block."""
    tokens_ok: bool
    misaligned: bool
    """``cached`` is not a multiple of the block size the events declare."""


@dataclass
class EngineVerification:
    engine: EngineId
    window: deque[Sample]
    exact: int = 0
    over: int = 0
    under: int = 0
    samples: int = 0
    unverified: bool = False
    cause: str | None = None
    cause_detail: str | None = None
    unverified_since: float | None = None
    recoveries: int = 0
    collapse_streak: int = 0
    predicted_tokens: int = 0
    reported_cached_tokens: int = 0
    tokens_mismatches: int = 0
    block_size: int | None = None
    bs_refresh: int = 0
    # the worker's own counters (/metrics), deltas since the router started watching
    last_hits: float | None = None
    last_queries: float | None = None
    metrics_hits: float = 0.0
    metrics_queries: float = 0.0
    sub_restarts_seen: int = 0
    index_resets: dict[str, int] = field(default_factory=dict)
    last_reset: str | None = None
    slept: bool = False
    """The engine was seen asleep at level 1 or 2 and not awake since (its index is cleared
    once per sleep)."""

    def accuracy(self) -> float | None:
        if not self.window:
            return None
        return sum(1 for s in self.window if s.ok) / len(self.window)


class Verifier:
    """Per-engine prediction bookkeeping and drift handling (see the module docstring).

    ``sub_status(engine)`` returns the subscriber's ``SourceStatus`` of an engine or None.
    """

    def __init__(
        self,
        index: PrefixIndex,
        params: VerifyParams,
        *,
        sub_status: Callable[[EngineId], Any] | None = None,
        error_histogram: Histogram | None = None,
        clock: Callable[[], float] = time.time,
        tokenizer_mismatch: Callable[[str], str | None] | None = None,
    ) -> None:
        self.index = index
        self.p = params
        self.sub_status = sub_status or (lambda e: None)
        self.error_histogram = error_histogram
        self.clock = clock
        self.tokenizer_mismatch = tokenizer_mismatch or (lambda url: None)
        """The self-check's verdict on a worker's tokenizer (a detail string when it differs)."""
        self.engines: dict[EngineId, EngineVerification] = {}

    # ---------------------------------------------------------------- state

    def state(self, engine: EngineId) -> EngineVerification:
        st = self.engines.get(engine)
        if st is None:
            st = self.engines[engine] = EngineVerification(
                engine, deque(maxlen=max(self.p.window, 1))
            )
        return st

    def is_unverified(self, engine: EngineId) -> bool:
        st = self.engines.get(engine)
        return st is not None and st.unverified

    def forget_worker(self, url: str) -> None:
        for e in [e for e in self.engines if e[0] == url]:
            del self.engines[e]

    def _block_size(self, st: EngineVerification) -> int:
        """The engine's hit alignment as its events declare it (refreshed every 64 samples)."""
        if st.block_size is None or st.bs_refresh <= 0:
            stats = self.index.engine_stats(st.engine)
            sizes = [g["block_size"] for g in stats.groups.values()] if stats else []
            sizes = [s for s in sizes if isinstance(s, int) and s > 0]
            st.block_size = math.lcm(*sizes) if sizes else None
            st.bs_refresh = 64
        st.bs_refresh -= 1
        return st.block_size or self.p.default_block_size

    # ---------------------------------------------------------------- per request

    def observe(
        self,
        engine: EngineId,
        *,
        predicted_gpu: int,
        predicted_cpu: int,
        n_tokens: int,
        cached: int,
        prompt_tokens: int | None,
        speculative: int = 0,
        stored_since: bool = False,
        removed_since: bool = False,
    ) -> Sample:
        """One served request: the index's prediction for ``engine`` vs the worker's report.

        ``stored_since``/``removed_since``: the engine's events stored or removed blocks between
        the routing decision and this report. The prediction was made from the index at decision
        time; a worker evicting blocks before it scheduled the request (over-prediction) or
        computing a shared prefix for a concurrent request (under-prediction) is a race the
        events themselves show, not a wrong index -- under a thrashing load (round robin on
        small caches) such races are frequent. Events off, an unannounced reset, different
        tokens or block sizes leave no such trace (or have their own signal), so they are still
        caught."""
        st = self.state(engine)
        learned = st.block_size is not None
        bs = self._block_size(st)
        predicted = predicted_gpu + predicted_cpu
        diff = predicted - cached
        if self.error_histogram is not None:
            self.error_histogram.observe(abs(diff))
        if diff == 0:
            st.exact += 1
        elif diff > 0:
            st.over += 1
        else:
            st.under += 1
        # Within one block counts as right. No leniency for under-predictions a speculative
        # entry would explain: a repeated prompt whose events never arrive looks exactly so.
        tokens_ok = prompt_tokens is None or prompt_tokens == n_tokens
        # A race only excuses a prediction made over the worker's own tokens.
        raced = tokens_ok and ((diff > 0 and removed_since) or (diff < 0 and stored_since))
        # A chunked-attention group whose chunk the router was not told is matched as full
        # attention on purpose: its under-predictions are the price of never over-crediting,
        # and routing such an engine by load alone would lose the hits the index does see.
        under_by_design = diff < 0 and tokens_ok and self.index.attention_chunk_unknown(engine)
        ok = abs(diff) <= bs or raced or under_by_design
        if not tokens_ok:
            st.tokens_mismatches += 1
        misaligned = (learned or st.block_size is not None) and cached % bs != 0
        if misaligned and cached == n_tokens - 1:
            misaligned = False  # a fully cached prompt ends where it ends
        s = Sample(predicted, cached, ok, tokens_ok, misaligned)
        st.samples += 1
        st.predicted_tokens += predicted
        st.reported_cached_tokens += cached
        st.window.append(s)
        # A collapse: the worker found nothing of a predicted hit, or none of the predicted CPU
        # extension. Once is an eviction race; ``reset_after_misses`` in a row is a reset.
        collapsed = (
            predicted >= bs
            and not removed_since  # evictions the events announced explain a collapse
            and (cached == 0 or (predicted_cpu > 0 and cached <= predicted_gpu))
        )
        if collapsed:
            st.collapse_streak += 1
            if self.p.reset_after_misses > 0 and st.collapse_streak >= self.p.reset_after_misses:
                self.reset_engine(
                    engine,
                    "unannounced_reset",
                    f"{st.collapse_streak} requests in a row found nothing of the predicted hit "
                    f"(last: predicted {predicted}, worker cached {cached}); the worker's cache "
                    "was reset without AllBlocksCleared",
                )
        elif diff <= 0:
            st.collapse_streak = 0
        self._evaluate(st)
        return s

    def _evaluate(self, st: EngineVerification) -> None:
        n = len(st.window)
        if n < self.p.min_samples:
            return
        acc = st.accuracy() or 0.0
        if not st.unverified and acc < self.p.min_accuracy:
            cause, detail = self.diagnose(st)
            st.unverified = True
            st.cause, st.cause_detail = cause, detail
            st.unverified_since = self.clock()
            log.warning(
                "worker %s (dp rank %d) is UNVERIFIED: %d of the last %d predictions were off "
                "by more than a block (accuracy %.2f < %.2f); likely cause: %s -- %s. Routing "
                "it by load only until predictions recover.",
                st.engine[0],
                st.engine[1],
                n - sum(1 for s in st.window if s.ok),
                n,
                acc,
                self.p.min_accuracy,
                cause,
                detail,
            )
            st.window.clear()  # re-verify on a fresh window
        elif st.unverified and acc >= self.p.min_accuracy:
            log.info(
                "worker %s (dp rank %d) re-verified: accuracy %.2f over %d requests (was: %s)",
                st.engine[0],
                st.engine[1],
                acc,
                n,
                st.cause,
            )
            st.unverified = False
            st.cause = st.cause_detail = None
            st.unverified_since = None
            st.recoveries += 1

    # ---------------------------------------------------------------- diagnosis

    def diagnose(self, st: EngineVerification) -> tuple[str, str]:
        win = list(st.window)
        n = len(win) or 1
        sub = self.sub_status(st.engine)
        events = getattr(sub, "events", 0) if sub is not None else 0
        hits_seen = any(s.cached > 0 for s in win) or st.metrics_hits > 0
        if events == 0 and hits_seen:
            where = "not subscribed" if sub is None else f"subscribed at {sub.endpoint}"
            return NO_EVENTS, (
                f"no KV events received from this worker ({where}) while it reports prefix-cache "
                f"hits ({sum(s.cached for s in win)} cached tokens in the last {len(win)} "
                "requests): check --kv-events-config and that its ZMQ port is reachable"
            )
        bad_tokens = sum(1 for s in win if not s.tokens_ok)
        if bad_tokens * 4 >= n:
            return TOKENS_DIFFER, (
                f"the worker counted different prompt tokens than the router in {bad_tokens} of "
                f"{len(win)} requests: its tokenizer or chat template differs from the one the "
                "router used (local tokenizer, or another worker's /tokenize); a GPT-OSS model's "
                "chats are rendered in harmony: model.chat_format: harmony"
            )
        selfcheck = self.tokenizer_mismatch(st.engine[0])
        if selfcheck:
            return TOKENS_DIFFER, f"self-check: {selfcheck}"
        misaligned = [s.cached for s in win if s.misaligned]
        if misaligned and len(misaligned) * 4 >= n:
            declared = st.block_size
            g = 0
            for s in win:
                g = math.gcd(g, s.cached)
            stats = self.index.engine_stats(st.engine)
            c = stats.counters if stats else {}
            return BLOCK_SIZE, (
                f"events declare block_size {declared} but {len(misaligned)} of {len(win)} "
                f"cached_tokens are not multiples of it (gcd of cached_tokens: {g}; "
                f"{c.get('malformed_events', 0)} malformed and {c.get('unaligned_blocks', 0)} "
                "unaligned events): the worker's events lie about its block size"
            )
        if sub is not None and (
            sub.degraded or sub.gaps or sub.replays_failed or sub.resets or sub.queue_overflows
        ):
            return LOST_EVENTS, (
                f"events were lost: {sub.gaps} sequence gaps, {sub.replays_failed} failed "
                f"replays, {sub.resets} index resets, {sub.queue_overflows} queue overflows"
                + (f"; source degraded ({sub.degraded_reason})" if sub.degraded else "")
            )
        over = sum(1 for s in win if s.predicted > s.cached and not s.ok)
        under = sum(1 for s in win if s.predicted < s.cached and not s.ok)
        return UNKNOWN, f"{over} over- and {under} under-predictions of {len(win)} requests"

    # ---------------------------------------------------------------- resets

    def reset_engine(self, engine: EngineId, reason: str, detail: str) -> None:
        st = self.state(engine)
        self.index.clear_engine(engine)
        st.index_resets[reason] = st.index_resets.get(reason, 0) + 1
        st.last_reset = f"{reason}: {detail}"
        st.collapse_streak = 0
        log.warning("index of %s (dp rank %d) reset: %s", engine[0], engine[1], detail)

    def on_metrics(self, url: str, per_rank: dict[int, dict[str, float]]) -> None:
        """The worker's /metrics (parsed per DP rank): counter deltas, restart detection, and
        sleep at level 1 or 2, which drops the prefix cache: vLLM announces that only with the
        first step after ``/wake_up``, and the first request there would be credited blocks
        that are gone."""
        for rank, vals in per_rank.items():
            e = (url, rank)
            if "sleep_awake" in vals:
                self._observe_sleep(e, vals)
            hits = vals.get("prefix_hits")
            queries = vals.get("prefix_queries")
            if hits is None or queries is None:
                continue
            st = self.state(e)
            sub = self.sub_status(e)
            restarts = (getattr(sub, "restarts", 0) + getattr(sub, "resets", 0)) if sub else 0
            if st.last_queries is not None and st.last_hits is not None:
                if queries < st.last_queries or hits < st.last_hits:
                    if restarts == st.sub_restarts_seen:
                        self.reset_engine(
                            e,
                            "restart",
                            f"its prefix-cache counters went back ({st.last_queries:.0f} -> "
                            f"{queries:.0f} queried tokens): the process restarted and no event "
                            "said so yet",
                        )
                else:
                    st.metrics_hits += hits - st.last_hits
                    st.metrics_queries += queries - st.last_queries
            st.last_hits, st.last_queries = hits, queries
            st.sub_restarts_seen = restarts

    def _observe_sleep(self, e: EngineId, vals: dict[str, float]) -> None:
        st = self.state(e)
        dropped = vals.get("sleep_weights_offloaded", 0) or vals.get("sleep_discard_all", 0)
        if dropped and not st.slept:
            st.slept = True
            self.reset_engine(
                e, "sleep", "the engine sleeps at level 1 or 2, which drops its prefix cache"
            )
        elif vals["sleep_awake"]:
            st.slept = False

    # ---------------------------------------------------------------- reporting

    def debug(self, engine: EngineId) -> dict[str, Any]:
        st = self.engines.get(engine)
        if st is None:
            return {"state": "unmeasured", "samples": 0}
        acc = st.accuracy()
        return {
            "state": "unverified"
            if st.unverified
            else ("verified" if acc is not None else "unmeasured"),
            "cause": st.cause,
            "cause_detail": st.cause_detail,
            "unverified_since": st.unverified_since,
            "accuracy": None if acc is None else round(acc, 4),
            "window": len(st.window),
            "samples": st.samples,
            "exact": st.exact,
            "over": st.over,
            "under": st.under,
            "predicted_tokens": st.predicted_tokens,
            "reported_cached_tokens": st.reported_cached_tokens,
            "tokens_mismatches": st.tokens_mismatches,
            "worker_prefix_cache_hits": st.metrics_hits,
            "worker_prefix_cache_queries": st.metrics_queries,
            "index_resets": dict(st.index_resets),
            "last_reset": st.last_reset,
            "recoveries": st.recoveries,
        }

    def by_worker(self) -> dict[str, list[EngineVerification]]:
        out: dict[str, list[EngineVerification]] = {}
        for st in self.engines.values():
            out.setdefault(st.engine[0], []).append(st)
        return out


class VerifyCollector(Collector):
    """Per-worker verification metrics, read at scrape time from the :class:`Verifier`."""

    def __init__(self, verifier: Verifier, workers: Callable[[], Iterable[str]]) -> None:
        self.v = verifier
        self.workers = workers

    def collect(self) -> Iterable[Metric]:
        acc = GaugeMetricFamily(
            "kvrouter_worker_prediction_accuracy",
            "Fraction of the last verify.window requests whose predicted hit was exact or within "
            "one block of the worker's cached_tokens",
            labels=["worker"],
        )
        unv = GaugeMetricFamily(
            "kvrouter_worker_unverified",
            "1 if the worker's predictions drifted: routed by load only",
            labels=["worker"],
        )
        preds = CounterMetricFamily(
            "kvrouter_predictions",
            "Served requests by prediction result vs the worker's cached_tokens",
            labels=["worker", "result"],
        )
        resets = CounterMetricFamily(
            "kvrouter_index_resets",
            "Engines dropped from the index by verification (unannounced reset, restart)",
            labels=["worker", "reason"],
        )
        by = self.v.by_worker()
        for url in self.workers():
            sts = by.get(url, [])
            win = [s for st in sts for s in st.window]
            if win:
                acc.add_metric([url], sum(1 for s in win if s.ok) / len(win))
            unv.add_metric([url], 1.0 if any(st.unverified for st in sts) else 0.0)
            preds.add_metric([url, "exact"], sum(st.exact for st in sts))
            preds.add_metric([url, "over"], sum(st.over for st in sts))
            preds.add_metric([url, "under"], sum(st.under for st in sts))
            reasons: dict[str, int] = {}
            for st in sts:
                for k, v in st.index_resets.items():
                    reasons[k] = reasons.get(k, 0) + v
            for k, v in reasons.items():
                resets.add_metric([url, k], v)
        yield from (acc, unv, preds, resets)


# -------------------------------------------------------------------- streaming usage

_FINISHED = b'"finish_reason":"'
_usage_dec = msgspec.json.Decoder()


def with_stream_usage(body: dict[str, Any], data: bytes) -> tuple[bytes, bool]:
    """The upstream body of a streaming request, asking for the final usage event when the client
    did not (returns ``(body bytes, True)``; the proxy then strips that event). Unchanged bytes and
    False when the client asked for usage itself (or set ``stream_options`` to something odd)."""
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        return data, False
    if so and (so.get("include_usage") or so.get("continuous_usage_stats")):
        return data, False
    new = dict(body)
    new["stream_options"] = {**(so or {}), "include_usage": True}
    return _usage_enc.encode(new), True


_usage_enc = msgspec.json.Encoder()


class StreamUsageFilter:
    """Removes the usage-only final SSE event (``"choices":[]`` with ``usage``) that the router
    asked for on the client's behalf; every other byte passes unchanged and in order.

    Until a choice has finished (a non-null ``finish_reason``) the usage event cannot come, so
    bytes are forwarded as they arrive (chunk boundaries kept); after that, whole events only, so
    the usage event can be recognised and dropped. ``usage`` holds ``(cached_tokens,
    prompt_tokens)`` once the dropped event carried them.
    """

    __slots__ = ("_cur", "_eager", "usage")

    def __init__(self) -> None:
        self._cur = b""
        self._eager = True
        self.usage: tuple[int, int | None] | None = None

    def feed(self, chunk: bytes) -> bytes:
        combined = self._cur + chunk if self._cur else chunk
        already = len(self._cur) if self._eager else 0
        out = bytearray()
        pos = 0
        while True:
            j = combined.find(b"\n\n", pos)
            if j < 0:
                break
            end = j + 2
            ev = combined[pos:end]
            if self._eager:
                out += combined[max(pos, already) : end]
                if _FINISHED in ev:
                    self._eager = False
            elif not self._drop(ev):
                out += ev
            pos = end
        if self._eager:
            out += combined[max(pos, already) :]
        self._cur = combined[pos:]
        return bytes(out)

    def flush(self) -> bytes:
        """What is left at the end of the stream (an unterminated event, never dropped)."""
        rest, self._cur = self._cur, b""
        return b"" if self._eager else rest

    def _drop(self, ev: bytes) -> bool:
        if not ev.startswith(b"data: {") or b'"usage"' not in ev:
            return False
        try:
            doc = _usage_dec.decode(ev[6:].strip())
        except msgspec.DecodeError:
            return False
        if not isinstance(doc, dict) or doc.get("choices") != [] or not doc.get("usage"):
            return False
        usage = doc["usage"]
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if isinstance(cached, int):
            self.usage = (cached, prompt if isinstance(prompt, int) else None)
        return True
