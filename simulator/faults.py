"""Faults a test injects into one simulated worker through ``POST /sim/faults``."""

from __future__ import annotations

import asyncio
from typing import Any

from simulator.api_errors import ApiError
from simulator.lora import LoraAdapters
from simulator.runner import EngineRunner

KNOWN = frozenset(
    {
        "drop_event_fraction",
        "stall_http",
        "slowdown",
        "events_enabled",
        "unannounced_reset",
        "fail_lora_load",
        "stall_scheduler",
    }
)


class Faults:
    def __init__(self, loras: LoraAdapters | None = None) -> None:
        self.loras = loras
        self.drop_event_fraction = 0.0
        self.stall_http = False
        self.slowdown = 1.0
        self.stall_scheduler: bool | list[int] = False
        self.events_enabled = True
        self.unstall = asyncio.Event()

    def as_dict(self) -> dict[str, Any]:
        return {
            "drop_event_fraction": self.drop_event_fraction,
            "stall_http": self.stall_http,
            "slowdown": self.slowdown,
            "stall_scheduler": self.stall_scheduler,
            "events_enabled": self.events_enabled,
            "fail_lora_load": self.loras.fail_loads if self.loras is not None else False,
        }

    def apply(self, data: dict[str, Any], runners: list[EngineRunner]) -> None:
        """Set the faults named in ``data`` on this worker's engines; 400 for a bad value."""
        bad = set(data) - KNOWN
        if bad:
            raise ApiError(400, f"unknown fault keys: {sorted(bad)}")
        if "drop_event_fraction" in data:
            v = data["drop_event_fraction"]
            if not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ApiError(400, "drop_event_fraction must be in [0, 1]")
            self.drop_event_fraction = float(v)
            for r in runners:
                if r.publisher:
                    r.publisher.drop_fraction = self.drop_event_fraction
        if "slowdown" in data:
            v = data["slowdown"]
            if not isinstance(v, (int, float)) or not 0 < v <= 1000:
                raise ApiError(400, "slowdown must be in (0, 1000]")
            self.slowdown = float(v)
            for r in runners:
                r.engine.config.slowdown = self.slowdown
        if "stall_scheduler" in data:
            # The scheduler admits no waiting request while /health still answers: how vLLM's
            # scheduler looks when it deadlocks under KV pressure (running 0, waiting N).
            # True / False: every DP rank; a list: those ranks.
            v = data["stall_scheduler"]
            if isinstance(v, bool):
                ranks = {r.dp_rank for r in runners} if v else set()
            elif isinstance(v, list) and all(type(x) is int for x in v):
                ranks = set(v)
            else:
                raise ApiError(400, "stall_scheduler must be a boolean or a list of DP ranks")
            self.stall_scheduler = v
            for r in runners:
                r.engine.config.admit_waiting = r.dp_rank not in ranks
        if "events_enabled" in data:
            self.events_enabled = bool(data["events_enabled"])
            for r in runners:
                r.events_enabled = self.events_enabled
        if "stall_http" in data:
            self.stall_http = bool(data["stall_http"])
            if self.stall_http:
                self.unstall = asyncio.Event()
            else:
                self.unstall.set()
        if "fail_lora_load" in data and self.loras is not None:
            self.loras.fail_loads = bool(data["fail_lora_load"])
        if data.get("unannounced_reset"):
            for r in runners:
                r.engine.silent_reset()
