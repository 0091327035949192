"""Traffic for a real vLLM: the seeded multi-turn scenario and a tap on its KV event stream.

Shared by tests/test_real_vllm.py (sent through the router) and scripts/record_captures.py
(sent to vLLM directly). :func:`scenario` calls a ``send(label, body, chat)`` function once per
request, one at a time; each sender waits for the event stream to go quiet first
(:meth:`EventTap.quiet`), so the state a request meets is well defined: every event vLLM
published for the earlier requests has arrived.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
from real_vllm_models import BLOCK, SERVED, VOCAB

__all__ = ["FIRST_PLAIN_TOKEN", "EventTap", "Reply", "Send", "request_body", "scenario"]

FIRST_PLAIN_TOKEN = 8  # ids below are the tokenizer's special tokens


@dataclass(frozen=True)
class Reply:
    output_ids: list[int]
    text: str


Send = Callable[[str, dict[str, Any], bool], Reply]
"""``send(label, body, chat)``: one request (``body`` without the :func:`request_body`
defaults), answered once vLLM has finished it."""


def request_body(body: dict[str, Any]) -> dict[str, Any]:
    """What every scenario request carries: greedy, a fixed output length, and vLLM's token ids
    (a continuation turn appends vLLM's own output tokens)."""
    return {"model": SERVED, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            **body}  # fmt: skip


@dataclass
class EventTap:
    """A SUB socket on a thread: every frame in arrival order, and when the last came.

    ``bind=True``: vLLM's PUB connects to ``endpoint`` (so no frame is missed from the first);
    ``bind=False``: the tap connects to vLLM's bound PUB next to other subscribers."""

    endpoint: str
    bind: bool = True
    frames: list[tuple[bytes, bytes, bytes]] = field(default_factory=list)
    last: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVHWM, 0)
        if self.bind:
            self.sock.bind(self.endpoint)
        else:
            self.sock.connect(self.endpoint)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(50):
                msg = self.sock.recv_multipart()
                with self.lock:
                    self.frames.append((msg[0], msg[1], msg[2]))
                    self.last = time.monotonic()

    @property
    def last_seq(self) -> int | None:
        with self.lock:
            return int.from_bytes(self.frames[-1][1], "big") if self.frames else None

    def quiet(self, seconds: float, since: float) -> int:
        """Wait until no frame arrived for ``seconds`` (and ``seconds`` passed since
        ``since``); returns how many frames have arrived."""
        deadline = time.monotonic() + 120
        while True:
            with self.lock:
                last, n = max(self.last, since), len(self.frames)
            if time.monotonic() - last >= seconds:
                return n
            if time.monotonic() > deadline:
                raise RuntimeError("the event stream never went quiet")
            time.sleep(0.02)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close(0)
        self.ctx.term()


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_TOKEN, VOCAB) for _ in range(n)]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(100003)} {rng.choice(['alpha', 'beta', 'gamma'])}"
                    for _ in range(n))  # fmt: skip


def scenario(send: Send, seed: int, offload: bool) -> None:
    """54 requests (60 with CPU offloading): interleaved multi-turn conversations over shared
    system prompts (token continuations that include vLLM's own output, and chat turns), then
    repeats, partial prefixes, block-aligned prompts and a long prompt that evicts, the early
    ones again, and long prompts that only a CPU tier can keep."""
    rng = random.Random(seed)
    systems = [_tokens(rng, n) for n in (101, 197, 330)]
    # 1. Four conversations, five turns each, round robin: each turn is the previous prompt,
    #    vLLM's generated tokens, and a new user message.
    convs: list[list[int]] = [list(systems[c % 3]) for c in range(4)]
    firsts: list[list[int]] = []
    for t in range(5):
        for c in range(4):
            convs[c] = convs[c] + _tokens(rng, rng.randrange(20, 70))
            if t == 0:
                firsts.append(list(convs[c]))
            mt = rng.randrange(4, 40)
            out = send(f"conv{c}-t{t}", {"prompt": convs[c], "max_tokens": mt}, False)
            convs[c] = convs[c] + out.output_ids
    # 2. Chat: three conversations over two system texts, four turns; replies go back as text.
    sys_text = [_words(rng, 60), _words(rng, 110)]
    chats: list[list[dict[str, str]]] = [[{"role": "system", "content": sys_text[k % 2]}]
                                         for k in range(3)]  # fmt: skip
    for t in range(4):
        for k in range(3):
            chats[k].append({"role": "user", "content": _words(rng, rng.randrange(8, 25))})
            body = {"messages": chats[k], "max_tokens": rng.randrange(4, 24)}
            out = send(f"chat{k}-t{t}", body, True)
            chats[k].append({"role": "assistant", "content": out.text[:120] or "ok"})
    # 3. Edge cases.
    aligned = _tokens(rng, 8 * BLOCK)
    send("aligned-256", {"prompt": aligned, "max_tokens": 4}, False)
    send("aligned-256-again", {"prompt": aligned, "max_tokens": 4}, False)
    send("aligned-plus-1", {"prompt": [*aligned, 9], "max_tokens": 4}, False)
    send("conv1-last-again", {"prompt": convs[1][:900], "max_tokens": 4}, False)
    part = convs[2][:100] + _tokens(rng, 60)
    send("conv2-prefix-100", {"prompt": part, "max_tokens": 4}, False)
    send("system2-only", {"prompt": systems[2], "max_tokens": 4}, False)
    long_prompt = _tokens(rng, 700)
    send("long-700", {"prompt": long_prompt, "max_tokens": 8}, False)
    for c in range(4):
        send(f"conv{c}-t0-again", {"prompt": firsts[c], "max_tokens": 4}, False)
    send("long-700-again", {"prompt": long_prompt, "max_tokens": 4}, False)
    more = {"prompt": [*long_prompt[:512], 11, 12, 13], "max_tokens": 4}
    send("long-700-prefix-512", more, False)
    send("chat0-all-again", {"messages": chats[0][:-1], "max_tokens": 4}, True)
    # 4. Long prompts the GPU cannot keep together (it evicts tail blocks first) while a CPU
    #    tier can: each comes back after the others pushed most of it out of the GPU.
    longs = [_tokens(rng, n) for n in (600, 530, 800)]
    for i, p in enumerate(longs):
        send(f"big{i}", {"prompt": p, "max_tokens": 4}, False)
    for i, p in enumerate(longs):
        more = {"prompt": [*p, *_tokens(rng, 40)], "max_tokens": 4}
        send(f"big{i}-continued", more, False)
    send("big0-prefix-300", {"prompt": [*longs[0][:300], 15], "max_tokens": 4}, False)
    send("big2-again", {"prompt": longs[2], "max_tokens": 4}, False)
    if not offload:
        return
    # 5. CPU offloading only: a prompt of exactly two chunks comes back whole once the GPU has
    #    lost it (where the CPU lookup ends, n or n - 1: docs/vllm-captures.md §3.3-3.4).
    exact = _tokens(rng, 512)
    send("exact-512", {"prompt": exact, "max_tokens": 4}, False)
    for i in range(3):
        send(f"filler{i}", {"prompt": _tokens(rng, 700), "max_tokens": 4}, False)
    send("exact-512-again", {"prompt": exact, "max_tokens": 4}, False)
    send("exact-512-plus-1", {"prompt": [*exact, 17], "max_tokens": 4}, False)
