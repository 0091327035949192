"""One worker's checks for ``kvrouter doctor``: HTTP probes and a short-lived KV-event feed.

The checks follow what an operator would do by hand: is the worker up and what does it serve
(``/v1/models``); how does it tokenize a fixed prompt and chat (``/tokenize``, compared across the
fleet by ``router/doctor.py``); where does it publish events (``events=`` given with the URL, else
``GET /kv_event_sources``); then one probe completion per DP rank whose prompt is a unique random
token sequence, with a SUB socket on every rank's endpoint, so that its ``BlockStored`` must
arrive; the probe again, whose ``cached_tokens`` shows prefix caching and
``--enable-prompt-tokens-details``; and the replay endpoint asked for the probe's batch.
Every wait is bounded by ``Options``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import zmq
import zmq.asyncio

from indexer.endpoints import concrete_endpoint
from indexer.replay import ReplayError, fetch_replay
from indexer.types import CHUNKED, group_kind
from indexer.wire import BlockStored, DecodedBatch, DecodeError, decode_payload
from router import harmony
from router.config import WorkerSpec
from router.doctor_report import FAIL, FIX, OK, SKIP, WARN, WorkerReport
from router.messages import cached_tokens_of, prompt_tokens_of
from router.probe_inputs import CHAT, PROMPT, TOOL, tools_verdict
from router.tokenize import decode_tokenize_response

__all__ = ["Options", "WorkerProbe"]

_FULL_ATTENTION = (None, "full_attention")


@functools.cache
def _harmony_tokens(tools: bool = False) -> int | None:
    """The fixed chat's length in harmony (``tools``: with the fixed tool), or None without
    the harmony library."""
    if not harmony.available():
        return None
    chat: dict[str, Any] = {"messages": CHAT, "tools": [TOOL]} if tools else {"messages": CHAT}
    return len(harmony.HarmonyRenderer().render(chat))


class Options(msgspec.Struct, frozen=True):
    timeout_s: float = 3.0
    """Bound of each HTTP call, ZMQ connect and replay."""
    events_wait_s: float = 3.0
    """How long the probe's ``BlockStored`` may take to arrive."""
    deadline_s: float = 30.0
    """Bound of the whole run."""
    max_skew_s: float = 2.0
    probe_tokens: int = 600
    """Probe prompt length: several blocks at any block size in use (up to 256 tokens)."""


@dataclass
class _Seen:
    recv: float  # local wall clock at receipt
    seq: int
    topic: bytes
    batch: DecodedBatch


@dataclass
class _Feed:
    rank: int
    endpoint: str
    sock: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    seen: list[_Seen] = field(default_factory=list)
    undecodable: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


@dataclass
class _Probe:
    ids: list[int]
    cached: int | None = None  # cached_tokens of the first answer (None: not reported)
    answered: bool = False
    rank: int | None = None  # the rank whose events describe it
    seen: _Seen | None = None


def _is_slice(tokens: list[int], ids: list[int]) -> bool:
    if not tokens or len(tokens) > len(ids):
        return False
    n = len(tokens)
    return any(ids[i : i + n] == tokens for i, t in enumerate(ids) if t == tokens[0])


class WorkerProbe:
    """Checks one worker; results accumulate in ``report`` (kept when the deadline cuts in)."""

    def __init__(
        self, spec: WorkerSpec, opts: Options, client: httpx.AsyncClient, ctx: zmq.asyncio.Context
    ) -> None:
        self.spec = spec
        self.opts = opts
        self.client = client
        self.ctx = ctx
        self.report = WorkerReport(url=spec.url)
        self.fingerprint: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self.model: str | None = None
        self.feeds: list[_Feed] = []
        self.probe_error = ""
        self.max_prompt: int | None = None
        self.advertised: str | None = None  # rank 0's endpoint as /kv_event_sources reports it

    # ---------------------------------------------------------------- http

    async def _get(self, path: str) -> httpx.Response:
        return await self.client.get(path, timeout=self.opts.timeout_s)

    async def _post(self, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
        return await self.client.post(path, json=body, timeout=self.opts.timeout_s, **kw)

    async def _tokenize(self, body: dict[str, Any]) -> list[int]:
        resp = await self._post("/tokenize", {**body, "model": self.model})
        if resp.status_code != 200:
            raise RuntimeError(f"/tokenize answered {resp.status_code}: {resp.text[:120]}")
        return decode_tokenize_response(resp.content).tolist()

    async def _complete(self, ids: list[int], rank: int | None) -> dict[str, Any] | None:
        """The completion's answer, or None (the reason kept in ``probe_error``)."""
        headers = {"x-data-parallel-rank": str(rank)} if rank is not None else {}
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
        try:
            resp = await self._post("/v1/completions", body, headers=headers)
            doc = msgspec.json.decode(resp.content) if resp.status_code == 200 else None
        except (httpx.HTTPError, msgspec.DecodeError) as exc:
            self.probe_error = f"{type(exc).__name__}: {exc}"[:160]
            return None
        if not isinstance(doc, dict):
            self.probe_error = f"answered {resp.status_code}: {resp.text[:120]}"
            return None
        return doc

    # ---------------------------------------------------------------- checks

    async def run(self) -> None:
        r = self.report
        try:
            if not await self._reach():
                for c in ("models", "tokenizer", "events", "replay", "usage", "prefix-cache"):
                    r.add(c, SKIP, "worker unreachable")
                return
            await self._check_tokenizer()
            sources = await self._sources()
            if sources:
                self._subscribe(sources[0])
                await self._wait_connected()
            probes = await self._send_probes()
            await self._wait_events(probes)
            await self._repeat(probes[0] if probes else None)
            self._judge_events(probes, bool(sources))
            await self._check_replay(probes, sources[1] if sources else [])
        finally:
            self.close()

    async def _reach(self) -> bool:
        r = self.report
        try:
            resp = await self._get("/v1/models")
            resp.raise_for_status()
            data = msgspec.json.decode(resp.content).get("data") or []
        except Exception as exc:
            why = f"GET /v1/models failed: {type(exc).__name__}: {exc}"[:200]
            r.add("reach", FAIL, why, FIX["reach"])
            return False
        cards = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        r.models = [m["id"] for m in cards if not m.get("parent")]
        r.loras = sorted(m["id"] for m in cards if m.get("parent"))
        if not r.models:
            r.add("reach", FAIL, "/v1/models lists no base model", FIX["reach"])
            return False
        self.model = r.models[0]
        base = next(m for m in cards if m["id"] == self.model)
        if isinstance(base.get("max_model_len"), int) and base["max_model_len"] > 2:
            self.max_prompt = base["max_model_len"] - 1  # room for the one generated token
        r.add("reach", OK, "answers /v1/models")
        return True

    async def _check_tokenizer(self) -> None:
        try:
            prompt = await self._tokenize({"prompt": PROMPT, "add_special_tokens": True})
            chat = await self._tokenize({"messages": CHAT})
        except Exception as exc:
            self.report.add("tokenizer", FAIL, f"/tokenize: {type(exc).__name__}: {exc}"[:200])
            return
        self.fingerprint = (tuple(prompt), tuple(chat))
        self.report.add("tokenizer", OK, f"prompt {len(prompt)} ids, chat {len(chat)} ids")
        await self._check_chat(len(chat))

    async def _check_chat(self, template_tokens: int) -> None:
        """How the worker renders a chat completion: the fixed chat's ``prompt_tokens``
        against its ``/tokenize`` (the template) and against harmony (GPT-OSS)."""
        r = self.report
        body = {"model": self.model, "messages": CHAT, "max_tokens": 1, "temperature": 0.0}
        try:
            resp = await self._post("/v1/chat/completions", body)
            doc = msgspec.json.decode(resp.content) if resp.status_code == 200 else None
        except (httpx.HTTPError, msgspec.DecodeError) as exc:
            r.add("chat", SKIP, f"the probe chat failed: {type(exc).__name__}")
            return
        n = prompt_tokens_of(doc) if isinstance(doc, dict) else None
        if n is None:
            r.add("chat", SKIP, f"the probe chat answered {resp.status_code} without usage")
            return
        if n == template_tokens:
            r.add("chat", OK, "chat completions render as /tokenize does (the chat template)")
            await self._check_tools(template_tokens, harmony_format=False)
            return
        harmony_tokens = _harmony_tokens()
        if n == harmony_tokens:
            r.add(
                "chat", OK, "chat completions are rendered in harmony (GPT-OSS), as the router does"
            )
            await self._check_tools(harmony_tokens, harmony_format=True)
            return
        detail = f"chat completions count {n} prompt tokens, /tokenize renders {template_tokens}"
        fix = FIX["harmony"] if harmony_tokens is None else FIX["chat"]
        r.add("chat", WARN, detail, fix)

    async def _check_tools(self, without: int, *, harmony_format: bool) -> None:
        """Whether the worker renders a chat with ``tool_choice: "none"`` with its tools
        (``without``: the chat's length without them; ``harmony_format``: the worker renders
        chats in harmony, else with the template its ``/tokenize`` applies)."""
        r = self.report
        try:
            if harmony_format:
                with_tools = _harmony_tokens(tools=True)
            else:
                with_tools = len(await self._tokenize({"messages": CHAT, "tools": [TOOL]}))
            if with_tools == without:
                return  # the template renders no tools: nothing to tell
            body = {"model": self.model, "messages": CHAT, "tools": [TOOL],
                    "tool_choice": "none", "max_tokens": 1, "temperature": 0.0}  # fmt: skip
            resp = await self._post("/v1/chat/completions", body)
            if resp.status_code != 200:
                why = f"the probe chat with a tool answered {resp.status_code}"
                r.add("tools", SKIP, f"{why}: {resp.text[:120]}")
                return
            doc = msgspec.json.decode(resp.content)
        except (httpx.HTTPError, ValueError, RuntimeError) as exc:  # HarmonyError: a ValueError
            r.add("tools", SKIP, f"the probe chat with a tool failed: {type(exc).__name__}")
            return
        n = prompt_tokens_of(doc) if isinstance(doc, dict) else None
        verdict = tools_verdict(n, with_tools, without)
        if verdict == "kept":
            r.add("tools", OK, 'a chat with tool_choice "none" is rendered with its tools')
        elif verdict == "dropped":
            r.add(
                "tools",
                OK,
                'a chat with tool_choice "none" is rendered without its tools '
                "(--exclude-tools-when-tool-choice-none): the router's self-check learns it, "
                "or set model.exclude_tools_when_tool_choice_none: true",
            )
        else:
            why = f"the chat with a tool and tool_choice none counted {n} prompt tokens"
            r.add("tools", WARN, f"{why}: {with_tools} with the tool, {without} without")

    async def _sources(self) -> tuple[list[str], list[str]] | None:
        """(events, replay) endpoints per DP rank, or None (with the events finding made)."""
        r, spec = self.report, self.spec
        events, replay, dp, topic = spec.events, spec.replay, spec.dp_size, spec.topic
        if events is None:
            try:
                resp = await self._get("/kv_event_sources")
            except Exception as exc:
                r.add("events", FAIL, f"GET /kv_event_sources failed: {type(exc).__name__}")
                return None
            if resp.status_code == 404:
                r.add(
                    "events", FAIL, "no /kv_event_sources and no events= given", FIX["no_sources"]
                )
                return None
            doc = msgspec.json.decode(resp.content) if resp.status_code == 200 else None
            if not isinstance(doc, dict) or not doc:
                r.add(
                    "events", FAIL, "KV events off (/kv_event_sources is empty)", FIX["events_off"]
                )
                return None
            first = doc[min(doc, key=int)]
            events, replay = first.get("endpoint"), first.get("replay_endpoint")
            self.advertised = events if isinstance(events, str) else None
            dp, topic = max(len(doc), dp), first.get("topic") or topic
            if not isinstance(events, str):
                r.add("events", FAIL, "/kv_event_sources has no endpoint", FIX["events_off"])
                return None
        r.dp_size, r.topic = dp, topic
        host = self.spec.host
        r.events_endpoints = [concrete_endpoint(events, host, k) for k in range(dp)]
        r.replay_endpoints = (
            [concrete_endpoint(replay, host, k) for k in range(dp)] if replay else []
        )
        return r.events_endpoints, r.replay_endpoints

    def _subscribe(self, events: list[str]) -> None:
        for rank, ep in enumerate(events):
            sock = self.ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: the one seen is reported
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            feed = _Feed(rank, ep, sock, monitor)
            sock.connect(ep)
            feed.tasks = [
                asyncio.create_task(self._read(feed)),
                asyncio.create_task(self._watch(feed)),
            ]
            self.feeds.append(feed)

    async def _read(self, feed: _Feed) -> None:
        while True:
            frames = await feed.sock.recv_multipart()
            now = time.time()
            if len(frames) != 3 or len(frames[1]) != 8:
                feed.undecodable += 1
                continue
            try:
                batch = decode_payload(frames[2])
            except DecodeError:
                feed.undecodable += 1
                continue
            feed.seen.append(_Seen(now, int.from_bytes(frames[1], "big"), frames[0], batch))

    async def _watch(self, feed: _Feed) -> None:
        await feed.monitor.recv_multipart()  # only handshakes are monitored
        feed.connected.set()

    async def _wait_connected(self) -> None:
        waits = [asyncio.create_task(f.connected.wait()) for f in self.feeds]
        await asyncio.wait(waits, timeout=self.opts.timeout_s)
        for t in waits:
            t.cancel()

    async def _send_probes(self) -> list[_Probe]:
        """One probe per DP rank (the ``x-data-parallel-rank`` header places it)."""
        probes: list[_Probe] = []
        for rank in range(self.report.dp_size or 1):
            p = _Probe(await self._probe_ids())
            doc = await self._complete(p.ids, rank if (self.report.dp_size or 1) > 1 else None)
            p.answered = doc is not None
            p.cached = cached_tokens_of(doc)
            probes.append(p)
        if not probes[0].answered:
            self.report.add("usage", FAIL, f"the probe completion failed: {self.probe_error}")
        elif probes[0].cached is None:
            self.report.add(
                "usage", FAIL, "usage.prompt_tokens_details.cached_tokens missing", FIX["usage"]
            )
        else:
            self.report.add("usage", OK, "usage.prompt_tokens_details.cached_tokens reported")
        return probes

    async def _probe_ids(self) -> list[int]:
        """A unique prompt of ``probe_tokens`` ids valid for the worker's vocabulary."""
        n = min(self.opts.probe_tokens, self.max_prompt or self.opts.probe_tokens)
        words = " ".join(secrets.token_hex(4) for _ in range(n // 2))
        seed: list[int] = []
        with contextlib.suppress(Exception):
            seed = await self._tokenize(
                {"prompt": f"kvrouter doctor {words}", "add_special_tokens": False}
            )
        if len(seed) < 8:  # no /tokenize: ids below 1000 exist in every vocabulary
            seed = [100 + secrets.randbelow(900) for _ in range(n)]
        return (seed * (n // len(seed) + 1))[:n]

    def _match(self, p: _Probe) -> None:
        for feed in self.feeds:
            for s in feed.seen:
                if any(
                    isinstance(ev, BlockStored) and _is_slice(ev.token_ids, p.ids)
                    for ev in s.batch.events
                ):
                    p.rank, p.seen = feed.rank, s
                    return

    async def _wait_events(self, probes: list[_Probe]) -> None:
        if not self.feeds:
            return
        deadline = time.monotonic() + self.opts.events_wait_s
        while True:
            for p in probes:
                if p.seen is None:
                    self._match(p)
            if all(p.seen is not None for p in probes) or time.monotonic() >= deadline:
                return
            await asyncio.sleep(0.05)

    async def _repeat(self, p: _Probe | None) -> None:
        """The first probe again: a hit shows prefix caching. A worker that ignores the rank
        header places it by load, so it is sent up to ``dp_size`` times to reach the rank."""
        r = self.report
        if p is None or not p.answered:
            r.add("prefix-cache", SKIP, "the probe completion failed")
            return
        for _ in range(max(r.dp_size or 1, 1)):
            doc = await self._complete(p.ids, p.rank if (r.dp_size or 1) > 1 else None)
            r.cached_tokens = cached_tokens_of(doc)
            if r.cached_tokens != 0:  # a hit, or nothing reported: repeating tells no more
                break

    def _judge_events(self, probes: list[_Probe], has_sources: bool) -> None:
        r = self.report
        self._judge_prefix_cache(probes)
        if not has_sources:
            for c in ("block-size", "groups", "dp", "clock"):
                r.add(c, SKIP, "no KV events")
            return
        matched = [p for p in probes if p.seen is not None]
        batches = sum(len(f.seen) for f in self.feeds)
        wait = f"{self.opts.events_wait_s:g}s"
        if matched:
            eps = sorted({self.feeds[p.rank].endpoint for p in matched if p.rank is not None})
            topic = (matched[0].seen.topic if matched[0].seen else b"").decode(errors="replace")
            r.add(
                "events", OK, f"BlockStored for the probe from {', '.join(eps)} (topic {topic!r})"
            )
        elif batches == 0 and not all(f.connected.is_set() for f in self.feeds):
            down = [f.endpoint for f in self.feeds if not f.connected.is_set()]
            hint = (
                ""
                if self.advertised is None or self._binds(self.advertised)
                else (
                    "; the publisher connects out to this address (bind topology): give kvrouter "
                    "events.bind, or bind the publisher on tcp://*:PORT"
                )
            )
            r.add("events", FAIL, f"cannot connect to {', '.join(down)}{hint}", FIX["unreachable"])
        elif batches:
            r.add(
                "events",
                FAIL,
                f"{batches} batch(es) arrived but none describes the probe",
                FIX["silent"],
            )
        elif r.cached_tokens == 0:
            r.add(
                "events",
                FAIL,
                f"no BlockStored within {wait}: prefix caching is off "
                "(vLLM publishes only cached blocks)",
                FIX["prefix"],
            )
        elif r.cached_tokens is None:
            r.add(
                "events",
                FAIL,
                f"connected, but no BlockStored within {wait} (events not "
                "published, or prefix caching off)",
                FIX["events_or_prefix"],
            )
        else:
            r.add(
                "events",
                FAIL,
                f"connected, but no BlockStored within {wait}: the publisher sends nothing",
                FIX["silent"],
            )
        self._judge_block_size()
        self._judge_groups()
        self._judge_dp(matched)
        self._judge_clock()

    @staticmethod
    def _binds(endpoint: str) -> bool:
        """Whether vLLM binds this endpoint (``_is_bind_endpoint``); else its PUB connects out."""
        return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))

    def _judge_prefix_cache(self, probes: list[_Probe]) -> None:
        r = self.report
        if not probes or not probes[0].answered:
            return
        stored = any(p.seen is not None for p in probes)
        n = len(probes[0].ids)
        if r.cached_tokens is None:
            if stored:
                r.add("prefix-cache", OK, "blocks are cached (BlockStored seen)")
            else:
                r.add("prefix-cache", SKIP, "cannot tell: no cached_tokens and no BlockStored")
        elif r.cached_tokens > 0:
            r.add("prefix-cache", OK, f"the repeated probe hit {r.cached_tokens} of {n} tokens")
        else:
            r.add("prefix-cache", FAIL, f"the repeated {n}-token probe hit 0 tokens", FIX["prefix"])

    def _stored(self) -> list[BlockStored]:
        return [
            ev
            for f in self.feeds
            for s in f.seen
            for ev in s.batch.events
            if isinstance(ev, BlockStored)
        ]

    def _judge_block_size(self) -> None:
        r = self.report
        stored = self._stored()
        if not stored:
            r.add("block-size", SKIP, "no BlockStored to read it from")
            return
        r.block_sizes = sorted({ev.block_size for ev in stored})
        for ev in stored:
            n = len(ev.block_hashes)
            if (
                ev.kv_cache_spec_kind in _FULL_ATTENTION
                and n
                and len(ev.token_ids) != ev.block_size * n
            ):
                r.add(
                    "block-size",
                    FAIL,
                    f"events declare block_size {ev.block_size} but carry "
                    f"{len(ev.token_ids) / n:g} tokens per block",
                    FIX["block_size_events"],
                )
                return
        r.add("block-size", OK, f"{', '.join(map(str, r.block_sizes))} (from events)")

    def _judge_groups(self) -> None:
        """The KV-cache groups the events declare, and what the router must be told of them."""
        r = self.report
        kinds: dict[int, str] = {}
        for ev in self._stored():
            if (ev.medium or "GPU") == "GPU":
                kinds.setdefault(ev.group_idx or 0, ev.kv_cache_spec_kind or "undeclared")
        if not kinds:
            r.add("groups", SKIP, "no BlockStored to read them from")
            return
        each = ", ".join(f"{g}: {k}" for g, k in sorted(kinds.items()))
        if any(group_kind(k) == CHUNKED for k in kinds.values()):
            detail = f"{each}; the attention chunk is not in the events"
            r.add("groups", WARN, detail, FIX["attention_chunk"])
            return
        r.add("groups", OK, f"{each} (from events)")

    def _judge_dp(self, matched: list[_Probe]) -> None:
        r = self.report
        dp = r.dp_size or 1
        ranks = {p.rank for p in matched}
        if not matched:
            r.add("dp", SKIP, f"{dp} rank(s) declared; no event confirms them")
        elif ranks >= set(range(dp)):
            r.add("dp", OK, f"{dp} rank(s), each published its probe's blocks")
        else:
            missing = sorted(set(range(dp)) - ranks)
            eps = ", ".join(self.feeds[k].endpoint for k in missing)
            r.add("dp", FAIL, f"{dp} ranks; rank(s) {missing} published nothing ({eps})", FIX["dp"])

    def _judge_clock(self) -> None:
        r = self.report
        seen = [s for f in self.feeds for s in f.seen]
        if not seen:
            r.add("clock", SKIP, "no event batch to read a timestamp from")
            return
        # ts - recv = skew - latency: the largest is the closest to the skew.
        skew = max(s.batch.ts - s.recv for s in seen)
        r.clock_skew_s = round(skew, 3)
        detail = f"event timestamps {skew:+.3f}s from the local clock"
        if abs(skew) > self.opts.max_skew_s:
            r.add("clock", FAIL, f"{detail} (over {self.opts.max_skew_s:g}s)", FIX["clock"])
        else:
            r.add("clock", OK, detail)

    async def _check_replay(self, probes: list[_Probe], replay: list[str]) -> None:
        r = self.report
        if not r.events_endpoints:
            r.add("replay", SKIP, "no KV events")
            return
        if not replay:
            r.add(
                "replay",
                FAIL,
                "no replay endpoint: a lost batch cannot be recovered",
                FIX["replay"],
            )
            return
        problems: list[str] = []
        checked = 0
        for rank, ep in enumerate(replay):
            want = next((p.seen.seq for p in probes if p.seen and p.rank == rank), None)
            # Without a batch to ask for, a start past every seq gets just the end marker.
            start = want if want is not None else 1 << 62
            try:
                res = await fetch_replay(self.ctx, ep, start, self.opts.timeout_s, max_batches=1000)
            except ReplayError as exc:
                problems.append(f"{ep}: {exc}")
                continue
            if want is not None:
                checked += 1
                if not any(seq == want for seq, _ in res.batches):
                    problems.append(f"{ep}: batch {want} missing from the replay")
        if problems:
            r.add("replay", FAIL, "; ".join(problems), FIX["replay_down"])
        elif checked:
            r.add("replay", OK, f"returned the probe's batch ({', '.join(replay)})")
        else:
            r.add("replay", OK, f"answers ({', '.join(replay)}); no batch to compare")

    def close(self) -> None:
        for f in self.feeds:
            for t in f.tasks:
                t.cancel()
            with contextlib.suppress(zmq.ZMQError):
                f.sock.disable_monitor()
            f.sock.close(linger=0)
            f.monitor.close(linger=0)
        self.feeds = []
