"""LoRA placement: where a request for an adapter may go, what the adapter costs each worker, and
loading it where no worker has it.

A request whose ``model`` is an adapter goes to the workers that list it in ``/v1/models``
(router/workers.py). Where none does:

* with ``lora.dynamic_loading`` and the adapter in ``lora.adapters``, every worker of its base
  model is a candidate, each charged ``load_cost_tokens`` for the load; after the policy has
  chosen, the router loads it there (``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``,
  served by vLLM with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``) and forwards. One load per
  adapter is in flight at a time: concurrent requests for it wait for that load and follow it.
  A worker that fails the load is skipped for ``retry_failed_after_s`` and the next worker of
  the ranking is tried; when every one fails the client gets the workers' reasons;
* with ``lora.worker_resolver`` (vLLM's LoRA resolver plugins: the worker finds an unknown name
  itself on the first request naming it), the request is routed the same way and sent as is.

``vllm:lora_requests_info`` (a gauge in each worker's /metrics: labels ``max_lora`` and the
comma-joined names of the adapters with running and with waiting requests; the value is the time
it was set, and old label sets stay in the exposition, so the current one is the series with the
largest value) adds ``slot_wait_tokens`` to a worker whose ``max_lora`` batch slots are all taken
by other adapters: vLLM's scheduler holds the request until one of them drains.

Adapters are tokenized as their base model: vLLM applies the base model's tokenizer to them, and
asking a worker to tokenize for an adapter it has not loaded is a 404 (or, with a resolver
plugin, a load on whichever worker tokenizes).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from router.errors import BodyError
from router.messages import error_of

if TYPE_CHECKING:
    from indexer.index import EngineId
    from router.policy import Decision
    from router.workers import ModelNames, Worker, WorkerRegistry

__all__ = ["LoraAdapter", "LoraConfig", "LoraPlacement", "LoraSlots", "parse_lora_info"]

log = logging.getLogger("kvrouter.lora")


class LoraAdapter(msgspec.Struct, forbid_unknown_fields=True):
    """One entry of ``lora.adapters``."""

    path: str
    """``lora_path`` of the load call: a path or URI the worker can read."""
    base_model: str | None = None
    """Only workers serving this base model may load it (None: any worker)."""


class LoraConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The ``lora`` section of the configuration (docs/config.md)."""

    dynamic_loading: bool = False
    """Load an adapter no worker has (workers run with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)."""
    adapters: dict[str, str | dict[str, str | None]] = {}
    """Adapter name -> its path, or ``{path, base_model}`` (:class:`LoraAdapter`): what the
    router may load."""
    worker_resolver: bool = False
    """Workers resolve unknown adapter names themselves (vLLM LoRA resolver plugins)."""
    load_timeout_s: float = 120.0
    load_cost_tokens: float = 2048.0
    """Prefill-token equivalent of loading an adapter, charged where it is not loaded."""
    slot_wait_tokens: float = 4096.0
    """Charged where every ``max_lora`` slot is taken by other running adapters."""
    retry_failed_after_s: float = 30.0
    """A worker that failed to load an adapter is not asked again for it this long."""

    def entries(self) -> dict[str, LoraAdapter]:
        """``adapters`` as :class:`LoraAdapter` (ValueError naming the key of a bad entry)."""
        out = {}
        for name, a in self.adapters.items():
            try:
                out[name] = msgspec.convert({"path": a} if isinstance(a, str) else a, LoraAdapter)
            except msgspec.ValidationError as exc:
                raise ValueError(f"lora.adapters.{name}: {exc} (keys: path, base_model)") from None
            if not name or not out[name].path:
                raise ValueError(f"lora.adapters.{name}: needs a name and a path")
        return out

    def problems(self) -> list[str]:
        out = []
        try:
            self.entries()
        except ValueError as exc:
            out.append(str(exc))
        if self.load_timeout_s <= 0:
            out.append("lora.load_timeout_s: must be positive")
        if min(self.load_cost_tokens, self.slot_wait_tokens, self.retry_failed_after_s) < 0:
            out.append("lora.load_cost_tokens / slot_wait_tokens / retry_failed_after_s: >= 0")
        return out


@dataclass(frozen=True, slots=True)
class LoraSlots:
    """A worker's current ``vllm:lora_requests_info``."""

    max_lora: int
    running: frozenset[str]
    waiting: frozenset[str]


_INFO = "vllm:lora_requests_info{"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_lora_info(text: str) -> LoraSlots | None:
    """The current ``vllm:lora_requests_info`` of a /metrics text (None when absent): the series
    with the largest value, since that value is the time vLLM last set it."""
    best: LoraSlots | None = None
    best_ts = -math.inf
    pos = text.find(_INFO)
    while pos >= 0:
        end = text.find("\n", pos)
        line = text[pos : end if end >= 0 else len(text)]
        close = line.rfind("}")
        try:
            ts = float(line[close + 1 :].split()[0])
            labels = dict(_LABEL.findall(line[len(_INFO) : close]))
            slots = LoraSlots(
                int(labels.get("max_lora", "0")),
                _names(labels.get("running_lora_adapters", "")),
                _names(labels.get("waiting_lora_adapters", "")),
            )
        except (ValueError, IndexError):
            slots, ts = None, -math.inf
        if slots is not None and ts > best_ts:
            best, best_ts = slots, ts
        pos = text.find(_INFO, end) if end >= 0 else -1
    return best


def _names(joined: str) -> frozenset[str]:
    return frozenset(n.strip() for n in joined.split(",") if n.strip())


RESOLVE_PIN_S = 30.0
"""How long requests for an adapter a worker resolves follow the first one there: long enough
for the worker's /v1/models (re-read every 10 s) to list it once resolved."""


class LoadFailure(msgspec.Struct):
    url: str
    status: int | None
    """The worker's status (None: no answer)."""
    message: str
    etype: str | None = None
    """The worker's error type (vLLM's ``BadRequestError``, ``NotFoundError``), if it gave one."""


class LoraPlacement:
    """Placement state of one router: configured adapters, loads in flight, recent failures."""

    def __init__(self, cfg: LoraConfig) -> None:
        self.cfg = cfg
        self.adapters = cfg.entries()
        self._loading: dict[str, asyncio.Task[str]] = {}
        self._failed: dict[tuple[str, str], tuple[float, LoadFailure]] = {}
        self._resolving: dict[str, tuple[str, float]] = {}
        """Adapter -> the worker resolving it and until when later requests follow it there:
        not listed as served until the worker's /v1/models says so (the name may be a typo)."""

    # ---------------------------------------------------------------- which workers, what cost

    def _loadable(self, model: Any) -> bool:
        return self.cfg.dynamic_loading and isinstance(model, str) and model in self.adapters

    def _resolvable(self, model: Any, registry: WorkerRegistry) -> bool:
        return (
            self.cfg.worker_resolver
            and isinstance(model, str)
            and model not in registry.models.aliases
        )

    def placeable(
        self, model: Any, workers: list[Worker], registry: WorkerRegistry
    ) -> list[Worker]:
        """The workers a request for ``model`` may go to when none of ``workers`` serves it:
        those that can load it (its base model's), or none."""
        if self._loadable(model):
            base = self.adapters[model].base_model
        elif self._resolvable(model, registry):
            url, until = self._resolving.get(model, ("", 0.0))
            pinned = [w for w in workers if w.url == url]
            if pinned and until > time.monotonic():
                return pinned
            base = None
        else:
            return []
        return [w for w in workers if base is None or not w.models or base in w.served]

    def namespace(self, model: Any, registry: WorkerRegistry) -> str | None:
        """``model``'s prefix namespace (its own) when it is an adapter the router may place,
        whether or not a worker lists it yet; None for anything else."""
        if self._loadable(model) or self._resolvable(model, registry):
            return str(model)
        return None

    def is_adapter(self, model: Any, registry: WorkerRegistry) -> bool:
        return isinstance(model, str) and (
            model in registry.models.loras or self.namespace(model, registry) is not None
        )

    def adapter_tokens(
        self, model: Any, workers: list[Worker], registry: WorkerRegistry
    ) -> dict[EngineId, float]:
        """Per engine, what the request's adapter costs there beyond the prompt: loading it
        (not listed there), waiting for a batch slot (every slot taken by other adapters)."""
        if not self.is_adapter(model, registry):
            return {}
        out: dict[EngineId, float] = {}
        for w in workers:
            cost = 0.0 if model in w.served else self.cfg.load_cost_tokens
            if _slots_full(w, model):
                cost += self.cfg.slot_wait_tokens
            if cost:
                out.update((e, cost) for e in w.engines())
        return out

    def tokenize_body(
        self, body: dict[str, Any], workers: list[Worker], registry: WorkerRegistry
    ) -> dict[str, Any]:
        """``body`` with an adapter replaced by its base model (what vLLM tokenizes it with)."""
        model = body.get("model")
        if not self.is_adapter(model, registry):
            return body
        base = next(
            (m.get("parent") for w in workers for m in w.models if m.get("id") == model), None
        )
        configured = self.adapters.get(model)
        base = base or (configured.base_model if configured else None)
        base = base or next((w.base_model for w in workers if w.base_model), None)
        return body if not base else {**body, "model": base}

    # ---------------------------------------------------------------- placing

    async def place(
        self, model: Any, decision: Decision, registry: WorkerRegistry, *, dry_run: bool
    ) -> None:
        """Make sure the decision's worker has ``model`` before the request is forwarded: load
        it there (or on the next worker of the ranking when that fails), or, for a resolver,
        note that the worker loads it itself. The decision is narrowed to that worker's
        engines, since no other has the adapter. BodyError when no worker could load it."""
        loadable = self._loadable(model)
        if not loadable and not self._resolvable(model, registry):
            return  # nothing for the router to place: the plain path
        w = registry.workers.get(decision.engine[0])
        if w is None or not w.models or model in w.served:
            return
        if loadable:
            if dry_run:
                decision.reason += f"; LoRA adapter `{model}` is loaded there first"
                return
            url = await self._single_flight(model, decision, registry)
        else:
            decision.reason += f"; the worker resolves LoRA adapter `{model}` itself"
            if dry_run:
                return
            url = w.url
            if len(self._resolving) > 1024:  # names clients made up must not pile up
                now = time.monotonic()
                self._resolving = {k: v for k, v in self._resolving.items() if v[1] > now}
            self._resolving[model] = (url, time.monotonic() + RESOLVE_PIN_S)
        mine = [e for e in decision.ranked if e[0] == url]
        if mine:
            decision.engine, decision.ranked = mine[0], mine

    async def _single_flight(self, model: str, decision: Decision, registry: WorkerRegistry) -> str:
        task = self._loading.get(model)
        if task is None:
            urls = list(dict.fromkeys(e[0] for e in decision.ranked))
            task = asyncio.get_running_loop().create_task(self._load(model, urls, registry))
            self._loading[model] = task
            task.add_done_callback(lambda t: self._settled(model, t))
        else:
            decision.reason += f"; follows the load of LoRA adapter `{model}` in progress"
        return await asyncio.shield(task)

    def _settled(self, model: str, task: asyncio.Task[str]) -> None:
        if self._loading.get(model) is task:
            del self._loading[model]
        if not task.cancelled():
            task.exception()  # retrieved here too: every waiter may have gone

    async def _load(self, model: str, urls: list[str], registry: WorkerRegistry) -> str:
        """Load ``model`` on the first of ``urls`` that accepts it; its URL."""
        now = time.monotonic()
        self._failed = {k: v for k, v in self._failed.items() if v[0] > now}
        failures: list[LoadFailure] = []
        for url in urls:
            recent = self._failed.get((url, model))
            w = registry.workers.get(url)
            if recent is not None or w is None:
                failures += [recent[1]] if recent is not None else []
                continue
            failure = await self._load_on(w, model, registry.models)
            if failure is None:
                return url
            log.warning("loading LoRA adapter %s on %s failed: %s", model, url, failure.message)
            self._failed[(url, model)] = (time.monotonic() + self.cfg.retry_failed_after_s, failure)
            failures.append(failure)
        raise _load_error(model, failures)

    async def _load_on(self, w: Worker, model: str, names: ModelNames) -> LoadFailure | None:
        """One load call; None when ``w`` has the adapter afterwards (then ``names`` knows it
        for an adapter: its own prefix namespace)."""
        a = self.adapters[model]
        t0 = time.perf_counter()
        try:
            r = await w.client.post(
                "/v1/load_lora_adapter",
                json={"lora_name": model, "lora_path": a.path},
                timeout=self.cfg.load_timeout_s,
            )
        except Exception as exc:
            return LoadFailure(w.url, None, f"no answer ({type(exc).__name__}: {exc})")
        message, etype = error_of(r.content)
        if r.status_code == 200 or "has already been loaded" in message:
            log.info(
                "loaded LoRA adapter %s on %s in %.2fs", model, w.url, time.perf_counter() - t0
            )
            names.learn(_assume_loaded(w, model, a.path))
            return None
        if r.status_code == 404 and etype is None:
            message = (
                "it does not serve /v1/load_lora_adapter "
                "(vLLM serves it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)"
            )
        return LoadFailure(w.url, r.status_code, message, etype)


def _slots_full(w: Worker, model: str) -> bool:
    """Every ``max_lora`` slot of ``w`` taken by other adapters, per its last /metrics. A worker
    with nothing running or waiting has free slots whatever its gauge's labels still say
    (vLLM sets the gauge when its engine steps, so an idle engine's labels are stale)."""
    s = w.lora_slots
    if s is None or s.max_lora <= 0 or model in s.running:
        return False
    if not any(ld.running or ld.waiting for ld in w.loads.values()):
        return False
    return len(s.running) >= s.max_lora


def _assume_loaded(w: Worker, model: str, path: str | None) -> list[dict[str, Any]]:
    """Count ``model`` as served by ``w`` until its next /v1/models says otherwise; the card."""
    card = {"id": model, "object": "model", "root": path, "parent": w.base_model or "base"}
    if all(m.get("id") != model for m in w.models):
        w.models = [*w.models, card]
    return [card]


def _load_error(model: str, failures: list[LoadFailure]) -> BodyError:
    """The client's answer when no worker loaded ``model``: the workers' 4xx when all agree it
    is the adapter's fault (a bad path, a rank above --max-lora-rank), else a 502."""
    if not failures:
        return BodyError(503, f"LoRA adapter `{model}`: no worker to load it on")
    reasons = "; ".join(f"{f.url}: {f.message}" for f in failures)
    message = f"LoRA adapter `{model}` could not be loaded: {reasons}"
    statuses = {f.status for f in failures}
    if len(statuses) == 1 and failures[0].status in (400, 404) and failures[0].etype:
        return BodyError(failures[0].status, message, failures[0].etype)
    return BodyError(502, message, "BadGatewayError")
