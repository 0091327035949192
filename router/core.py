"""The routing core: everything one router process holds, and the decision for one request.

:class:`Router` builds the index, the event subscriber, the worker registry, the tokenizer, the
policy, the shared state, the verifier and the self-check, and runs them (``start``/``stop``).
:meth:`Router.route` decides one request: tokenize -> match the prompt against the index ->
trust gating (degraded and unverified engines get no index credit) -> candidates
(:func:`router.candidates.build_candidates`) -> ``policy.choose``. The HTTP layer
(``router.app``) calls it and forwards; ``router.debug`` renders its state.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence, Set
from typing import Any

import msgspec
from starlette.types import Receive

from indexer.index import EngineId, PrefixIndex, PrefixMatch
from indexer.subscriber import SourceStatus, Subscriber
from router import anthropic, harmony, harmony_responses, passthrough, proxy
from router.admission import Admission, make_admission
from router.anthropic import TemplateTraits
from router.cache_read import reads_prefix_cache, sequences
from router.candidates import build_candidates, record_sent, speculative_hits
from router.config import Config, WorkerSpec, upstream_api_key
from router.discovery import Discovery
from router.errors import BodyError
from router.harmony import HarmonyChats
from router.load import EngineLoad
from router.lora import LoraPlacement
from router.messages import error_of
from router.metrics import RouterMetrics, fleet_state
from router.model_set import ModelSet
from router.policy import Candidate, Decision, make_policy
from router.popularity import PromptKeys
from router.prefill_priority import engine_priority, prefill_class, with_prefill_priority
from router.quotas import Limits, QuotaTable
from router.recorder import Recorder
from router.resilience import WorkerWatch, load_only
from router.selfcheck import SelfCheck
from router.sessions import Binding, Sessions, SessionTable
from router.shared_quotas import shared_quotas
from router.shared_sessions import shared_sessions
from router.shared_state import ExportedEngine, SharedState, make_shared_state, seed_subscriber
from router.speculative import extension_credit
from router.stored_responses import owner_key
from router.template_probe import TemplateProbe
from router.tokenize import (
    REFUSAL_CHARS,
    LocalTokenizer,
    PromptTokenizer,
    TokenIds,
    Tokenized,
    TokenizeError,
    TokenizeRefused,
    decode_tokenize_response,
    model_attention_chunk,
    model_type,
)
from router.tracing import RequestTrace, make_tracer
from router.verify import Verifier, VerifyCollector, VerifyParams
from router.workers import NOT_REPORTED, Worker, WorkerRegistry, serving_engines

__all__ = ["RouteResult", "Router"]

log = logging.getLogger("kvrouter")

_enc = msgspec.json.Encoder()
_NONE: frozenset[EngineId] = frozenset()


class RouteResult(msgspec.Struct):
    decision: Decision
    tokens: Tokenized | None
    namespace: str
    matches: dict[EngineId, PrefixMatch]
    candidates: list[Candidate]
    tokenize_error: str | None = None
    churn: dict[EngineId, tuple[int, int]] = {}
    """Each engine's (stored, removed) index counters when the decision was made."""
    reads_cache: bool = True
    """False when vLLM serves this request without reading its prefix cache
    (router/cache_read.py): no hit is predicted and the outcome is not verified."""
    verifiable: bool = True
    """False when the worker's ``cached_tokens`` cannot be checked against the prediction: no
    cache read, not one lookup's figure (``n`` > 1 or a batch, router/cache_read.py), or a
    prompt vLLM may cut to a length the router does not know (router/truncation.py)."""
    sequences: int = 1
    """The engine requests vLLM runs for it: ``n`` per prompt of a batch (load accounting)."""


class Router:
    """Everything one router process holds; the app's endpoints call into it."""

    def __init__(self, cfg: Config, *, seed: int | None = None) -> None:
        self.cfg = cfg
        block = cfg.model.block_size
        unit = math.gcd(16, block) if block else 16
        self.block_size = block or 16
        self.index = PrefixIndex(
            unit=unit,
            cpu_chunk_tokens=cfg.model.cpu_chunk_tokens,
            max_entries=cfg.index.max_blocks,
            eagle=cfg.model.speculative,
            attention_chunk=_attention_chunk(cfg),
        )
        self.metrics = RouterMetrics(
            lambda: fleet_state(
                self.registry.workers.values(), self.index, self.subscriber_status()
            )
        )
        self.metrics.redis_up.set(0)
        self.registry = _registry(cfg, on_events_ready=self._subscribe)
        # Workers that join and leave at run time (Kubernetes pods); the static list is above.
        self.discovery: Discovery | None = None
        if cfg.discovery.kubernetes.enabled:
            self.discovery = Discovery(
                cfg.discovery.kubernetes, on_add=self._worker_joined, on_remove=self._worker_left
            )
        self.tokenizer = _tokenizer(cfg, unit)
        self.templates = TemplateProbe()
        self.policy = make_policy(cfg.policy.name, cfg.policy, seed=seed)
        # In-flight load of other replicas, speculative entries seen by all, index snapshots:
        # in Redis with redis.url, else embedded (this replica's own view).
        self.shared: SharedState = make_shared_state(
            cfg.redis.url,
            key_prefix=cfg.redis.key_prefix,
            heartbeat_ttl_s=cfg.redis.heartbeat_ttl_s,
            snapshot_interval_s=cfg.redis.snapshot_interval_s,
            op_timeout_s=cfg.redis.op_timeout_s,
            speculative_ttl_s=cfg.policy.speculative_ttl_s,
            local_loads=self._local_loads,
            snapshot_engines=self.index.engines,
            export_engine=self._export_engine,
            on_redis_up=lambda up: self.metrics.redis_up.set(1 if up else 0),
        )
        self.registry.on_load_change = self.shared.loads_changed
        self.speculative = self.shared.speculative
        self._epochs: dict[EngineId, int] = {}
        """Each engine's index epoch at the last decision (``_note_clears``); one per engine."""
        self._cleared_at: dict[EngineId, float] = {}
        """When a decision found an engine's index state dropped; one per engine."""
        self.speculative.retention = cfg.model.prefix_cache_retention_interval
        self.speculative.retention_of = self.retention
        e = cfg.events
        self.subscriber = Subscriber(
            self.index,
            queue_depth=e.queue_depth,
            queue_bytes=e.queue_bytes,
            replay_timeout_s=e.replay_timeout_s,
            replay_concurrency=e.replay_concurrency,
            bind=e.bind,
        )
        self.proxy_limits = proxy.ProxyLimits.from_server(cfg.server)
        self.watch = WorkerWatch(
            self.registry, self.subscriber.drop_worker_state, self.subscriber.redial_worker
        )
        # Predictions are checked against what workers report, and every worker is self-checked.
        self.verifier = self._verifier() if cfg.verify.enabled else None
        self.selfcheck = self._selfcheck() if cfg.verify.selfcheck else None
        self.recorder = Recorder()
        """The last decisions and the hit rate per minute (the status page, /debug)."""
        self.started = time.time()
        # Session bindings and per-key buckets: in Redis with redis.url, else this replica's.
        fallbacks = self.metrics.redis_fallbacks
        self.sessions: Sessions = shared_sessions(
            SessionTable(cfg.session.ttl_s, cfg.session.max_sessions),
            self.shared,
            fallbacks.labels("sessions").inc,
        )
        self.quotas: Limits = shared_quotas(
            QuotaTable(cfg.server.api_keys_file, cfg.server.rate_limit_period_s),
            self.shared,
            fallbacks.labels("limits").inc,
        )
        self.lora = LoraPlacement(cfg.lora)
        self.draining = False
        """Set on SIGTERM (router/serving.py): /ready answers 503 while requests finish."""
        self.admission: Admission | None = make_admission(self)
        """The admission queue (router/admission.py); None while ``admission`` is off."""
        self.tracer = make_tracer(cfg.tracing)
        """OpenTelemetry spans per request (router/tracing.py); None: tracing off."""

    def _verifier(self) -> Verifier:
        v = self.cfg.verify
        verifier = Verifier(
            self.index,
            VerifyParams(
                v.window, v.min_samples, v.min_accuracy, v.reset_after_misses, self.block_size
            ),
            sub_status=self.engine_status,
            error_histogram=self.metrics.prediction_error,
            tokenizer_mismatch=self._tokenizer_mismatch,
        )
        self.metrics.registry.register(
            VerifyCollector(verifier, lambda: list(self.registry.workers))
        )
        self.registry.on_metrics = verifier.on_metrics
        return verifier

    def _selfcheck(self) -> SelfCheck:
        return SelfCheck(
            self.registry,
            self.index,
            local_tokenizer=lambda: self.tokenizer.local,
            harmony=self.tokenizer.harmony,
            chat_format_probe=self.cfg.model.chat_format == "auto",
            tools_dropped=(
                self.tokenizer.tools_dropped
                if self.cfg.model.exclude_tools_when_tool_choice_none is None
                else None
            ),
            sources=lambda url: self.subscriber_status().get(url, []),
            root=lambda model: self.namespace_root({"model": model})[1],
            block_size=self.block_size,
            timeout_s=self.cfg.verify.selfcheck_timeout_s,
            prefill_priority=self.cfg.policy.prefill_priority,
        )

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        await self.shared.start()  # loads index snapshots before any worker is subscribed
        await self.subscriber.start()
        await self.registry.start()
        await self.watch.start()
        if self.discovery is not None:
            await self.discovery.start()
        if self.tokenizer.local is not None:
            await self._verify_local()
        if self.selfcheck is not None:
            await self.selfcheck.start(wait_s=self.cfg.verify.selfcheck_timeout_s + 1.0)

    async def stop(self) -> None:
        if self.selfcheck is not None:
            await self.selfcheck.stop()
        await self.watch.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        await self.registry.stop()
        await self.sessions.close()
        await self.quotas.close()
        await self.shared.stop()
        await self.subscriber.stop()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # exports what is queued

    async def _verify_local(self) -> None:
        try:
            problems = await self.tokenizer.verify_local(self._remote_tokenize, self.cfg.model.name)
        except TokenizeError as exc:
            problems = [f"no worker to check against: {exc}"]
        if problems:
            log.error("local tokenizer disagrees with the workers; using remote: %s", problems)
            self.tokenizer.local = None
        else:
            log.info("local tokenizer verified against a worker's /tokenize")

    def _subscribe(self, w: Worker) -> None:
        if w.subscribed:
            return
        model = self.registry.models.namespace_of(w)
        if self.cfg.events.bind is not None:
            self.subscriber.add_bound_worker(
                w.url, w.topic, dp_size=w.dp_size, model=model, replay_endpoint=w.replay_endpoint
            )
        elif w.events_endpoint:
            self.subscriber.add_worker(
                w.url,
                w.events_endpoint,
                w.replay_endpoint,
                dp_size=w.dp_size,
                model=model,
                host=w.host,
            )
        else:
            return
        self._warm_start(w)

    def _warm_start(self, w: Worker) -> None:
        """Right after subscribing (before any event is applied: no await since), import the
        Redis snapshot of each engine and start its event source at the snapshot's seq."""
        for e in w.engines():
            snap = self.shared.take_snapshot(e)
            if snap is None:
                continue
            try:
                self.index.import_engine(e, snap.data)
            except ValueError as exc:
                log.warning("index snapshot of %s unusable: %s", e, exc)
                continue
            if seed_subscriber(self.subscriber, e, snap.seq, snap.event_ts):
                self.shared.warm.add(snap, self.index.resident_blocks(e))
                log.info("warm start of %s from seq %d (%d blocks)", e, snap.seq, snap.blocks)
            else:
                self.index.clear_engine(e)  # cannot resume at its seq: stay cold, stay exact

    async def _worker_joined(self, spec: WorkerSpec) -> None:
        await self.registry.add_worker(spec)  # its discovery loop then subscribes to events

    def _worker_left(self, url: str) -> None:
        if self.verifier is not None:
            self.verifier.forget_worker(url)
        for seen in (self._epochs, self._cleared_at):
            for e in [e for e in seen if e[0] == url]:
                del seen[e]
        if self.registry.remove_worker(url) is not None:
            self.subscriber.remove_worker(url)  # closes its sockets, drops it from the index

    # ---------------------------------------------------------------- shared state hooks

    def _local_loads(self) -> dict[EngineId, EngineLoad]:
        return {
            (w.url, rank): ld
            for w in self.registry.workers.values()
            for rank, ld in w.loads.items()
        }

    def _export_engine(self, e: EngineId) -> ExportedEngine | None:
        """An engine's exact index state and the seq it reflects (None unless exact)."""
        row = self.engine_status(e)
        if row is None or row.last_seq is None or row.degraded or row.replaying:
            return None
        data = self.index.export_engine_chunks(e)  # the cut: same instant as last_seq
        return data, row.last_seq, self.index.resident_blocks(e), row.last_event_ts

    # ---------------------------------------------------------------- tokenize + route

    async def _remote_tokenize(
        self, payload: dict[str, Any] | bytes, among: list[Worker] | None = None
    ) -> TokenIds:
        body = payload if isinstance(payload, bytes) else _enc.encode(payload)
        last = "no healthy worker"
        for w in self.registry.tokenizer_workers(among)[:2]:
            try:
                r = await w.client.post(
                    "/tokenize",
                    content=body,
                    headers={"content-type": "application/json"},
                    # bounded like a first byte: a hung worker must not hold every request
                    timeout=min(
                        self.cfg.server.connect_timeout_s, self.cfg.server.first_byte_timeout_s
                    ),
                )
            except Exception as exc:
                last = f"{w.url}: {type(exc).__name__}"
                self.watch.probe_soon(w)
                continue
            if r.status_code == 200:
                return decode_tokenize_response(r.content)
            last = f"{w.url}/tokenize returned {r.status_code}"
            if 400 <= r.status_code < 500:  # another worker would say the same
                raise TokenizeRefused(f"{last}: {error_of(r.content)[0][:REFUSAL_CHARS]}")
        raise TokenizeError(last)

    async def read_prompt(
        self, path: str, body: dict[str, Any] | None
    ) -> tuple[dict[str, Any] | None, TemplateTraits]:
        """The prompt read from a body of the rest of vLLM's API (router/passthrough.py), and
        the template traits it was read with: asked of a worker when an Anthropic prompt
        depends on them; no prompt when no worker could be asked."""
        traits = passthrough.DEFAULT_TRAITS
        if body is None or path not in passthrough.BY_CACHE:
            return None, traits
        if path == "/v1/responses" and self.tokenizer.harmony_for(body) is not None:
            return harmony_responses.prompt(body), traits
        if path == "/v1/messages":
            known = await self.template_traits(body)
            if known is None:
                return None, traits
            traits = known
        return passthrough.chat_prompt(path, body, traits), traits

    async def template_traits(self, body: dict[str, Any]) -> TemplateTraits | None:
        """The chat template traits an Anthropic request's prompt depends on, as vLLM probes
        them (router/template_probe.py): the defaults when it depends on none, None when no
        worker could be asked."""
        model = body.get("model")
        if not anthropic.template_dependent(body) or not isinstance(model, str):
            return passthrough.DEFAULT_TRAITS
        try:
            workers = self._serving(model)
        except BodyError:
            return passthrough.DEFAULT_TRAITS  # routing refuses the model with its own answer

        async def tokenize(chat: dict[str, Any]) -> TokenIds:
            as_base = self.lora.tokenize_body(chat, workers, self.registry)
            payload = PromptTokenizer.tokenize_payload(as_base, chat=True)
            return await self._remote_tokenize(payload or {}, among=workers)

        traits = await self.templates.traits(model, tokenize)
        if traits is not None and self.tokenizer.harmony_for(body) is not None:
            # vLLM renders its effort probe as it renders the model's chats: in harmony, which
            # refuses "none", so thinking disabled is "low" whatever the template does with it.
            traits = dataclasses.replace(traits, disabled_thinking_effort="low")
        return traits

    def record_sent(self, engine: EngineId, res: RouteResult, now: float) -> None:
        """The speculative entry for a prompt just sent to ``engine``: siblings routed before
        its events arrive find its prefix there (router/speculative.py)."""
        tok = res.tokens
        if tok is not None:
            match = res.matches.get(engine)
            record_sent(self.speculative, self.index, engine, tok.keys, tok.n_tokens, match, now)

    async def route_admitted(
        self,
        body: dict[str, Any],
        chat: bool,
        receive: Receive,
        key: str | None,
        size: int,
        **how: Any,
    ) -> RouteResult:
        """:meth:`route` (``how``: its keyword arguments) once the admission queue
        (router/admission.py) lets the request through; at once while admission is off.
        ``receive`` shows the client leaving while it waits; ``key``: its API key (the queue's
        fairness); ``size``: the request body's bytes as received (the ``shortest_prompt``
        order's key). The pass is given back as the route is chosen: the caller puts the prompt
        on the chosen engine's load before the queue can look again."""
        if self.admission is None:
            return await self.route(body, chat, time.monotonic(), **how)
        admitted = await self.admission.admit(
            body.get("model"), body.get("priority"), key, receive, size
        )
        tokens = None
        try:
            res = await self.route(body, chat, time.monotonic(), **how)
            tokens = res.tokens.n_tokens if res.tokens is not None else None
            return res
        finally:
            admitted.release(tokens)

    def prioritized(
        self,
        body: dict[str, Any],
        engines: Sequence[EngineId],
        uncached: int,
        *,
        record: bool = True,
    ) -> dict[str, Any] | None:
        """``body`` with the ``priority`` of a prefill of ``uncached`` tokens on ``engines[0]``
        (router/prefill_priority.py) for a request that may go to ``engines``, or None to send
        it as it is: ``policy.prefill_priority`` is off, the client set a priority, or one of
        those workers refuses priorities (a retry must not meet a 400 the client never caused).
        ``record``: count it in ``kvrouter_prefill_priority_total`` (not for ``/debug/route``)."""
        p = self.cfg.policy
        if not p.prefill_priority or not engines:
            return None
        workers = self.registry.workers
        for e in engines:
            w = workers.get(e[0])
            if w is None or w.priority_refused is not None:
                return None
        first = engines[0]
        priority = engine_priority(
            uncached, first, workers[first[0]], self.policy, p, time.monotonic()
        )
        written = with_prefill_priority(body, priority)
        if written is not None and record:
            lifted = "true" if priority > prefill_class(uncached) else "false"
            self.metrics.prefill_priority.labels(str(priority), lifted).inc()
        return written

    async def response_holder(self, response_id: str, now: float) -> EngineId | None:
        """The engine holding a stored Responses API answer (router/stored_responses.py), if
        one was noted."""
        got = await self.sessions.lookup(owner_key(response_id), now)
        return got[0] if got is not None else None

    def note_response_holder(self, response_id: str, engine: EngineId, now: float) -> None:
        """``engine`` produced the stored answer ``response_id``: requests naming it go there."""
        self.sessions.bind(owner_key(response_id), engine, 0, 0, now)

    def retention(self, engine: EngineId) -> int | None:
        """The engine's ``--prefix-cache-retention-interval``: as its worker's /metrics reports
        it (``vllm:cache_config_info``), else ``model.prefix_cache_retention_interval``."""
        w = self.registry.workers.get(engine[0])
        if w is None or w.retention == NOT_REPORTED:
            return self.cfg.model.prefix_cache_retention_interval
        return w.retention

    def namespace_root(self, body: dict[str, Any]) -> tuple[str, int]:
        model = body.get("model")
        ns = self.lora.namespace(model, self.registry) or self.registry.models.namespace(
            model, self.registry.workers.values()
        )
        salt = body.get("cache_salt")
        return ns, self.index.root(ns, salt if isinstance(salt, str) else None)

    async def route(
        self,
        body: dict[str, Any],
        chat: bool,
        now: float,
        *,
        dry_run: bool = False,
        session: str | None = None,
        tokenize: bool = True,
        trace: RequestTrace | None = None,
        owner: EngineId | None = None,
    ) -> RouteResult:
        """Tokenize, match, gate and choose. ``dry_run`` (``/debug/route``): the same decision,
        leaving the policy's learned state (and the session's binding) untouched. ``session``:
        the request's session key (router/sessions.py). ``tokenize=False``: the body has no
        prompt to match (router/passthrough.py), so the choice is by load. ``trace``: the
        request's spans (router/tracing.py). ``owner``: the engine holding a stored response
        the request names (router/stored_responses.py), the only one it may go to while it
        serves the model (before a hard session binding: elsewhere the request fails)."""
        model = body.get("model")
        try:
            workers = self._serving(model)
        except BodyError:
            if trace is not None:
                trace.routing(None, None)  # no model to tokenize for: routing refuses it
            raise
        ns, root = self.namespace_root(body)
        tok: Tokenized | None = None
        err = "no prompt to match: routed by load"
        if tokenize:
            tok, err = await self._tokenize(body, chat, root, workers, trace)
        if trace is not None:
            trace.routing(tok, err)
        loads = [(e, w.load(e[1])) for w, e in serving_engines(workers)]
        bound = None if session is None else await self._session_binding(session, now)
        if owner is not None:  # the one engine holding what the request names
            loads = [x for x in loads if x[0] == owner] or loads
        elif bound is not None and self.cfg.session.mode == "hard":
            pinned = [x for x in loads if x[0] == bound[0]]
            loads = pinned or loads  # its engine is gone or unhealthy: route freely
        engines = [e for e, _ in loads]
        self._note_clears(engines, now)
        matches: dict[EngineId, PrefixMatch] = {}
        speculative: dict[EngineId, int] = {}
        reach: dict[EngineId, int] = {}
        reads_cache = reads_prefix_cache(body, chat)
        if tok is not None and engines and reads_cache:
            matches = self.index.match_keys(tok.keys, tok.n_tokens, engines)
            speculative, reach = speculative_hits(
                self.speculative, self.index, engines, tok.keys, tok.n_tokens, now
            )
        if (
            bound is not None
            and tok is not None
            and reads_cache
            and bound[3] > self._cleared_at.get(bound[0], -math.inf)
        ):
            e, tokens, last_key, _ = bound
            at = tokens // self.index.unit - 1
            if 0 <= at < len(tok.keys) and tok.keys[at] == last_key:  # extends the last turn
                specs = self.index.group_specs(e)
                credit = extension_credit(specs, tokens, tok.n_tokens, self.retention(e))
                speculative[e] = max(speculative.get(e, 0), credit)
        cands = build_candidates(
            loads,
            matches,
            block_size=self.block_size,
            speculative=speculative,
            remote=self.shared.remote_loads(),  # other replicas' in-flight work (Redis)
            load_only={e for e in engines if load_only(self.subscriber, e)},
            unverified=self._unverified(engines),
            adapter=self.lora.adapter_tokens(model, workers, self.registry),
            reach=reach,
        )
        if not cands:
            raise BodyError(503, "no workers configured")
        n = tok.n_tokens if tok is not None else 0
        prompt = None
        if tok is not None and reads_cache:  # shares are per model: its workers' namespace
            pool = self.registry.models.namespace_of(workers[0])
            prompt = PromptKeys(tok.keys, self.index.unit, pool)
        decision = self.policy.choose(cands, n, now, dry_run=dry_run, prompt=prompt)
        await self.lora.place(model, decision, self.registry, dry_run=dry_run)
        if trace is not None:
            trace.routed(decision, len(cands), model)
        if session is not None and tok is not None and len(tok.keys) and not dry_run:
            self.sessions.bind(session, decision.engine, tok.n_tokens, tok.keys[-1], now)
        churn = {c.engine: self.index.churn(c.engine) for c in cands}
        n = sequences(body)  # n > 1 or a batch: vLLM's cached_tokens is not one lookup's
        checkable = reads_cache and n == 1 and (tok is None or tok.verifiable)
        return RouteResult(decision, tok, ns, matches, cands, err, churn, reads_cache, checkable, n)

    async def _tokenize(
        self,
        body: dict[str, Any],
        chat: bool,
        root: int,
        workers: list[Worker],
        trace: RequestTrace | None,
    ) -> tuple[Tokenized | None, str | None]:
        """The prompt's tokens by a worker serving its model, or (None, why not)."""
        if trace is not None:
            trace.tokenizing()
        as_base = self.lora.tokenize_body(body, workers, self.registry)
        remote = functools.partial(self._remote_tokenize, among=workers)
        try:
            return await self.tokenizer.tokenize(as_base, chat, root, remote), None
        except TokenizeError as exc:
            return None, str(exc)

    def _note_clears(self, engines: list[EngineId], now: float) -> None:
        """Engines whose index state was dropped since the router last looked (vLLM's
        ``AllBlocksCleared``, a restart, a reset): what they were credited outside the index
        holds no longer. Their speculative entries go, and a session bound to one before now
        is not credited there (its next turn finds nothing cached)."""
        epochs = self._epochs
        for e in engines:
            epoch = self.index.epoch(e)
            if epochs.setdefault(e, epoch) != epoch:
                epochs[e] = epoch
                self.speculative.forget(e)
                self._cleared_at[e] = now

    async def _session_binding(self, session: str, now: float) -> Binding | None:
        if self.cfg.session.mode == "off":
            return None
        return await self.sessions.lookup(session, now)

    def _serving(self, model: Any) -> list[Worker]:
        """The workers a request for ``model`` may go to: routable ones that serve it (all of
        them while none is). BodyError 404 when the fleet does not serve it."""
        workers = self.registry.routable() or list(self.registry.workers.values())
        serving = [w for w in workers if w.serves(model)]
        if serving or not workers:
            return serving
        placeable = self.lora.placeable(model, workers, self.registry)  # an adapter to load
        if placeable:
            return placeable
        names = sorted({name for w in self.registry.workers.values() for name in w.served})
        raise BodyError(
            404,
            f"The model `{model}` does not exist; this fleet serves: {', '.join(names)}",
            "NotFoundError",
        )

    def _unverified(self, engines: list[EngineId]) -> Set[EngineId]:
        """Engines whose predictions drifted: routed by load only until re-verified."""
        if self.verifier is None:
            return _NONE
        return {e for e in engines if self.verifier.is_unverified(e)}

    # ---------------------------------------------------------------- state for views

    def subscriber_status(self) -> dict[str, list[SourceStatus]]:
        """Each worker's event sources (one per DP rank), by worker URL."""
        out: dict[str, list[SourceStatus]] = {}
        with contextlib.suppress(Exception):
            for s in self.subscriber.status():
                out.setdefault(s.worker_id, []).append(s)
        return out

    def engine_status(self, e: EngineId) -> SourceStatus | None:
        return next((s for s in self.subscriber_status().get(e[0], []) if s.dp_rank == e[1]), None)

    def ids_portable(self) -> bool:
        """False when the self-check found workers tokenizing a prompt differently: ids from one
        worker's ``/tokenize`` (any worker may answer it) could then be wrong for another."""
        return self.selfcheck is None or self.selfcheck.prompt_tokenizers_agree()

    def _tokenizer_mismatch(self, url: str) -> str | None:
        return self.selfcheck.tokenizer_detail(url) if self.selfcheck is not None else None

    def verify_outcome(self, res: RouteResult, o: proxy.Outcome) -> None:
        """The index's prediction for the engine that served the request vs the worker's usage."""
        tok = res.tokens
        if self.verifier is None or tok is None or o.engine is None or o.status != 200:
            return
        if o.cached_tokens is None or not res.verifiable:
            return
        m = res.matches.get(o.engine)
        spec = next((c.speculative_tokens for c in res.candidates if c.engine == o.engine), 0)
        stored0, removed0 = res.churn.get(o.engine, (0, 0))
        stored1, removed1 = self.index.churn(o.engine)
        self.verifier.observe(
            o.engine,
            predicted_gpu=m.gpu_tokens if m else 0,
            predicted_cpu=m.cpu_tokens if m else 0,
            n_tokens=tok.n_tokens,
            cached=o.cached_tokens,
            prompt_tokens=o.prompt_tokens,
            speculative=spec,
            stored_since=stored1 > stored0,
            removed_since=removed1 > removed0,
        )

    def ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining: the router is shutting down"
        if self.selfcheck is not None and self.cfg.verify.require_selfcheck:
            return self.selfcheck.ready()
        status = self.subscriber_status()
        for w in self.registry.healthy():
            if any(r.connected for r in status.get(w.url, [])):
                return True, f"{w.url} healthy with a live event subscription"
        if not self.registry.healthy():
            return False, "no healthy worker"
        return False, "no healthy worker has a live event subscription yet"


def _registry(cfg: Config, on_events_ready: Callable[[Worker], None]) -> WorkerRegistry:
    sc = cfg.server
    return WorkerRegistry(
        cfg.workers,
        model_name=cfg.model.name,
        connect_timeout_s=sc.connect_timeout_s,
        first_byte_timeout_s=sc.first_byte_timeout_s,
        max_connections=sc.max_connections_per_worker,
        pool_timeout_s=sc.pool_timeout_s,
        on_events_ready=on_events_ready,
        upstream_api_key=upstream_api_key(cfg),
        stall_after_s=sc.worker_stall_s,
        poll_interval_s=sc.worker_poll_s,
    )


def _attention_chunk(cfg: Config) -> int | None:
    """The chunk of the model's chunked local attention: configured, else the local model
    folder's, else unknown (router/config.py ``attention_chunk_tokens``)."""
    if cfg.model.attention_chunk_tokens is not None:
        return cfg.model.attention_chunk_tokens
    if cfg.tokenizer.mode == "local" and cfg.tokenizer.path:
        return model_attention_chunk(cfg.tokenizer.path)
    return None


def _harmony(cfg: Config) -> HarmonyChats | None:
    """Which models' chats the workers render in harmony (router/config.py ``chat_format``):
    every model's when configured or when the local model folder is GPT-OSS; with ``auto``
    otherwise, those the self-check finds rendering it. None: none (``template``, or the
    harmony library missing; the self-check then names a GPT-OSS worker)."""
    m = cfg.model
    if m.chat_format == "template":
        return None
    everywhere = m.chat_format == "harmony"
    if m.chat_format == "auto" and cfg.tokenizer.mode == "local" and cfg.tokenizer.path:
        everywhere = model_type(cfg.tokenizer.path) == "gpt_oss"
    if not harmony.available():
        if everywhere:
            log.warning(
                "the model folder is GPT-OSS, whose chats vLLM renders in harmony, but the "
                "harmony library is not installed: pip install 'kvrouter[harmony]'; until then "
                "its chats are tokenized with the chat template and may be routed by load"
            )
        return None
    return HarmonyChats(m.harmony_start_date, m.harmony_system_instructions, everywhere=everywhere)


def _tokenizer(cfg: Config, unit: int) -> PromptTokenizer:
    local = None
    if cfg.tokenizer.mode == "local" and cfg.tokenizer.path:
        local = LocalTokenizer(cfg.tokenizer.path)
    return PromptTokenizer(
        unit,
        cfg.tokenizer.cache_entries,
        cfg.tokenizer.cache_tokens,
        local=local,
        harmony=_harmony(cfg),
        tools_dropped=_tools_dropped(cfg),
    )


def _tools_dropped(cfg: Config) -> ModelSet | None:
    """The models whose workers render a chat with ``tool_choice: "none"`` without its tools
    (router/config.py ``exclude_tools_when_tool_choice_none``): every model, none (None), or
    those the self-check finds doing so."""
    flag = cfg.model.exclude_tools_when_tool_choice_none
    return None if flag is False else ModelSet(everywhere=flag is True)
