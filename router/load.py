"""The load record of one engine, as the router knows it.

One type for every place load appears: the router's own accounting per engine (``Worker.loads``,
changed by ``proxy.Ticket``), the worker's ``/metrics`` gauges (written by the registry's poll),
what other replicas report through shared state, and what the policy scores. The field names are
the keys of each engine's ``load`` in ``/debug/index`` and ``/debug/route``, which add
``head_age_s`` (``head_since`` as seconds ago: the clock is the process's own).
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
    correction: the worker's waiting queue already contains them), counted as vLLM counts
    them: a request with ``n`` choices is ``n``."""
    queued_prefill_tokens: int = 0
    """Uncached prompt tokens of this router's requests there that have not produced a token."""
    running: int = 0
    """``vllm:num_requests_running`` (last poll)."""
    waiting: int = 0
    """``vllm:num_requests_waiting`` (last poll)."""
    kv_usage: float = 0.0
    """``vllm:kv_cache_usage_perc``, a fraction 0..1 (last poll)."""
    prefilling_at_poll: int = 0
    """``prefilling_requests`` when ``waiting`` was read: how many of those waiting requests
    could be this router's own (see :meth:`foreign_waiting`)."""
    head_tokens: int = 0
    """Uncached prompt tokens of this router's oldest request there without a first token: the
    one the engine is prefilling, as it admits requests first come first served (0: none)."""
    head_since: float = 0.0
    """Since when the engine has been prefilling for this router's requests, as far as the
    router can tell (its monotonic clock): their last first token there, or the send that found
    none queued."""
    prefilled_tokens: int = 0
    """Uncached tokens of this router's requests there whose first token it saw in a stream or
    in the engine's first-token count (cumulative)."""
    prefill_seconds: float = 0.0
    """The engine's prefill time they took: from the ``head_since`` before each first token to
    it (cumulative). With :attr:`prefilled_tokens`, the engine's prefill rate as served: chunks,
    decodes riding along, no idle time (router/policy.py learns it)."""

    def set_gauges(self, waiting: int, running: int, kv_usage: float) -> None:
        """A poll of the worker's /metrics: its gauges, and this router's own requests there at
        that moment beside ``waiting``."""
        self.waiting, self.running, self.kv_usage = waiting, running, kv_usage
        self.prefilling_at_poll = self.prefilling_requests

    def foreign_waiting(self) -> int:
        """Waiting requests the router did not send (other routers', direct clients').

        Counted against the router's own requests *at the poll*, not now: ``waiting`` is up to a
        poll interval old, and subtracting the count as it is now reads the router's own
        requests that have since started as foreign ones, each priced as a whole unknown
        prompt until the next poll."""
        return max(self.waiting - self.prefilling_at_poll, 0)

    def plus(self, other: EngineLoad | None) -> EngineLoad:
        """A new record: this one with ``other``'s router-side counters added.

        ``other`` is another replica's (or the sum of several replicas') accounting for the same
        engine; the gauges are the worker's own, already seen by every replica, so they are
        taken from ``self`` alone, and so is this router's clock of its own queue there
        (``head_tokens`` to ``prefill_seconds``: other replicas' requests are in the count but
        not in it). ``None`` adds nothing (a copy, so the caller may keep it while this record
        keeps changing)."""
        if other is None:
            return msgspec.structs.replace(self)
        return msgspec.structs.replace(
            self,
            inflight_requests=self.inflight_requests + other.inflight_requests,
            prefilling_requests=self.prefilling_requests + other.prefilling_requests,
            queued_prefill_tokens=self.queued_prefill_tokens + other.queued_prefill_tokens,
            # Other replicas' requests at this router's poll are not known; their count now is
            # the nearest figure (shared state is refreshed more often than workers are polled).
            prefilling_at_poll=self.prefilling_at_poll + other.prefilling_requests,
        )

    def is_idle(self) -> bool:
        """No request of this router's there (what other replicas need to hear about)."""
        return not (
            self.inflight_requests or self.prefilling_requests or self.queued_prefill_tokens
        )
