"""Responses API requests to a GPT-OSS model: the router renders them in harmony from their input
items, to the ids vLLM prefills.

Ground truth: ``tests/fixtures/vllm-captures/harmony-responses.json``, each body rendered by
vLLM 0.32's own ``ResponsesRequest`` and ``OnlineRenderer._render_responses_with_harmony``
(``scripts/record_harmony_responses.py``), with system messages as developer instructions and
as system instructions, refusals included. The router end to end, a chat continued through the
Responses API: tests/test_harmony.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router import harmony_responses, passthrough
from router.harmony import HarmonyChats, HarmonyError, HarmonyRenderer
from router.tokenize import PromptTokenizer, TokenizeError

pytestmark = pytest.mark.timeout(120)

FIXTURE = Path(__file__).parent / "fixtures/vllm-captures/harmony-responses.json"
DOC = json.loads(FIXTURE.read_text())
CASES = DOC["cases"]
DATE = DOC["start_date"]
BY_LOAD = {"builtin-tool", "builtin-and-function"}
"""Bodies whose prompt depends on what the router does not see (the worker's tool server):
routed by load."""


@pytest.fixture(scope="module")
def renderers() -> dict[bool, HarmonyRenderer]:
    return {si: HarmonyRenderer(DATE, system_instructions=si) for si in (False, True)}


def _render(r: HarmonyRenderer, body: dict[str, Any]) -> list[int] | None:
    got = harmony_responses.prompt({"model": "m", **body})
    if got is None:
        return None
    return r.render_messages(harmony_responses.messages(r, got, DATE))


def test_the_fixture_covers_what_it_claims():
    assert DOC["vllm_version"] == "0.32.0"
    names = {c["name"] for c in CASES}
    assert {"tool-round-trip", "reasoning-item", "leading-system-item", "later-developer"} <= names
    assert {"previous-chat-form", "previous-harmony-form"} <= names
    assert {c["system_instructions"] for c in CASES} == {False, True}
    assert sum("error" in c for c in CASES) == 22  # eleven refusals, both modes
    assert names >= BY_LOAD


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c['name']}-si{int(c['system_instructions'])}"
)
def test_each_request_renders_to_the_ids_vllm_prefills(case: dict[str, Any], renderers):
    r = renderers[case["system_instructions"]]
    if case["name"] in BY_LOAD:
        assert harmony_responses.prompt(case["body"]) is None
    elif "error" in case:
        with pytest.raises(HarmonyError):
            _render(r, case["body"])
    else:
        assert _render(r, case["body"]) == case["prompt_token_ids"]


def _case(name: str) -> dict[str, Any]:
    return next(c for c in CASES if c["name"] == name and not c["system_instructions"])


async def test_the_tokenizer_renders_the_routing_body_and_caches_it():
    """What the gateway routes by (router/passthrough.py) tokenizes to vLLM's ids without asking
    a worker; what does not change the prompt (status, salt) does not change the ids, and the
    worker's truncation rule travels with it."""
    tok = PromptTokenizer(16, harmony=HarmonyChats(DATE, everywhere=True))
    asked: list[Any] = []

    async def remote(payload: Any) -> Any:
        asked.append(payload)
        raise TokenizeError("no worker here")

    for name in ("tool-round-trip", "previous-chat-form", "previous-harmony-form"):
        case = _case(name)
        body = {"model": "gpt-oss", **case["body"]}
        routed = passthrough.routing_body(body, harmony_responses.prompt(body))
        got = await tok.tokenize(routed, True, 0, remote)
        assert got.source == "harmony" and got.n_tokens == len(case["prompt_token_ids"]), name
        assert got.data == b"".join(i.to_bytes(4, "little") for i in case["prompt_token_ids"])
        assert (await tok.tokenize(routed, True, 0, remote)).source == "cache"
    assert not asked

    salted = {"model": "gpt-oss", **_case("truncation-salt")["body"]}
    routed = passthrough.routing_body(salted, harmony_responses.prompt(salted))
    assert routed["cache_salt"] == "s1" and routed["truncate_prompt_tokens"] == -1
    got = await tok.tokenize(routed, True, 0, remote)
    assert got.n_tokens == len(_case("truncation-salt")["prompt_token_ids"])

    refused = {"model": "gpt-oss", **_case("custom-tool-call")["body"]}
    with pytest.raises(TokenizeError, match="custom_tool_call"):
        await tok.tokenize(
            passthrough.routing_body(refused, harmony_responses.prompt(refused)), True, 0, remote
        )


def test_debug_route_says_how_the_prompt_was_read():
    body = {"model": "gpt-oss", "input": "hi"}
    how = passthrough.describe("/v1/responses", harmony_responses.prompt(body))
    assert how.startswith("by cache") and "harmony" in how


_TEXT = st.text(max_size=12)
_PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("input_text"), "text": _TEXT}),
    st.fixed_dictionaries({"type": st.just("input_image"), "image_url": _TEXT}),
    st.fixed_dictionaries({"text": st.one_of(_TEXT, st.integers(), st.none())}),
)
_CONTENT = st.one_of(_TEXT, st.lists(_PART, max_size=3), st.none(), st.integers())
_ITEM = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "developer", "tool", 3]),
            "content": _CONTENT,
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": st.sampled_from(["a", "b"]),
            "name": st.one_of(_TEXT, st.none()),
            "arguments": st.one_of(_TEXT, st.integers()),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call_output"),
            "call_id": st.sampled_from(["a", "b"]),
            "output": st.one_of(_TEXT, st.lists(_PART, max_size=2)),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("reasoning"),
            "content": st.one_of(
                st.none(),
                st.lists(st.fixed_dictionaries({"text": _TEXT})),
                st.lists(st.just({}), max_size=1),
                _TEXT,
            ),
        }
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["item_reference", "message", "x"])}),
    _TEXT,
    st.none(),
)
_HISTORY = st.one_of(
    st.fixed_dictionaries(
        {
            "author": st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "assistant", "tool", "developer", "x", 1])},
                optional={"name": st.one_of(_TEXT, st.integers())},
            ),
            "content": _CONTENT,
        },
        optional={"channel": st.one_of(_TEXT, st.integers()), "recipient": _TEXT},
    ),
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["assistant", "tool", "user"]),
            "tool_calls": st.lists(
                st.fixed_dictionaries(
                    {"function": st.fixed_dictionaries({"name": _TEXT, "arguments": _CONTENT})}
                ),
                max_size=2,
            ),
        },
        optional={"name": st.one_of(_TEXT, st.integers()), "content": _CONTENT},
    ),
)
_TOOL = st.one_of(
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "name": st.one_of(_TEXT, st.none()),
            "parameters": st.one_of(st.none(), st.just({"type": "object"}), _TEXT),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.one_of(
                st.sampled_from(["custom", "mcp", "namespace", "web_search"]), st.lists(_TEXT)
            ),
            "server_label": st.one_of(st.sampled_from(["container", "s"]), st.lists(_TEXT)),
        }
    ),
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    items=st.one_of(_TEXT, st.lists(_ITEM, max_size=6), st.none(), st.integers()),
    tools=st.one_of(st.none(), st.lists(_TOOL, max_size=3), _TEXT),
    instructions=st.one_of(st.none(), _TEXT, st.integers()),
    effort=st.sampled_from([None, "low", "high", "minimal", 5]),
    history=st.one_of(st.none(), _TEXT, st.lists(st.one_of(_HISTORY, _ITEM), max_size=4)),
)
def test_any_body_renders_or_is_refused(items, tools, instructions, effort, history, renderers):
    body: dict[str, Any] = {"input": items, "tools": tools, "instructions": instructions}
    body |= {"reasoning": {"effort": effort}, "previous_input_messages": history}
    try:
        ids = _render(renderers[False], body)
    except HarmonyError:
        return
    assert ids is None or (ids and all(isinstance(i, int) for i in ids))
