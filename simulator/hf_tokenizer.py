"""A Hugging Face ``tokenizers`` tokenizer with the model's chat template, for the simulator.

``kvrouter-sim --tokenizer DIR`` loads ``DIR/tokenizer.json`` (and the chat template and special
tokens of ``DIR/tokenizer_config.json``) and tokenizes exactly as vLLM does with that model
directory: prompts with ``add_special_tokens`` (default true), chats rendered by the jinja2
template and then tokenized without adding special tokens (the template writes them). The
router's ``tokenizer.mode: local`` can then be tested against a worker that tokenizes with the
same files, with nothing downloaded.

Same interface as :class:`simulator.tokenizer.Tokenizer`. Optional dependencies: ``tokenizers``
and ``jinja2`` (both in the ``test`` extra).
"""

from __future__ import annotations

import json
import os
from typing import Any

from simulator.tokenizer import ChatTemplateError, Tokenizer


class HFTokenizer:
    def __init__(self, path: str) -> None:
        from jinja2 import TemplateError
        from tokenizers import Tokenizer as _Tok

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        self.tok = _Tok.from_file(file)
        self.vocab_size = self.tok.get_vocab_size()
        self.special: dict[str, str] = {}
        self.template: Any = None
        self.source = ""
        self._template_error = TemplateError
        cfg_path = os.path.join(os.path.dirname(file), "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
            for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
                v = cfg.get(k)
                v = v.get("content") if isinstance(v, dict) else v
                if isinstance(v, str):
                    self.special[k] = v
            tmpl = cfg.get("chat_template")
            if isinstance(tmpl, str):
                self.source = tmpl
                self.template = _environment().from_string(tmpl)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def encode_keep_last(self, text: str, k: int) -> list[int]:
        """``text`` with special tokens, truncated to ``k`` tokens from the left as a Hugging
        Face tokenizer truncates: the text's tokens are cut, then the specials are added."""
        self.tok.enable_truncation(k, direction="left")
        try:
            ids: list[int] = self.tok.encode(text, add_special_tokens=True).ids
        finally:
            self.tok.no_truncation()
        return ids

    def decode(self, ids: list[int]) -> str:
        text: str = self.tok.decode(ids, skip_special_tokens=False)
        return text

    def token_strs(self, text: str) -> list[str]:
        strs: list[str] = self.tok.encode(text).tokens
        return strs

    def render_chat(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        if self.template is None:
            raise ChatTemplateError("this model has no chat template")
        if not isinstance(messages, list) or not messages:
            raise ChatTemplateError("'messages' must be a non-empty list")
        msgs = []
        for m in messages:
            content = Tokenizer._content(m)  # refuses a message that is not an object: a 400
            msgs.append({**m, "content": content})
        final = ""
        if continue_final_message:
            # transformers 5 (render_jinja_template): a tag after the final message, cut
            # there once rendered (less the whitespace the template trimmed before it).
            if add_generation_prompt:
                raise ChatTemplateError(
                    "continue_final_message and add_generation_prompt are not compatible"
                )
            if "content" not in self.source:
                raise ChatTemplateError("continue_final_message: the template reads no content")
            final = msgs[-1]["content"]
            msgs[-1] = {**msgs[-1], "content": final + _TAG}
        kwargs = dict(kwargs or {})
        try:
            text: str = self.template.render(
                **{
                    **self.special,
                    "tools": kwargs.pop("tools", None),
                    "documents": kwargs.pop("documents", None),
                    **kwargs,
                    "messages": msgs,
                    "add_generation_prompt": add_generation_prompt,
                }
            )
        except self._template_error as e:
            raise ChatTemplateError(str(e)) from None
        if continue_final_message:
            tag = _TAG.strip()
            if final.strip() not in text or tag not in text:
                raise ChatTemplateError("the final message does not appear in the chat")
            at = text.rindex(tag)
            text = text[:at] if text[at : at + len(_TAG)] == _TAG else text[:at].rstrip()
        return text

    def encode_chat(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt, continue_final_message, kwargs)
        return self.encode(text, add_special_tokens=False)


_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _environment() -> Any:
    """transformers' chat-template environment (``_compile_jinja_template``): a sandbox that
    trims blocks, loop controls, ``{% generation %}`` blocks (their body), ``raise_exception``,
    ``strftime_now`` and its ``tojson``."""
    import datetime

    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

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
    return env


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson`` for chat templates: the object's key order, the template's
    indent and separators."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(msg: str) -> None:
    raise ChatTemplateError(msg)
