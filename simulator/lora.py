"""LoRA adapters of one simulated worker, held the way vLLM's API server holds them.

* Static adapters (``--lora NAME``, ``--lora-modules NAME=PATH``) are loaded at start with ids
  1..n in order (``OpenAIServingModels.init_static_loras``).
* With runtime updating allowed (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, which is also what
  registers the two endpoints), ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` loads
  one more under the next id and answers 200 with plain text (``Success: LoRA adapter 'x' added
  successfully.``); a missing name or path, or a name already loaded (without ``load_inplace``),
  is a 400 ``InvalidUserInput``; an engine that fails to load it is a 400 ``BadRequestError``.
  ``POST /v1/unload_lora_adapter {"lora_name"}`` drops one (404 ``NotFoundError`` if unknown).
  Loads and unloads of one name are serialized (vLLM holds a lock per name).
* Resolvable names stand for vLLM's LoRA resolver plugins: with runtime updating allowed, the
  first request naming one loads it (``OpenAIServingModels.resolve_lora``).
* Loading more adapters than ``max_loras`` is no error (vLLM's CPU-side LRU cache evicts); the
  bound applies to the distinct adapters of one batch, in the engine's scheduler.
* ``vllm:lora_requests_info`` (``vllm/v1/metrics/loggers.py``): a gauge whose labels are
  ``max_lora`` and the comma-joined names of the adapters with running and with waiting
  requests, set to the current time. prometheus_client keeps every label set it has seen, so the
  exposition holds old series too and the current one is the series with the largest value.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from simulator.api_errors import ApiError
from simulator.runner import EngineRunner

MAX_INFO_SERIES = 64
"""Label sets of ``vllm:lora_requests_info`` kept (the oldest go first past this many)."""


@dataclass
class LoraSettings:
    """The LoRA flags of one worker (vLLM: ``--enable-lora``, ``--lora-modules``, ...)."""

    modules: dict[str, str] = field(default_factory=dict)
    """Static adapters: name -> path."""
    enabled: bool = False
    max_loras: int = 1
    runtime_updating: bool = False
    load_s: float = 0.0
    """Time one load takes (reading the adapter, moving it to the GPU)."""
    resolvable: frozenset[str] = frozenset()


class LoraAdapters:
    """The adapters one worker serves: name -> path, and the engine's int id per name."""

    def __init__(self, s: LoraSettings, ids: dict[str, int]) -> None:
        self.s = s
        self.ids = ids
        """Shared with the engines (``EngineConfig.lora_ids``): the id their events carry."""
        self.paths: dict[str, str] = {}
        self._next_id = 0
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.load_calls: dict[str, int] = {}
        """``POST /v1/load_lora_adapter`` calls received, per adapter name."""
        self.resolved: dict[str, int] = {}
        self.fail_loads = False
        """Fault: the engine fails every load."""
        self._series: dict[tuple[str, str, str], float] = {}
        for name, path in s.modules.items():
            self._add(name, path)

    @property
    def enabled(self) -> bool:
        return self.s.enabled or bool(self.paths) or self.s.runtime_updating

    def _add(self, name: str, path: str) -> None:
        if name not in self.ids:
            self._next_id += 1
            self.ids[name] = self._next_id
        self.paths[name] = path

    def serves(self, name: Any) -> bool:
        return isinstance(name, str) and name in self.paths

    async def load(self, data: dict[str, Any]) -> str:
        name, path = data.get("lora_name"), data.get("lora_path")
        async with self._locks[str(name)]:
            if isinstance(name, str):
                self.load_calls[name] = self.load_calls.get(name, 0) + 1
            if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
                raise ApiError(
                    400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"
                )
            if name in self.paths and not data.get("load_inplace"):
                raise ApiError(
                    400,
                    f"The lora adapter '{name}' has already been loaded. If you want to load "
                    "the adapter in place, set 'load_inplace' to True.",
                    "InvalidUserInput",
                )
            await self._engine_load(name)
            self._add(name, path)
            return f"Success: LoRA adapter '{name}' added successfully."

    async def _engine_load(self, name: str) -> None:
        if self.s.load_s > 0:
            await asyncio.sleep(self.s.load_s)
        if self.fail_loads:
            raise ApiError(400, f"Loading lora {name} failed: simulated engine failure")

    async def unload(self, data: dict[str, Any]) -> str:
        name = data.get("lora_name")
        if not isinstance(name, str) or not name:
            raise ApiError(
                400,
                "'lora_name' needs to be provided to unload a LoRA adapter.",
                "InvalidUserInput",
            )
        async with self._locks[name]:
            if name not in self.paths:
                raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            del self.paths[name]
            return f"Success: LoRA adapter '{name}' removed successfully."

    async def resolve(self, model: Any) -> None:
        """A request names ``model``: a resolver plugin loads it first if it can."""
        if not self.s.runtime_updating or not isinstance(model, str):
            return
        if model in self.paths or model not in self.s.resolvable:
            return
        async with self._locks[model]:
            if model in self.paths:
                return
            await self._engine_load(model)
            self._add(model, f"/sim/lora/{model}")
            self.resolved[model] = self.resolved.get(model, 0) + 1

    # ---- /metrics -------------------------------------------------------------------------------
    def info_lines(self, runners: list[EngineRunner]) -> list[str]:
        """The ``vllm:lora_requests_info`` family, with the current label set stamped now."""
        if not self.enabled:
            return []
        running: dict[str, None] = {}
        waiting: dict[str, None] = {}
        for r in runners:
            running.update((q.lora_name, None) for q in r.engine.running if q.lora_name)
            waiting.update((q.lora_name, None) for q in r.engine.waiting if q.lora_name)
        key = (str(self.s.max_loras), ",".join(running), ",".join(waiting))
        self._series.pop(key, None)
        self._series[key] = time.time()
        while len(self._series) > MAX_INFO_SERIES:
            del self._series[next(iter(self._series))]
        lines = [
            "# HELP vllm:lora_requests_info Running stats on lora requests.",
            "# TYPE vllm:lora_requests_info gauge",
        ]
        for (mx, run, wait), ts in self._series.items():
            lines.append(
                f'vllm:lora_requests_info{{max_lora="{mx}",running_lora_adapters="{run}",'
                f'waiting_lora_adapters="{wait}"}} {ts!r}'
            )
        return lines

    def state(self) -> dict[str, Any]:
        return {
            "loaded": dict(self.paths),
            "load_calls": dict(self.load_calls),
            "resolved": dict(self.resolved),
            "max_loras": self.s.max_loras,
        }
