"""The router's recent history for the status page: the last routing decisions and the predicted
hit rate per minute.

:meth:`Recorder.record` runs once per proxied request as it goes out (``router.app``'s
``on_sent``), so it does only O(1) work: a tuple appended to a bounded deque and three integer
additions to the current minute's bucket. Turning that into documents happens when
``/debug/index`` is read.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from indexer.index import EngineId

__all__ = ["Recorder"]


class Recorder:
    """The last ``decisions`` routing decisions and the last ``minutes`` per-minute aggregates
    (predicted hit tokens, prompt tokens, requests)."""

    __slots__ = ("_decisions", "_minutes")

    def __init__(self, decisions: int = 50, minutes: int = 30) -> None:
        # (wall time, request id, worker, dp rank, predicted hit tokens, prompt tokens, reason)
        self._decisions: deque[tuple[float, str, str, int, int, int, str]] = deque(maxlen=decisions)
        # [minute (epoch seconds // 60), predicted hit tokens, prompt tokens, requests]
        self._minutes: deque[list[int]] = deque(maxlen=minutes)

    def record(
        self, request_id: str, engine: EngineId, predicted: int, prompt: int, reason: str
    ) -> None:
        now = time.time()
        self._decisions.append((now, request_id, engine[0], engine[1], predicted, prompt, reason))
        minute = int(now // 60)
        buckets = self._minutes
        if buckets and buckets[-1][0] == minute:
            b = buckets[-1]
            b[1] += predicted
            b[2] += prompt
            b[3] += 1
        else:
            buckets.append([minute, predicted, prompt, 1])

    def decisions(self) -> list[dict[str, Any]]:
        """The recorded decisions, newest first."""
        return [
            {
                "time": round(t, 3),
                "request_id": rid,
                "worker": url,
                "dp_rank": dp,
                "predicted_hit_tokens": predicted,
                "prompt_tokens": prompt,
                "reason": reason,
            }
            for t, rid, url, dp, predicted, prompt, reason in reversed(self._decisions)
        ]

    def hit_rate(self, now: float | None = None) -> list[dict[str, Any]]:
        """One entry per minute of the window, oldest first and ending with the current minute;
        minutes without traffic are listed with zero requests and no hit rate."""
        n = self._minutes.maxlen or 0
        current = int((time.time() if now is None else now) // 60)
        seen = {b[0]: b for b in self._minutes}
        out = []
        for minute in range(current - n + 1, current + 1):
            _, predicted, prompt, requests = seen.get(minute, (minute, 0, 0, 0))
            out.append(
                {
                    "minute": minute * 60,
                    "predicted_hit_tokens": predicted,
                    "prompt_tokens": prompt,
                    "requests": requests,
                    "hit_rate": round(predicted / prompt, 4) if prompt else None,
                }
            )
        return out
