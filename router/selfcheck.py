"""Start-up (and on-join) self-check of every worker.

Per worker, once it is healthy and its event discovery has had a chance to run:

1. **tokenizer**: a fixed prompt and a fixed chat are tokenized by the worker's ``/tokenize``.
   With a local tokenizer configured they are compared with it (``ok`` / ``mismatch``); without
   one the router tokenizes remotely, on any worker, so each worker is compared with the rest of
   the fleet: ``remote`` when it agrees with the majority (or is alone), ``mismatch`` when it does
   not (e.g. a different chat template).
   **chat_format** (with ``model.chat_format: auto``): the fixed chat sent as a one-token chat
   completion; its ``prompt_tokens`` against the worker's ``/tokenize`` (``template``) and
   against harmony (``harmony``: vLLM renders a GPT-OSS model's chats so, and the router
   renders that model's chats in harmony from then on), else ``mismatch`` with what to set
   (``unchecked`` when the probe fails, e.g. a model without a chat template).
2. **events**: one probe completion (``max_tokens=1``) whose prompt is a unique random sequence of
   a few blocks (token ids taken from the worker's own tokenization of random text, so they are
   valid for its vocabulary) is sent straight to the worker; the index must then show the probe's
   blocks on that worker within ``verify.selfcheck_timeout_s``: ``ok``; ``missing`` when nothing
   arrives (events disabled or unreachable: the worker has no event source, or the subscriber got
   no event from it at all); ``unmatched`` when events arrive but do not describe the probe (tokens
   or block size differ); ``error`` when the probe request itself failed.
3. **hits**: the same probe again: the worker's ``cached_tokens`` must equal what the index
   predicts (``ok`` / ``mismatch`` / ``unreported`` when the worker does not report cached tokens,
   i.e. vLLM without ``--enable-prompt-tokens-details``).
   **groups**: what the events leave out of the KV-cache groups they declare: ``chunk_unknown``
   for a chunked-local-attention group with no ``model.attention_chunk_tokens`` (matched as full
   attention, so long prompts' hits are under-counted), else ``ok`` (``unknown``: no group seen).
   **tools_with_choice_none** (with ``model.exclude_tools_when_tool_choice_none`` unset): the
   fixed chat with one tool and ``tool_choice: "none"`` as a one-token chat completion; its
   ``prompt_tokens`` against the chat rendered with and without the tool (the worker's
   ``/tokenize``, or harmony for a GPT-OSS model): ``kept``, or ``dropped`` (vLLM's
   ``--exclude-tools-when-tool-choice-none``: the router renders such chats without their
   tools for this worker's models from then on); ``unchecked`` when the template renders no
   tools, the probe fails, or the count is neither.
4. **priority** (with ``policy.prefill_priority`` only): a one-token completion carrying
   ``priority: 1``. vLLM's V0 engine without ``--scheduling-policy priority`` answers it 400
   (``refused``): that worker gets no priority from the router (``Worker.priority_refused``), so
   the router's own field never fails a request. ``ok`` when it is served: V1 takes a priority
   with or without priority scheduling (and ignores it without), which no answer tells apart;
   ``error`` when the probe fails otherwise.

Results are in ``/debug/index`` (per worker ``selfcheck``) and drive ``/ready``: with
``verify.require_selfcheck`` the router is ready only when a healthy worker passed (events ok);
a fleet with events disabled says so at once, in the log and in the ``/ready`` reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import msgspec

from indexer.index import EngineId, PrefixIndex
from indexer.subscriber import SourceStatus
from router.harmony import HarmonyChats, HarmonyError
from router.messages import cached_tokens_of, prompt_tokens_of
from router.model_set import ModelSet
from router.probe_inputs import CHAT, PROMPT, TOOL, tools_verdict
from router.tokenize import LocalTokenizer, decode_tokenize_response
from router.workers import Worker, WorkerRegistry

__all__ = ["SelfCheck"]

log = logging.getLogger("kvrouter.selfcheck")

_dec = msgspec.json.Decoder()


class SelfCheck:
    """Checks every worker of ``registry`` once (new ones as they join).

    ``local_tokenizer()`` is the router's verified local tokenizer (None: tokenization is
    remote), ``sources(url)`` the subscriber's rows of a worker's event sources, ``root(model)``
    the index root of a model's namespace; ``block_size`` is the configured KV block size."""

    def __init__(
        self,
        registry: WorkerRegistry,
        index: PrefixIndex,
        *,
        local_tokenizer: Callable[[], LocalTokenizer | None],
        harmony: HarmonyChats | None = None,
        chat_format_probe: bool = False,
        tools_dropped: ModelSet | None = None,
        sources: Callable[[str], list[SourceStatus]],
        root: Callable[[str | None], int],
        block_size: int = 16,
        timeout_s: float = 5.0,
        poll_s: float = 0.5,
        prefill_priority: bool = False,
    ) -> None:
        self.registry = registry
        self.index = index
        self.local_tokenizer = local_tokenizer
        self.harmony = harmony
        self.chat_format_probe = chat_format_probe
        self.tools_dropped = tools_dropped
        """Where to learn the models whose workers drop a ``tool_choice: "none"`` chat's
        tools (None: configured, no probe)."""
        self._tool_choice_seen: dict[str, set[str]] = {}
        self.sources = sources
        self.root = root
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.prefill_priority = prefill_priority
        self.results: dict[str, dict[str, Any]] = {}
        self.fingerprints: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._running: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._fleet_warned = False

    # ---------------------------------------------------------------- lifecycle

    async def start(self, wait_s: float | None = None) -> None:
        """Check the workers known now, waiting up to ``wait_s`` for those that are healthy (so a
        router that starts serving has checked its static fleet), then watch for joins."""
        self._launch()
        healthy = [self._running[w.url] for w in self.registry.healthy() if w.url in self._running]
        if healthy and wait_s:
            await asyncio.wait(healthy, timeout=wait_s)
        self._task = asyncio.create_task(self._loop(), name="kvrouter-selfcheck")

    def _launch(self) -> None:
        workers = self.registry.workers
        for url, w in list(workers.items()):
            if url not in self.results and url not in self._running:
                self.results[url] = {"events": "pending", "tokenizer": "pending"}
                self._running[url] = asyncio.create_task(self._check_one(w))

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._running.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        self._running.clear()

    async def _loop(self) -> None:
        """Check every worker once (new ones as they join); forget workers that left."""
        while True:
            self._launch()
            workers = self.registry.workers
            for url in [u for u in self.results if u not in workers]:
                self.results.pop(url, None)
                self.fingerprints.pop(url, None)
                t = self._running.pop(url, None)
                if t is not None:
                    t.cancel()
            await asyncio.sleep(self.poll_s)

    # ---------------------------------------------------------------- one worker

    async def _check_one(self, w: Worker) -> None:
        t0 = time.monotonic()
        res: dict[str, Any] = {"events": "pending", "tokenizer": "pending"}
        try:
            res = await self._check(w)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a self-check must never take the router down
            log.exception("self-check of %s failed", w.url)
            res = {"events": "error", "events_detail": f"{type(exc).__name__}: {exc}"}
        finally:
            res.setdefault("tokenizer", "pending")
            res["checked_at"] = time.time()
            res["duration_s"] = round(time.monotonic() - t0, 3)
            if w.url in self.registry.workers:
                self.results[w.url] = res
            self._running.pop(w.url, None)
        self._report(w.url, res)

    async def _wait(self, pred: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if pred():
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)

    async def _check(self, w: Worker) -> dict[str, Any]:
        if not await self._wait(lambda: w.healthy and bool(w.models), self.timeout_s * 2):
            return {
                "events": "error",
                "events_detail": f"worker not healthy or /v1/models unanswered "
                f"({w.last_health_error or 'no answer'})",
                "tokenizer": "unchecked",
            }
        model = w.base_model or self.registry.models.base
        res = await self._check_tokenizer(w, model)
        if self.prefill_priority:
            res.update(await self._check_priority(w, model))
        # Events: wait for discovery to subscribe (a worker without events never does).
        no_sources = None
        if w.events_endpoint is None and not w.subscribed:
            no_sources = await self._no_event_sources(w)
        subscribed = no_sources is None and await self._wait(lambda: w.subscribed, self.timeout_s)
        if not subscribed:
            res["events"] = "missing"
            res["events_detail"] = no_sources or await self._why_no_events(w)
            res["hits"] = "unchecked"
            return res
        await self._wait(lambda: self._connected(w), self.timeout_s)
        ids = await self._probe_ids(w, model)
        root = self.root(model)
        engines = w.engines()
        events_before = self._events(w)
        # Pinned to a rank: the second probe must reach the engine that cached the first, and
        # which rank vLLM's own balancer picked is not known until its events are applied.
        first = await self._probe(w, ids, model, rank=0 if w.dp_size > 1 else None)
        if first is None:
            res["events"] = "error"
            res["events_detail"] = "the probe completion failed"
            res["hits"] = "unchecked"
            return res
        res.update(await self._check_events(w, ids, root, engines, events_before))
        res.update(await self._check_hits(w, ids, root, model, rank=first[0]))
        res.update(self._check_groups(engines))
        return res

    def _check_groups(self, engines: list[EngineId]) -> dict[str, Any]:
        """What the index cannot learn from the events of the groups they declared."""
        if any(map(self.index.attention_chunk_unknown, engines)):
            return {
                "groups": "chunk_unknown",
                "groups_detail": "chunked local attention, chunk not in vLLM's events: matched "
                "as full attention (no hit past a chunk whose earlier blocks vLLM evicted); set "
                "model.attention_chunk_tokens to the model's attention_chunk_size",
            }
        known = any(self.index.group_specs(e) for e in engines)
        return {"groups": "ok" if known else "unknown"}

    async def _check_tokenizer(self, w: Worker, model: str | None) -> dict[str, Any]:
        """The worker's /tokenize on a fixed prompt and chat, against the local tokenizer if
        there is one (else recorded as a fingerprint to compare with the rest of the fleet)."""
        res: dict[str, Any] = {}
        prompt_ids = await self._tokenize(w, {"prompt": PROMPT, "add_special_tokens": True}, model)
        chat_ids = await self._tokenize(w, {"messages": CHAT}, model)
        self.fingerprints[w.url] = (tuple(prompt_ids), tuple(chat_ids))
        if self.chat_format_probe:
            res.update(await self._check_chat_format(w, model, len(chat_ids)))
        res.update(await self._check_tool_choice_none(w, model, len(chat_ids)))
        local = self.local_tokenizer()
        if local is None:
            res["tokenizer"] = "remote"
            return res
        problems = []
        with contextlib.suppress(Exception):
            if local.encode_prompt(PROMPT, True) != prompt_ids:
                problems.append("prompt")
        try:
            if local.encode_chat({"messages": CHAT}) != chat_ids:
                problems.append("chat")
        except Exception as exc:
            problems.append(f"chat ({exc})")
        res["tokenizer"] = "mismatch" if problems else "ok"
        if problems:
            res["tokenizer_detail"] = f"local tokenizer differs on: {', '.join(problems)}"
        return res

    async def _ask(
        self, w: Worker, path: str, body: dict[str, Any], model: str | None
    ) -> httpx.Response:
        """One probe request to DP rank 0 of ``w`` (for ``model`` when named)."""
        if model is not None:
            body["model"] = model
        headers = {"x-data-parallel-rank": "0"} if w.dp_size > 1 else {}
        return await w.client.post(path, json=body, headers=headers, timeout=self.timeout_s * 4)

    async def _check_chat_format(
        self, w: Worker, model: str | None, template_tokens: int
    ) -> dict[str, Any]:
        """How the worker renders a chat: the fixed chat sent as a one-token chat completion,
        its ``prompt_tokens`` against its own ``/tokenize`` (the template) and against harmony
        (vLLM renders a GPT-OSS model's chats so). ``harmony``: the router renders this model's
        chats in harmony from now on."""
        body: dict[str, Any] = {"messages": CHAT, "max_tokens": 1, "temperature": 0.0}
        try:
            resp = await self._ask(w, "/v1/chat/completions", body, model)
        except Exception as exc:
            return {"chat_format": "unchecked", "chat_format_detail": f"the probe failed: {exc}"}
        if resp.status_code != 200:
            why = f"the probe chat returned {resp.status_code}: {resp.text[:200]}"
            return {"chat_format": "unchecked", "chat_format_detail": why}
        w.saw_first_token(0)  # the router's own: it releases no buffered request there
        n = None
        with contextlib.suppress(msgspec.DecodeError):
            n = prompt_tokens_of(_dec.decode(resp.content))
        if n is None:
            return {"chat_format": "unchecked", "chat_format_detail": "no usage in the answer"}
        if n == template_tokens:
            return {"chat_format": "template"}
        h = self.harmony
        harmony_tokens = None
        if h is not None:
            with contextlib.suppress(HarmonyError):
                harmony_tokens = len(h.renderer.render({"messages": CHAT}))
        if n == harmony_tokens and h is not None:
            names = [m.get("id") for m in w.models if not m.get("parent")]
            h.learn(names or [model], default=self.registry.models.base in (names or [model]))
            log.info("%s renders chats in harmony (GPT-OSS): the router does the same", w.url)
            return {"chat_format": "harmony"}
        fix = (
            "model.chat_format: harmony, pip install 'kvrouter[harmony]'"
            if h is None
            else "check the worker's chat template"
        )
        return {
            "chat_format": "mismatch",
            "chat_format_detail": (
                f"the worker's chat completion counted {n} prompt tokens for a chat its "
                f"/tokenize renders in {template_tokens}: its chats are rendered otherwise "
                f"(GPT-OSS renders them in harmony: {fix})"
            ),
        }

    async def _check_tool_choice_none(
        self, w: Worker, model: str | None, template_tokens: int
    ) -> dict[str, Any]:
        """Does the worker render a chat with ``tool_choice: "none"`` with its tools? vLLM
        drops them under ``--exclude-tools-when-tool-choice-none``; its ``/tokenize`` takes no
        ``tool_choice`` and keeps them, so the router learns the flag here (the models of a
        worker that drops them: ``self.tools_dropped``)."""
        learned = self.tools_dropped
        if learned is None:
            return {}
        h = self.harmony
        try:
            if h is not None and h.covers(model):
                without = len(h.renderer.render({"messages": CHAT}))
                with_tools = len(h.renderer.render({"messages": CHAT, "tools": [TOOL]}))
            else:
                without = template_tokens
                payload = {"messages": CHAT, "tools": [TOOL]}
                with_tools = len(await self._tokenize(w, payload, model))
        except Exception as exc:
            why = f"the chat with a tool was not rendered: {exc}"
            return {"tools_with_choice_none": "unchecked", "tools_with_choice_none_detail": why}
        if with_tools == without:  # nothing to learn: no probe chat
            why = "the chat template renders no tools"
            return {"tools_with_choice_none": "unchecked", "tools_with_choice_none_detail": why}
        body: dict[str, Any] = {
            "messages": CHAT,
            "tools": [TOOL],
            "tool_choice": "none",
            "max_tokens": 1,
            "temperature": 0.0,
        }
        try:
            resp = await self._ask(w, "/v1/chat/completions", body, model)
        except Exception as exc:
            why = f"the probe failed: {exc}"
            return {"tools_with_choice_none": "unchecked", "tools_with_choice_none_detail": why}
        n = None
        if resp.status_code == 200:
            w.saw_first_token(0)  # the router's own: it releases no buffered request there
            with contextlib.suppress(msgspec.DecodeError):
                n = prompt_tokens_of(_dec.decode(resp.content))
        verdict = tools_verdict(n, with_tools, without)
        if verdict is None:
            why = (
                f"the probe chat returned {resp.status_code} with {n} prompt tokens; "
                f"{with_tools} with its tool, {without} without"
            )
            return {"tools_with_choice_none": "unchecked", "tools_with_choice_none_detail": why}
        names = [m.get("id") for m in w.models if not m.get("parent")] or [model]
        for name in names:
            seen = self._tool_choice_seen.setdefault(str(name), set())
            seen.add(verdict)
            if len(seen) > 1:
                log.warning(
                    "workers of %s disagree on tools with tool_choice none (some run "
                    "--exclude-tools-when-tool-choice-none): such chats are rendered without "
                    "their tools for every worker of it; start them alike",
                    name,
                )
        if verdict == "dropped":
            learned.learn(names, default=self.registry.models.base in names)
            log.info(
                "%s renders a chat with tool_choice none without its tools "
                "(--exclude-tools-when-tool-choice-none): the router does the same",
                w.url,
            )
        return {"tools_with_choice_none": verdict}

    async def _check_priority(self, w: Worker, model: str | None) -> dict[str, Any]:
        """Does the worker take a request ``priority``? Sets ``w.priority_refused``."""
        body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 1, "priority": 1}
        try:
            resp = await self._ask(w, "/v1/completions", body, model)
        except Exception as exc:
            return {"priority": "error", "priority_detail": f"the probe failed: {exc}"}
        if resp.status_code == 200:
            w.saw_first_token(0)  # the router's own: it releases no buffered request there
            w.priority_refused = None
            return {"priority": "ok"}
        text = resp.text[:200]
        if resp.status_code == 400 and "priority" in text.lower():
            w.priority_refused = (
                f"it answers a request priority 400 ({text.strip()}): start vLLM with "
                "--scheduling-policy priority, or set policy.prefill_priority: false"
            )
            return {"priority": "refused", "priority_detail": w.priority_refused}
        return {
            "priority": "error",
            "priority_detail": f"the probe returned {resp.status_code}: {text}",
        }

    async def _probe_ids(self, w: Worker, model: str | None) -> list[int]:
        """A unique prompt of a few blocks, in token ids valid for the worker's vocabulary."""
        bs = self.block_size
        n = max(6 * bs + bs // 2 + 1, 217)
        seed = await self._tokenize(
            w,
            {
                "prompt": "kvrouter self-check "
                + " ".join(secrets.token_hex(4) for _ in range(n // 2)),
                "add_special_tokens": False,
            },
            model,
        )
        if len(seed) < 8:
            seed = seed + list(range(200, 264))  # a tokenizer that merges everything: pad
        return (seed * (n // len(seed) + 1))[:n]

    async def _check_events(
        self, w: Worker, ids: list[int], root: int, engines: list[EngineId], events_before: int
    ) -> dict[str, Any]:
        """After the first probe: does the index show its blocks on the worker?"""
        n = len(ids)

        def found() -> int:
            m = self.index.match(ids, root, engines)
            return max((x.gpu_tokens for x in m.values()), default=0)

        if await self._wait(lambda: found() > 0, self.timeout_s):
            return {
                "events": "ok",
                "events_detail": f"probe of {n} tokens indexed ({found()} tokens matched)",
            }
        if self._events(w) > events_before:
            return {
                "events": "unmatched",
                "events_detail": (
                    f"events arrive ({self._events(w) - events_before} since the probe) but none "
                    f"describes the {n}-token probe: the worker's tokens or block size differ "
                    "from what its events say"
                ),
            }
        if w.prefix_caching is False:
            why = (
                "prefix caching is off on the worker (vllm:cache_config_info "
                'enable_prefix_caching="False"): it caches no prefix to route by; start it with '
                "--enable-prefix-caching (vLLM turns it off itself for some models, e.g. MLA "
                "on CPU)"
            )
        else:
            why = "events disabled on the worker, or its ZMQ port unreachable"
        return {
            "events": "missing",
            "events_detail": (
                f"no KV event arrived within {self.timeout_s:.1f}s of a {n}-token probe "
                f"(subscribed to {w.events_endpoint}; {why})"
            ),
        }

    async def _check_hits(
        self, w: Worker, ids: list[int], root: int, model: str | None, rank: int
    ) -> dict[str, Any]:
        """The same probe again: the worker's cached_tokens vs the index's prediction."""
        e = (w.url, rank)
        m = self.index.match(ids, root, [e]).get(e)
        predicted = (m.gpu_tokens + m.cpu_tokens) if m is not None else 0
        second = await self._probe(w, ids, model, rank)
        if second is None:
            return {"hits": "error"}
        if second[1] is None:
            return {
                "hits": "unreported",
                "hits_detail": (
                    "the worker reports no usage.prompt_tokens_details.cached_tokens "
                    "(vLLM: --enable-prompt-tokens-details); per-request verification is off "
                    "for it"
                ),
            }
        return {
            "hits": "ok" if second[1] == predicted else "mismatch",
            "hits_detail": f"predicted {predicted}, worker cached {second[1]}",
        }

    async def _tokenize(self, w: Worker, payload: dict[str, Any], model: str | None) -> list[int]:
        if model is not None:
            payload = {**payload, "model": model}
        resp = await w.client.post("/tokenize", json=payload, timeout=self.timeout_s)
        if resp.status_code != 200:
            raise RuntimeError(f"/tokenize returned {resp.status_code}: {resp.text[:200]}")
        return decode_tokenize_response(resp.content).tolist()

    async def _probe(
        self, w: Worker, ids: list[int], model: str | None, rank: int | None = None
    ) -> tuple[int, int | None] | None:
        body: dict[str, Any] = {"prompt": ids, "max_tokens": 1, "temperature": 0.0}
        if model is not None:
            body["model"] = model
        headers = {}
        if rank is not None and w.dp_size > 1:
            headers["x-data-parallel-rank"] = str(rank)
        try:
            resp = await w.client.post(
                "/v1/completions", json=body, headers=headers, timeout=self.timeout_s * 4
            )
        except Exception as exc:
            log.warning("self-check probe of %s failed: %s", w.url, exc)
            return None
        if resp.status_code != 200:
            log.warning("self-check probe of %s returned %d", w.url, resp.status_code)
            return None
        cached = None
        with contextlib.suppress(msgspec.DecodeError):
            cached = cached_tokens_of(_dec.decode(resp.content))
        if rank is None:
            rank = 0
        # Its first token is the router's own: it must not release a buffered request there.
        w.saw_first_token(rank)
        return rank, cached

    def _events(self, w: Worker) -> int:
        return sum(s.events for s in self.sources(w.url))

    def _connected(self, w: Worker) -> bool:
        rows = self.sources(w.url)
        return bool(rows) and all(s.connected for s in rows)

    async def _no_event_sources(self, w: Worker) -> str | None:
        """Why the worker cannot be subscribed, if it says so itself (else None)."""
        try:
            resp = await w.client.get("/kv_event_sources", timeout=self.timeout_s)
        except Exception:
            return None
        if resp.status_code == 404 or (
            resp.status_code == 200 and resp.content.strip() in (b"{}", b"null")
        ):
            return await self._why_no_events(w)
        return None

    async def _why_no_events(self, w: Worker) -> str:
        try:
            resp = await w.client.get("/kv_event_sources", timeout=self.timeout_s)
        except Exception as exc:
            return f"not subscribed; /kv_event_sources unreachable ({type(exc).__name__})"
        if resp.status_code == 404:
            return "the worker has no /kv_event_sources and no events= is configured for it"
        if resp.status_code == 200 and resp.content.strip() in (b"{}", b"null"):
            return (
                "the worker publishes no KV events "
                "(/kv_event_sources is empty: no --kv-events-config)"
            )
        return (
            f"not subscribed within {self.timeout_s:.1f}s (/kv_event_sources: {resp.status_code})"
        )

    # ---------------------------------------------------------------- reporting

    def _report(self, url: str, res: dict[str, Any]) -> None:
        if res.get("events") == "ok":
            log.info(
                "self-check of %s: events ok, tokenizer %s, hits %s (%s)",
                url,
                self.tokenizer_status(url),
                res.get("hits"),
                res.get("hits_detail", ""),
            )
        else:
            log.warning(
                "self-check of %s: KV events %s: %s",
                url,
                res.get("events"),
                res.get("events_detail"),
            )
        if res.get("hits") == "mismatch":
            log.warning(
                "self-check of %s: predicted hit differs from the worker's: %s",
                url,
                res.get("hits_detail"),
            )
        if res.get("groups") == "chunk_unknown":
            log.warning("self-check of %s: %s", url, res.get("groups_detail"))
        if res.get("priority") == "refused":
            log.error(
                "self-check of %s: no request priority is written for it: %s",
                url,
                res.get("priority_detail"),
            )
        tok = self.tokenizer_status(url)
        if tok == "mismatch":
            log.warning(
                "self-check of %s: tokenizer mismatch: %s",
                url,
                self.tokenizer_detail(url) or res.get("tokenizer_detail"),
            )
        done = [x for x in self.results.values() if x.get("events") not in ("pending", None)]
        if (
            not self._fleet_warned
            and done
            and len(done) == len(self.registry.workers)
            and all(x.get("events") != "ok" for x in done)
        ):
            self._fleet_warned = True
            log.error(
                "no worker passed the KV-event self-check (%s): the index stays empty and routing "
                "is by load only",
                "; ".join(f"{u}: {x.get('events')}" for u, x in self.results.items()),
            )

    def tokenizer_status(self, url: str) -> str:
        res = self.results.get(url) or {}
        tok = res.get("tokenizer", "pending")
        if tok != "remote":
            return tok
        fp = self.fingerprints.get(url)
        if fp is None or len(self.fingerprints) < 2:
            return "remote"
        counts = Counter(self.fingerprints.values())
        top, n = counts.most_common(1)[0]
        if fp == top or counts[fp] == n:
            return "remote"
        return "mismatch"

    def prompt_tokenizers_agree(self) -> bool:
        """Whether every self-checked worker tokenizes the probe prompt (not chat) the same way:
        only then may one worker's ``/tokenize`` ids be sent to another (router/tokenize.py)."""
        return len({fp[0] for fp in self.fingerprints.values()}) <= 1

    def tokenizer_detail(self, url: str) -> str | None:
        fp = self.fingerprints.get(url)
        if fp is None or self.tokenizer_status(url) != "mismatch":
            return None
        top = Counter(self.fingerprints.values()).most_common(1)[0][0]
        parts = [k for k, a, b in (("prompt", fp[0], top[0]), ("chat", fp[1], top[1])) if a != b]
        agree = sum(1 for v in self.fingerprints.values() if v == top)
        return (
            f"its /tokenize differs on the {' and '.join(parts)} probe from {agree} other "
            "worker(s) (chat template or tokenizer differ)"
        )

    def debug(self, url: str) -> dict[str, Any] | None:
        res = self.results.get(url)
        if res is None:
            return None
        out = dict(res)
        out["tokenizer"] = self.tokenizer_status(url)
        detail = self.tokenizer_detail(url)
        if detail:
            out["tokenizer_detail"] = detail
        return out

    def passed(self, url: str) -> bool:
        return (self.results.get(url) or {}).get("events") == "ok"

    def ready(self) -> tuple[bool, str]:
        healthy = self.registry.healthy()
        if not healthy:
            return False, "no healthy worker"
        for w in healthy:
            if self.passed(w.url):
                return True, f"{w.url} healthy and passed the self-check (KV events indexed)"
        pending = [
            w.url
            for w in healthy
            if (self.results.get(w.url) or {}).get("events") in (None, "pending")
        ]
        failed = [
            f"{w.url}: events {self.results[w.url].get('events')} "
            f"({self.results[w.url].get('events_detail')})"
            for w in healthy
            if w.url in self.results and w.url not in pending
        ]
        if failed and not pending:
            return False, "no worker passed the self-check: " + "; ".join(failed)
        return False, "self-check pending for " + ", ".join(pending) + (
            ("; failed: " + "; ".join(failed)) if failed else ""
        )
