"""Exact prompt tokens and content keys for a request.

Default (``tokenizer.mode: remote``): ask a worker's ``POST /tokenize`` -- chat form for chat
requests (the worker's own chat template renders ``messages`` with the request's
``add_generation_prompt`` / ``continue_final_message`` / ``chat_template_kwargs`` / ``tools``,
and ``documents`` / ``reasoning_effort`` passed inside the kwargs: :func:`template_arguments`),
prompt form for completions (``add_special_tokens`` defaults to true). A completion whose
``prompt`` is already token ids is not tokenized at all; one whose text prompt was tokenized
here goes to the worker as those ids (:meth:`PromptTokenizer.upstream_ids`), so each prompt is
tokenized once per request.

Optional ``tokenizer.mode: local``: a ``tokenizers`` tokenizer from ``tokenizer.path``
(``tokenizer.json``; chat template from ``tokenizer_config.json`` rendered with jinja2), checked
against a worker's ``/tokenize`` at start-up (:meth:`PromptTokenizer.verify_local`); on any
mismatch the router logs it and stays remote. It renders the chats whose messages it can hand
the template exactly as vLLM's parser does (:func:`local_conversation`: string content, no
tool calls or tool results); any other chat goes to a worker's ``/tokenize``.

A GPT-OSS fleet (``model.chat_format``): vLLM renders such a model's chats in the harmony format
rather than with its template, and so does the router, in process (router/harmony.py; a
Responses API request from its input items, router/harmony_responses.py); the date in the
system message is part of the cache key.

Caching (bounded LRU, ``tokenizer.cache_entries`` entries and a token budget): results are keyed
by a 128-bit hash of the namespace plus the JSON of the tokenize request, and hold the tokens
(packed uint32) and their chained content keys. The JSON keeps the client's key order, and is
the body the worker gets: a template writes tools (and any object it renders) with
``tojson``, in the order the client sent, so a request with its keys reordered is another
prompt. Multi-turn chat: each entry is
also filed under the hash of its message list, so a request whose messages *extend* a cached
conversation finds it. The worker still tokenizes the new request (exactness: a chat template
may render earlier turns differently once more follow), but content keys are reused for the
longest token prefix shared with the cached conversation and computed only for the new tokens;
since keys are chained, that is exact.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import numpy as np
import xxhash

from indexer.keys import chain_keys, tokens_to_bytes
from indexer.native import ids_from_json, ids_to_json
from router import harmony_responses
from router.anthropic import BILLING_HEADER
from router.harmony import HarmonyChats, HarmonyError, HarmonyRenderer
from router.harmony_responses import INPUT as HARMONY_INPUT
from router.model_set import ModelSet
from router.truncation import prefilled_window

__all__ = [
    "REFUSAL_CHARS",
    "LocalTokenizer",
    "PromptTokenizer",
    "TokenIds",
    "TokenizeError",
    "TokenizeRefused",
    "Tokenized",
    "model_attention_chunk",
    "model_type",
    "short_tool_call_ids",
    "template_arguments",
    "template_tools",
]

log = logging.getLogger("kvrouter.tokenize")

CHAT_FORWARD_KEYS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "tools",
    "add_special_tokens",
    "chat_template",
)


class TokenizeError(Exception):
    pass


class TokenizeRefused(TokenizeError):
    """A worker refused the tokenize request itself (4xx): another would refuse it too."""


REFUSAL_CHARS = 300
"""A worker's refusal is quoted up to this many characters."""


MISTRAL_ID_REFUSAL = "but must be a-z, A-Z, 0-9, with a length of 9"
"""How mistral-common refuses a tool-call id (vLLM's ``--tokenizer-mode mistral``)."""


def short_tool_call_ids(messages: Any) -> list[Any] | None:
    """The messages with each tool-call id longer than 9 characters cut to its last 9, as
    vLLM 0.32's chat endpoint cuts them for a model on its Mistral tokenizer
    (``truncate_tool_call_ids``: an assistant's tool calls and a tool message's
    ``tool_call_id``) before rendering; its ``/tokenize`` does not cut them and refuses the
    chat. None when no id is that long."""
    if not isinstance(messages, list):
        return None
    out: list[Any] | None = None
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        msg = m
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if isinstance(calls, list) and any(
            _long_id(c.get("id")) for c in calls if isinstance(c, dict)
        ):
            msg = {**m, "tool_calls": [
                {**c, "id": c["id"][-9:]} if isinstance(c, dict) and _long_id(c.get("id")) else c
                for c in calls
            ]}  # fmt: skip
        elif m.get("role") == "tool" and _long_id(m.get("tool_call_id")):
            msg = {**m, "tool_call_id": m["tool_call_id"][-9:]}
        if msg is not m:
            out = list(messages) if out is None else out
            out[i] = msg
    return out


def _long_id(value: Any) -> bool:
    return isinstance(value, str) and len(value) > 9


def template_arguments(body: dict[str, Any]) -> dict[str, Any]:
    """What vLLM's chat endpoint hands the chat template beside ``chat_template_kwargs``, and
    ``/tokenize`` takes only inside them (vLLM 0.32 ``build_chat_params``): ``documents`` and
    ``reasoning_effort``, which override the kwargs, and ``enable_thinking`` from
    ``reasoning_effort`` (``"none"``: off) unless the kwargs set it. A thinking model's
    template renders a different prompt without them (Qwen3: an empty thinking block)."""
    user = body.get("chat_template_kwargs")
    if user is not None and not isinstance(user, dict):
        return {}  # the worker refuses the request
    out: dict[str, Any] = {}
    for k in ("documents", "reasoning_effort"):
        if body.get(k) is not None:
            out[k] = body[k]
    effort = body.get("reasoning_effort")
    if effort is not None and "enable_thinking" not in (user or {}):
        out["enable_thinking"] = effort != "none"
    return out


def chat_messages(messages: list[Any]) -> list[Any]:
    """The messages as vLLM's chat endpoint hands them to the template, for ``/tokenize``
    (which reads them as sent) and a local template.

    The endpoint's request model renames the deprecated ``reasoning_content`` to ``reasoning``
    (vLLM 0.32 ``ChatCompletionRequest``); its message parser then gives an assistant message
    both fields, the reasoning under each (templates read either: Qwen3 and DeepSeek-R1
    ``reasoning_content``), and drops them from every other role. ``/tokenize`` skips the
    rename, so a client echoing ``reasoning_content`` made the worker tokenize a prompt
    without the reasoning its chat completion prefills. Messages without either field are
    passed as they are (no copy)."""
    out: list[Any] | None = None
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or ("reasoning" not in m and "reasoning_content" not in m):
            continue
        reasoning = m.get("reasoning")
        if reasoning is None:
            reasoning = m.get("reasoning_content")
        msg = {k: v for k, v in m.items() if k not in ("reasoning", "reasoning_content")}
        if m.get("role") == "assistant" and reasoning is not None:
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        if out is None:
            out = list(messages)
        out[i] = msg
    return messages if out is None else out


_LOCAL_ROLES = ("system", "user", "assistant")  # a tuple: any role value compares


def local_conversation(messages: Any) -> list[dict[str, Any]]:
    """The messages as vLLM 0.32's chat parser hands them to a string-format template, for the
    shapes a local template renders exactly: roles system, user and assistant, content a
    string (an assistant's may be absent: the template gets ""). The parser keeps only
    ``role``, ``content``, a string ``name`` and an assistant's reasoning (under both names,
    already set by :func:`chat_messages`) and drops a system message's leading
    ``x-anthropic-billing-header`` line. Content parts, tool calls, tool results and developer
    messages raise: vLLM joins parts by the template's content format, parses tool-call
    arguments into objects and converts developer messages by what the template supports,
    none of which a raw render does; the worker's ``/tokenize`` renders those."""
    if not isinstance(messages, list):
        raise TokenizeError("messages: a list")
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise TokenizeError("each message an object")
        role = m.get("role")
        if role not in _LOCAL_ROLES:
            raise TokenizeError(f"a {role!r} message: rendered by the worker")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise TokenizeError("content that is not a string: rendered by the worker")
        if m.get("tool_calls"):
            raise TokenizeError("tool calls: rendered by the worker")
        if role == "system" and content.startswith(BILLING_HEADER):
            content = content.partition("\n")[2]
        msg: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and m.get("reasoning") is not None:
            msg["reasoning"] = msg["reasoning_content"] = m["reasoning"]
        for key in ("name", "task"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def template_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A chat's ``tools`` as vLLM 0.32 hands them to the template: each read into its request
    model (``ChatCompletionToolsParam``) and dumped, so the function's keys come in the model's
    order (``name``, ``description``, ``parameters``, then ``strict`` and ``defer_loading`` when
    set), ``description`` and ``parameters`` are null when absent, and keys the model does not
    have are gone; a tool's own ``defer_loading`` is also its function's. ``/tokenize`` does
    the same, so only a local template needs it. A value the request model would coerce or
    refuse raises: the worker renders (or refuses) that chat."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise TokenizeError("tools: a list")
    out = []
    for t in tools:
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(f, dict) or t.get("type", "function") != "function":
            raise TokenizeError("a tool that is not a function: rendered by the worker")
        name, desc, params = f.get("name"), f.get("description"), f.get("parameters")
        if not isinstance(name, str) or not isinstance(desc, str | None):
            raise TokenizeError("a tool's name or description: rendered by the worker")
        if not isinstance(params, dict | None):
            raise TokenizeError("a tool's parameters: rendered by the worker")
        fn: dict[str, Any] = {"name": name, "description": desc, "parameters": params}
        defer, own = t.get("defer_loading"), f.get("defer_loading")
        flags = (("strict", f.get("strict")), ("defer_loading", defer if own is None else own))
        for key, v in flags:
            if v is not None:
                if not isinstance(v, bool):
                    raise TokenizeError(f"a tool's {key}: rendered by the worker")
                fn[key] = v
        tool: dict[str, Any] = {"type": "function", "function": fn}
        if defer is not None:
            if not isinstance(defer, bool):
                raise TokenizeError("a tool's defer_loading: rendered by the worker")
            tool["defer_loading"] = defer
        out.append(tool)
    return out


class TokenIds:
    """A worker's ``/tokenize`` answer in the two forms the request path needs, each made once.

    Why not a list of ints: an 8k-token answer decoded into Python ints, packed into uint32 for
    the keys and encoded again as JSON for the upstream body cost ~0.25 ms per request. Here the
    ``"tokens"`` array is kept as the bytes the worker sent (``json``, spliced into the upstream
    body as is) and parsed once straight into packed uint32 (``data``, :mod:`indexer.native`).
    """

    __slots__ = ("data", "json")

    def __init__(self, data: bytes, json: bytes) -> None:
        self.data = data
        """Packed little-endian uint32."""
        self.json = json
        """The JSON array of the ids, exactly as the worker wrote it."""

    def __len__(self) -> int:
        return len(self.data) // 4

    def tolist(self) -> list[int]:
        ids: list[int] = np.frombuffer(self.data, dtype="<u4").tolist()
        return ids


RemoteCall = Callable[[dict[str, Any] | bytes], Awaitable[TokenIds]]
"""Asks a worker's ``/tokenize``: the payload as a dict, or already JSON-encoded."""


@dataclass(slots=True)
class Tokenized:
    n_tokens: int
    data: bytes
    """Tokens as packed little-endian uint32."""
    keys: Sequence[int]
    """Content keys at every unit boundary up to ``n_tokens`` (``PrefixIndex.prompt_keys``): the
    GPU hit stops at ``n - 1`` tokens, but a CPU chunk may end exactly at ``n``."""
    root: int
    source: str
    """"cache", "remote", "local", "harmony", "ids", or "remote+prefix" (keys partly reused);
    "+truncated" when the tokens are the window ``truncate_prompt_tokens`` keeps."""
    reused_keys: int = 0
    ids_json: bytes | None = None
    """The ids as the JSON array a worker sent, when this request just received them (not kept
    in the cache)."""
    verifiable: bool = True
    """False when vLLM may cut the prompt to a length the router does not know
    (router/truncation.py): the worker's ``cached_tokens`` is then no check of the index."""


class _TokResp(msgspec.Struct):
    tokens: msgspec.Raw
    count: int | None = None


_tok_decoder = msgspec.json.Decoder(_TokResp)
_enc = msgspec.json.Encoder()  # insertion order: the order the template renders objects in


def _h128(*parts: bytes) -> bytes:
    h = xxhash.xxh3_128()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


class _TokRest(msgspec.Struct):
    tokens: list[int]
    count: int | None = None


_rest_decoder = msgspec.json.Decoder(_TokRest)
_TOKENS_KEY = re.compile(rb'"tokens"\s*:\s*\[')


def decode_tokenize_response(body: bytes) -> TokenIds:
    """The ids of a ``/tokenize`` answer (TokenizeError if it is not one).

    Fast path: the ``"tokens"`` array found by a search and parsed by ``ids_from_json``; the
    rest of the answer, with that array emptied, is then decoded by msgspec, which proves the
    array found was the top-level ``tokens`` (an array of ids holds no ``]``, and a match inside
    a string or a nested object leaves the real one non-empty) and checks ``count``. Why: msgspec
    skipping 45 KB of ids as ``Raw`` alone costs ~60 us; this costs ~30 us with the ids parsed.
    Anything else takes the general path.
    """
    m = _TOKENS_KEY.search(body)
    if m is not None:
        start = m.end() - 1
        end = body.find(b"]", start) + 1
        if end > 0:
            ids_json = body[start:end]
            try:
                data = ids_from_json(ids_json)
                rest = _rest_decoder.decode(b"".join((body[:start], b"[]", body[end:])))
            except (msgspec.DecodeError, ValueError):
                pass
            else:
                if not rest.tokens and rest.count in (None, len(data) // 4):
                    return TokenIds(data, ids_json)
    try:
        answer = _tok_decoder.decode(body)  # JSON syntax checked, ids not yet parsed
        data = ids_from_json(answer.tokens)
    except (msgspec.DecodeError, ValueError) as exc:
        raise TokenizeError(f"bad /tokenize response: {exc}") from None
    if answer.count not in (None, len(data) // 4):
        raise TokenizeError(
            f"bad /tokenize response: count {answer.count} but {len(data) // 4} tokens"
        )
    return TokenIds(data, bytes(answer.tokens))


def _tokenizer_file(path: str) -> str:
    """A local tokenizer's tokenizer.json: ``path`` itself, or in the folder ``path``; the
    model's other files (tokenizer_config.json, config.json) sit beside it."""
    return os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path


def _model_config(path: str) -> dict[str, Any]:
    """The ``config.json`` of the model folder holding a local tokenizer (``path``: the folder
    or its tokenizer.json), or {} when there is none to read."""
    folder = os.path.dirname(_tokenizer_file(path))
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def model_type(path: str) -> str | None:
    """``model_type`` from the model folder's ``config.json`` (vLLM renders a ``gpt_oss``
    model's chats in harmony), or None."""
    kind = _model_config(path).get("model_type")
    return kind if isinstance(kind, str) else None


def model_attention_chunk(path: str) -> int | None:
    """``attention_chunk_size`` from the model folder's ``config.json`` (a multimodal model's
    under ``text_config``), or None when there is none to read."""
    cfg = _model_config(path)
    for holder in (cfg, cfg.get("text_config")):
        chunk = holder.get("attention_chunk_size") if isinstance(holder, dict) else None
        if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0:
            return chunk
    return None


class LocalTokenizer:
    """``tokenizers`` tokenizer plus the model's jinja2 chat template."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer  # optional dependency (test extra)

        file = _tokenizer_file(path)
        self.tok = Tokenizer.from_file(file)
        self.template: Any = None
        self.source = ""
        self.reads_clock = False
        """The template calls ``strftime_now``: what it renders depends on the day."""
        self.special: dict[str, str] = {}
        cfg_path = os.path.join(os.path.dirname(file), "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
            for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
                v = cfg.get(k)
                if isinstance(v, dict):
                    v = v.get("content")
                if isinstance(v, str):
                    self.special[k] = v
            tmpl = cfg.get("chat_template")
            if isinstance(tmpl, list):  # named templates: use "default"
                tmpl = next((t["template"] for t in tmpl if t.get("name") == "default"), None)
            if isinstance(tmpl, str):
                self.source = tmpl
                self.reads_clock = "strftime_now" in tmpl
                self.template = _compile_template(tmpl)

    def encode_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(prompt, add_special_tokens=add_special_tokens).ids

    def encode_chat(self, req: dict[str, Any]) -> list[int]:
        if self.template is None:
            raise TokenizeError("no chat template available locally")
        if req.get("chat_template") is not None:
            raise TokenizeError("request-supplied chat_template: use the worker")
        kwargs = dict(req.get("chat_template_kwargs") or {})
        if _CALL_ARGUMENTS & kwargs.keys():
            raise TokenizeError("chat_template_kwargs naming transformers' own arguments")
        messages = local_conversation(req["messages"])
        agp = req.get("add_generation_prompt", True)
        cfm = req.get("continue_final_message", False)
        if cfm:
            if agp:
                raise TokenizeError("continue_final_message with add_generation_prompt")
            if "content" not in self.source:
                raise TokenizeError("continue_final_message: the template reads no content")
            final = messages[-1]["content"]
            messages[-1] = {**messages[-1], "content": final + _CONTINUE_TAG}
        text = self.template.render(
            messages=messages,
            tools=template_tools(req.get("tools")),
            documents=kwargs.pop("documents", None),
            add_generation_prompt=bool(agp),
            **self.special,
            **kwargs,
        )
        if cfm:
            text = _continued(text, final)
        return self.encode_prompt(text, bool(req.get("add_special_tokens", False)))


_CALL_ARGUMENTS = frozenset(
    ("conversation", "tools", "chat_template", "add_generation_prompt", "continue_final_message",
     "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
     "return_assistant_tokens_mask", "tokenizer_kwargs")
)  # fmt: skip
"""``apply_chat_template``'s own parameters besides ``documents``: vLLM passes
``chat_template_kwargs`` naming them to the call, not the template (``truncation`` and
``max_length`` cut the ids); a worker renders such chats."""

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""What transformers appends to the message to continue, to find where it ends once rendered."""


def _continued(text: str, final: str) -> str:
    """The rendered chat cut where its final message ends, as transformers 5 cuts it for
    ``continue_final_message`` (``render_jinja_template``): at the tag it appended to the
    message, less the whitespace the template trimmed off the message's end."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise TokenizeError("continue_final_message: the template drops the final message")
    at = text.rindex(tag)
    return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def _compile_template(source: str) -> Any:
    """The chat template compiled as transformers compiles it (``_compile_jinja_template``):
    a sandbox that trims blocks, ``{% break %}`` / ``{% continue %}``, ``{% generation %}``
    blocks (rendered as their body), ``raise_exception``, ``strftime_now`` (the local time, as
    on the worker) and a ``tojson`` that keeps key order and escapes no HTML. None, with a
    warning, when jinja2 is missing or the template does not compile: chats then go to a
    worker's ``/tokenize``."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - jinja2 ships with fastapi's extras
        log.warning("jinja2 not installed: local chat templating unavailable")
        return None

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body)
            return call.set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        log.warning("the chat template does not compile here (%s): chats go to /tokenize", exc)
        return None


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """The ``tojson`` filter chat templates get from Hugging Face transformers (which vLLM
    renders with): the objects' own key order and the template's indent and separators
    (Llama 3.1 writes its tools with ``tojson(indent=4)``), not jinja2's sorted default."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(msg: str) -> None:
    raise TokenizeError(msg)


@dataclass(slots=True)
class _Entry:
    data: bytes
    keys: array
    root: int


class PromptTokenizer:
    def __init__(
        self,
        unit: int,
        cache_entries: int = 4096,
        max_cached_tokens: int = 32_000_000,
        local: LocalTokenizer | None = None,
        harmony: HarmonyChats | None = None,
        tools_dropped: ModelSet | None = None,
    ) -> None:
        self.unit = unit
        self.harmony = harmony
        """The models whose chats are rendered in harmony (GPT-OSS): router/harmony.py."""
        self.tools_dropped = tools_dropped
        """The models whose workers run vLLM's ``--exclude-tools-when-tool-choice-none``: a
        chat with ``tool_choice: "none"`` reaches their template without its tools, while
        their ``/tokenize`` (which takes no ``tool_choice``) would render them."""
        self.short_tool_call_ids = ModelSet()
        """The models whose workers run vLLM's Mistral tokenizer: their chat endpoint cuts
        tool-call ids to 9 characters (:func:`short_tool_call_ids`) and their ``/tokenize``
        refuses longer ones. Learned from that refusal; their chats are then cut here. It
        holds at most the names the workers serve: a name is learned only once a worker has
        tokenized a chat under it."""
        self.cache_entries = cache_entries
        self.max_cached_tokens = max_cached_tokens
        self.local = local
        self._cache: OrderedDict[bytes, _Entry] = OrderedDict()
        self._conv: OrderedDict[bytes, bytes] = OrderedDict()
        self._cached_tokens = 0
        self.stats = {"hits": 0, "misses": 0, "prefix_reuse": 0, "reused_keys": 0}

    # ---------------------------------------------------------------- request forms

    @staticmethod
    def tokenize_payload(
        body: dict[str, Any], chat: bool, *, drop_tools: bool = False
    ) -> dict[str, Any] | list[int] | None:
        """The worker ``/tokenize`` body for a request, or token ids when none is needed;
        ``drop_tools``: without the chat's tools (:meth:`drops_tools`).

        None: nothing to tokenize (no prompt).
        """
        model = body.get("model")
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list):
                return None
            payload: dict[str, Any] = {"messages": chat_messages(msgs)}
            for k in CHAT_FORWARD_KEYS:
                if k in body and not (drop_tools and k == "tools"):
                    payload[k] = body[k]
            extra = template_arguments(body)
            if extra:
                payload["chat_template_kwargs"] = {
                    **(body.get("chat_template_kwargs") or {}),
                    **extra,
                }
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt:
                first = prompt[0]
                if isinstance(first, int) and not isinstance(first, bool):
                    return prompt  # already token ids
                if isinstance(first, list):
                    return first  # batch of token-id prompts: route by the first
                if isinstance(first, str):
                    prompt = first  # batch of strings: route by the first
            if not isinstance(prompt, str):
                return None
            payload = {"prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}
        if model is not None:
            payload["model"] = model
        return payload

    def harmony_for(self, body: dict[str, Any]) -> HarmonyRenderer | None:
        """The harmony renderer when the workers render this body's chat in harmony."""
        h = self.harmony
        return h.renderer if h is not None and h.covers(body.get("model")) else None

    def drops_tools(self, body: dict[str, Any]) -> bool:
        """Whether the workers hand this chat's template no tools: ``tool_choice: "none"`` on
        a model whose workers run ``--exclude-tools-when-tool-choice-none`` (vLLM 0.32
        ``OnlineRenderer``: chat completions, and the Anthropic and Responses APIs rendered
        through it)."""
        d = self.tools_dropped
        return body.get("tool_choice") == "none" and d is not None and d.covers(body.get("model"))

    @staticmethod
    def _harmony_payload(
        body: dict[str, Any], harmony: HarmonyRenderer, drop_tools: bool
    ) -> dict[str, Any] | None:
        """What a harmony rendering depends on: its cache key and the renderer's input."""
        if HARMONY_INPUT in body:  # a Responses request: router/harmony_responses.py
            keys = (*harmony_responses.FIELDS, "model")
            payload = {k: body[k] for k in keys if body.get(k) is not None}
            return payload | {"start_date": harmony.start_date()}
        if not isinstance(body.get("messages"), list):
            return None
        payload = {"messages": body["messages"], "start_date": harmony.start_date()}
        for k in ("tools", "reasoning_effort", "model"):
            if body.get(k) is not None and not (drop_tools and k == "tools"):
                payload[k] = body[k]
        return payload

    # ---------------------------------------------------------------- main entry

    async def tokenize(
        self,
        body: dict[str, Any],
        chat: bool,
        root: int,
        remote: RemoteCall | None,
    ) -> Tokenized:
        """The tokens vLLM prefills for ``body``: its whole prompt, or the window
        ``truncate_prompt_tokens`` keeps of it (router/truncation.py). TokenizeError when there
        is no prompt, no worker to tokenize it, or no window the router can know."""
        tok = await self._tokenize_whole(body, chat, root, remote)
        window = prefilled_window(
            body, tok.n_tokens, text_with_specials=self.text_with_specials(body, chat)
        )
        if isinstance(window, str):
            raise TokenizeError(window)
        if window.whole(tok.n_tokens):
            if not window.verifiable:
                tok = replace(tok, verifiable=False)
            return tok
        data = tok.data[window.start * 4 : window.stop * 4]
        n = window.stop - window.start
        return Tokenized(n, data, self._keys(data, n, root), root, tok.source + "+truncated")

    @staticmethod
    def text_with_specials(body: dict[str, Any], chat: bool) -> bool:
        """Whether the prompt's tokens come from text tokenized with special tokens added
        (vLLM's defaults: yes for a completion's text prompt, no for a chat)."""
        if chat:
            return bool(body.get("add_special_tokens", False))
        p = body.get("prompt")
        if isinstance(p, list) and p:
            p = p[0]
        return isinstance(p, str) and bool(body.get("add_special_tokens", True))

    async def _tokenize_whole(
        self,
        body: dict[str, Any],
        chat: bool,
        root: int,
        remote: RemoteCall | None,
    ) -> Tokenized:
        harmony = self.harmony_for(body) if chat else None
        drop_tools = chat and self.drops_tools(body)
        model = body.get("model")
        payload = (
            self.tokenize_payload(body, chat, drop_tools=drop_tools)
            if harmony is None
            else self._harmony_payload(body, harmony, drop_tools)
        )
        if payload is None:
            raise TokenizeError("request has no prompt or messages to tokenize")
        learned = self.short_tool_call_ids
        if chat and harmony is None and isinstance(payload, dict) and learned.covers(model):
            cut = short_tool_call_ids(payload["messages"])
            payload = payload if cut is None else {**payload, "messages": cut}
        if isinstance(payload, list):
            try:
                data = tokens_to_bytes(payload)
            except (ValueError, TypeError) as exc:
                raise TokenizeError(f"prompt token ids: {exc}") from None
            n = len(payload)
            return Tokenized(n, data, self._keys(data, n, root), root, "ids")
        try:
            enc = _enc.encode(payload)
        except (TypeError, msgspec.EncodeError) as exc:
            raise TokenizeError(f"request not encodable: {exc}") from None
        rootb = root.to_bytes(8, "little")
        ckey = _h128(rootb, enc, self._day(chat))
        hit = self._cache.get(ckey)
        if hit is not None:
            self._cache.move_to_end(ckey)
            self.stats["hits"] += 1
            return Tokenized(len(hit.data) // 4, hit.data, hit.keys, root, "cache")
        self.stats["misses"] += 1
        conv_hashes = self._conv_hashes(rootb, payload) if chat else []
        tokens: list[int] | None = None
        source = "remote"
        if harmony is not None:
            try:
                if HARMONY_INPUT in payload:
                    msgs = harmony_responses.messages(harmony, payload, payload["start_date"])
                    tokens = await harmony.render_messages_async(msgs)
                else:
                    tokens = await harmony.render_async(payload, payload["start_date"])
            except HarmonyError as exc:
                raise TokenizeError(str(exc)) from None
            source = "harmony"
        elif self.local is not None:
            try:
                if chat:
                    tokens = self.local.encode_chat(payload)
                else:
                    tokens = self.local.encode_prompt(
                        payload["prompt"], bool(payload.get("add_special_tokens", True))
                    )
                source = "local"
            except Exception as exc:  # template errors etc.: the worker decides
                log.debug("local tokenization failed, asking a worker: %s", exc)
                tokens = None
        ids_json = None
        if tokens is not None:
            data = tokens_to_bytes(tokens)
        else:
            if remote is None:
                raise TokenizeError("no worker available for /tokenize")
            got = await self._remote(remote, enc, payload if chat else None)
            data, ids_json = got.data, got.json
        n = len(data) // 4
        reused = 0
        keys: Sequence[int] | None = None
        if conv_hashes:
            prev = self._find_conversation(conv_hashes[:-1])
            if prev is not None:
                keys, reused = self._extend_keys(prev, data, n, root)
                if reused:
                    source += "+prefix"
                    self.stats["prefix_reuse"] += 1
                    self.stats["reused_keys"] += reused
        if keys is None:
            keys = self._keys(data, n, root)
        karr = keys if isinstance(keys, array) else array("Q", keys)
        self._store(ckey, _Entry(data, karr, root), conv_hashes[-1] if conv_hashes else None)
        return Tokenized(n, data, karr, root, source, reused, ids_json)

    async def _remote(
        self, remote: RemoteCall, enc: bytes, chat: dict[str, Any] | None
    ) -> TokenIds:
        """A worker's ``/tokenize`` of ``enc`` (the cache key's bytes are the request body
        too). A chat refused for its tool-call ids is asked again with them cut as the chat
        endpoint of a worker on vLLM's Mistral tokenizer cuts them, and its model learned."""
        try:
            return await remote(enc)
        except TokenizeRefused as exc:
            cut = short_tool_call_ids(chat["messages"]) if chat is not None else None
            if cut is None or MISTRAL_ID_REFUSAL not in str(exc):
                raise
            got = await remote(_enc.encode({**chat, "messages": cut}))
            model = chat.get("model")
            if model not in self.short_tool_call_ids.models:
                log.info(
                    "model %r: its workers cut tool-call ids to 9 characters (vLLM's Mistral "
                    "tokenizer); its chats are tokenized so",
                    model,
                )
            self.short_tool_call_ids.learn([model])
            return got

    def _day(self, chat: bool) -> bytes:
        """Today's date when a local template reads the clock (``strftime_now``: Llama 3's
        writes the date), so that a cached rendering holds for its day only (a template
        printing the time of day is still cached for the day); else nothing."""
        local = self.local
        if chat and local is not None and local.reads_clock:
            return datetime.date.today().isoformat().encode()
        return b""

    # ---------------------------------------------------------------- upstream body

    def upstream_ids(self, body: dict[str, Any], tok: Tokenized) -> msgspec.Raw | None:
        """The token ids to send the worker in place of a completion's text prompt, or None when
        the text must go as it came.

        Why: the router has just had a worker tokenize the prompt (or found that result in its
        cache); sending the text would make the chosen worker tokenize it again, a second full
        tokenization on the request path (milliseconds for long prompts). vLLM serves a
        ``prompt`` given as token ids exactly as the same prompt given as text that tokenizes to
        them (``add_special_tokens`` was applied by ``/tokenize``). NVIDIA Dynamo's frontend sends
        token ids the same way.

        Only ids that came from a worker's ``/tokenize`` qualify: a local tokenizer is checked
        on a few probes only, and a difference must not change what the model sees. ``echo``
        keeps the text, so the echoed prompt is byte for byte the client's; batches (several
        prompts) and prompts already given as ids pass through unchanged.
        """
        if self.local is not None or tok.source == "ids" or body.get("echo"):
            return None
        if body.get("truncate_prompt_tokens") is not None:
            return None  # vLLM truncates text and ids differently (router/truncation.py)
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1:
            p = p[0]
        if not isinstance(p, str):
            return None
        if tok.ids_json is not None:
            return msgspec.Raw(tok.ids_json)  # written into the body as is, not re-encoded
        # From the cache (packed uint32 only): written as JSON in one C pass (indexer.native),
        # not through a list of ints (0.1 ms at 8k tokens, 1.6 ms at 128k).
        return msgspec.Raw(ids_to_json(tok.data))

    # ---------------------------------------------------------------- keys

    def _keys(self, data: bytes, n: int, root: int) -> list[int]:
        usable = n // self.unit
        return chain_keys(root, data, self.unit, usable)

    def _extend_keys(self, prev: _Entry, data: bytes, n: int, root: int) -> tuple[array, int]:
        if prev.root != root or not prev.keys:
            return array("Q", self._keys(data, n, root)), 0
        a = np.frombuffer(prev.data, dtype=np.uint32)
        b = np.frombuffer(data, dtype=np.uint32)
        m = min(len(a), len(b))
        diff = np.flatnonzero(a[:m] != b[:m])
        common = int(diff[0]) if len(diff) else m
        usable = n // self.unit
        reuse = min(common // self.unit, len(prev.keys), usable)
        keys = array("Q", prev.keys[:reuse])
        seed = keys[-1] if reuse else root
        start = reuse * self.unit * 4
        keys.extend(chain_keys(seed, data[start : usable * self.unit * 4], self.unit))
        return keys, reuse

    # ---------------------------------------------------------------- conversation index

    @staticmethod
    def _conv_hashes(rootb: bytes, payload: dict[str, Any]) -> list[bytes]:
        """Running hashes of messages[:1], messages[:2], ... (with the non-message options)."""
        msgs = payload.get("messages") or []
        rest = {k: v for k, v in payload.items() if k != "messages"}
        try:
            h = xxhash.xxh3_128(rootb + _enc.encode(rest))
            out = []
            for m in msgs:
                part = _enc.encode(m)
                h.update(len(part).to_bytes(8, "little"))
                h.update(part)
                out.append(h.digest())
        except (TypeError, msgspec.EncodeError):
            return []
        return out

    def _find_conversation(self, prefixes: list[bytes]) -> _Entry | None:
        for h in reversed(prefixes):
            ck = self._conv.get(h)
            if ck is not None:
                e = self._cache.get(ck)
                if e is not None:
                    return e
        return None

    def _store(self, ckey: bytes, entry: _Entry, conv: bytes | None) -> None:
        if self.cache_entries <= 0:
            return
        self._cache[ckey] = entry
        self._cached_tokens += len(entry.data) // 4
        if conv is not None:
            self._conv[conv] = ckey
            if len(self._conv) > self.cache_entries:
                self._conv.popitem(last=False)
        while self._cache and (
            len(self._cache) > self.cache_entries or self._cached_tokens > self.max_cached_tokens
        ):
            _, old = self._cache.popitem(last=False)
            self._cached_tokens -= len(old.data) // 4

    def __len__(self) -> int:
        return len(self._cache)

    # ---------------------------------------------------------------- start-up check

    async def verify_local(self, remote: RemoteCall, model: str | None) -> list[str]:
        """Compare the local tokenizer with a worker's; returns mismatches (empty: exact)."""
        if self.local is None:
            return []
        samples: list[tuple[bool, dict[str, Any]]] = [
            (
                False,
                {
                    "prompt": "Hello, world! The quick brown fox: 123 ü ✓",
                    "add_special_tokens": True,
                },
            ),
            (
                True,
                {
                    "messages": [
                        {"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": "What is 2+2?"},
                    ]
                },
            ),
        ]
        problems = []
        for chat, payload in samples:
            if model is not None:
                payload["model"] = model
            try:
                if chat:
                    mine = self.local.encode_chat(payload)
                else:
                    mine = self.local.encode_prompt(payload["prompt"], True)
            except Exception as exc:
                problems.append(f"{'chat' if chat else 'prompt'}: local tokenizer failed: {exc}")
                continue
            theirs = (await remote(payload)).tolist()
            if mine != theirs:
                problems.append(
                    f"{'chat' if chat else 'prompt'}: local {mine[:12]}... "
                    f"!= worker {theirs[:12]}..."
                )
        return problems
