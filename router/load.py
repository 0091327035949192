"""The load record of one engine, as the router knows it.

One type for every place load appears: the router's own accounting per engine (``Worker.loads``,
changed by ``proxy.Ticket``), the worker's ``/metrics`` gauges (written by the registry's poll),
what other replicas report through shared state, and what the policy scores. The field names are
the keys of each engine's ``load`` in ``/debug/index`` and ``/debug/route``.
"""

from __future__ import annotations

import msgspec

__all__ = ["EngineLoad"]


class EngineLoad(msgspec.Struct):
    """Load of one engine: the router's own counters and the worker's last-polled gauges."""

    inflight_requests: int = 0
    """Requests this router sent there that have not finished."""
    prefilling_requests: int = 0
    """This router's requests there that have not produced a first token (for the waiting
    correction: the worker's waiting queue already contains them)."""
    queued_prefill_tokens: int = 0
    """Uncached prompt tokens of this router's requests there that have not produced a token."""
    running: int = 0
    """``vllm:num_requests_running`` (last poll)."""
    waiting: int = 0
    """``vllm:num_requests_waiting`` (last poll)."""
    kv_usage: float = 0.0
    """``vllm:kv_cache_usage_perc``, a fraction 0..1 (last poll)."""

    def plus(self, other: EngineLoad | None) -> EngineLoad:
        """A new record: this one with ``other``'s router-side counters added.

        ``other`` is another replica's (or the sum of several replicas') accounting for the same
        engine; the gauges are the worker's own, already seen by every replica, so they are
        taken from ``self`` alone. ``None`` adds nothing (a copy, so the caller may keep it
        while this record keeps changing)."""
        if other is None:
            return EngineLoad(
                self.inflight_requests,
                self.prefilling_requests,
                self.queued_prefill_tokens,
                self.running,
                self.waiting,
                self.kv_usage,
            )
        return EngineLoad(
            self.inflight_requests + other.inflight_requests,
            self.prefilling_requests + other.prefilling_requests,
            self.queued_prefill_tokens + other.queued_prefill_tokens,
            self.running,
            self.waiting,
            self.kv_usage,
        )

    def is_idle(self) -> bool:
        """No request of this router's there (what other replicas need to hear about)."""
        return not (
            self.inflight_requests or self.prefilling_requests or self.queued_prefill_tokens
        )
