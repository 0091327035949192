"""The cap on resident entries: past it, the engine holding the most is reset.

Exceeding the cap means events were lost (missed removals) or the cap is too small for the
fleet. Resetting the largest engine keeps the index under the cap and drops entries it can no
longer vouch for; the reset engine is reported so the caller (the subscriber) marks it degraded
until its events rebuild it.
"""

from __future__ import annotations

from indexer.engine_state import EngineState
from indexer.residency import Residency
from indexer.types import EngineId

__all__ = ["enforce_cap"]


def enforce_cap(
    residency: Residency,
    engines: dict[EngineId, EngineState],
    max_entries: int,
    overflowed: list[EngineId],
) -> None:
    """Reset the largest engines until ``residency`` holds at most ``max_entries`` entries,
    counting ``overflow_resets`` on each and appending it to ``overflowed``."""
    while residency.total > max_entries and engines:
        largest = max(engines.values(), key=lambda x: sum(x.resident.values()))
        residency.drop(largest)
        largest.counters["overflow_resets"] += 1
        overflowed.append(largest.engine)
