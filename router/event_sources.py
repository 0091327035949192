"""A worker's ``GET /kv_event_sources`` answer, in either of the shapes vLLM has served.

* An object mapping each DP rank (as a string) to that rank's resolved ``KVEventsConfig``:
  ``{"0": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "", ...}}``.
* A bare array with one entry per rank:
  ``[{"data_parallel_rank": 0, "endpoint": "tcp://10.0.0.1:5557", "replay_endpoint": null,
  "topic": ""}]``.

Both are empty when the worker publishes no KV events. Endpoints come back as configured (a
wildcard host is replaced later, by the subscriber).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["EventSource", "parse_event_sources"]


class EventSource(msgspec.Struct, frozen=True):
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


def parse_event_sources(body: bytes) -> list[EventSource]:
    """The sources by DP rank, in rank order; ``[]`` when events are off.

    Raises ``ValueError`` naming what is wrong with an answer of neither shape."""
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise ValueError(f"/kv_event_sources is not JSON: {exc}") from None
    if isinstance(doc, dict):
        items = [(rank, cfg) for rank, cfg in doc.items()]
    elif isinstance(doc, list):
        items = [
            (cfg.get("data_parallel_rank") if isinstance(cfg, dict) else None, cfg) for cfg in doc
        ]
    else:
        raise ValueError("/kv_event_sources is neither an object nor an array")
    out = [_source(rank, cfg) for rank, cfg in items]
    out.sort(key=lambda s: s.dp_rank)
    if [s.dp_rank for s in out] != list(range(len(out))):
        raise ValueError(f"/kv_event_sources ranks are not 0..n-1: {[s.dp_rank for s in out]}")
    return out


def _source(rank: Any, cfg: Any) -> EventSource:
    try:
        r = int(rank)
    except (TypeError, ValueError):
        raise ValueError(f"/kv_event_sources: bad DP rank {rank!r}") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("endpoint"), str):
        raise ValueError(f"/kv_event_sources: rank {r} has no endpoint")
    replay = cfg.get("replay_endpoint")
    topic = cfg.get("topic")
    return EventSource(
        r,
        cfg["endpoint"],
        replay if isinstance(replay, str) and replay else None,
        topic if isinstance(topic, str) else "",
    )
