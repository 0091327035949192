"""Deterministic built-in tokenizer and chat templates (no model files).

Pieces are words, punctuation marks and newlines; a piece keeps its leading space (shown
as "Ġ" in ``token_strs``, like byte-level BPE). A piece's id is a stable hash into the
vocabulary, so every process agrees. Special tokens use the ids of the captures'
tokenizer (``tokenize-llama-b32.json``): ``<s>``=2, ``<|system|>``=4, ``<|user|>``=5,
``<|assistant|>``=6, ``<|end|>``=7.

Templates:
- ``default``: ``<s><|role|>\\n{content}<|end|>\\n`` per message, then ``<|assistant|>\\n``
  (the captures' template).
- ``alt``: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` then ``<|im_start|>assistant\\n``
  (a worker that tokenizes chats differently, for misconfiguration tests).
"""

from __future__ import annotations

import re
from itertools import islice
from typing import Any

import xxhash

SPECIALS: dict[str, int] = {
    "<unk>": 0,
    "<pad>": 1,
    "<s>": 2,
    "</s>": 3,
    "<|system|>": 4,
    "<|user|>": 5,
    "<|assistant|>": 6,
    "<|end|>": 7,
    "<|im_start|>": 8,
    "<|im_end|>": 9,
    "<|tool|>": 10,
}
FIRST_REGULAR_ID = 100
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")
_PIECE_RE = re.compile(r"\n| ?[A-Za-z0-9_]+| ?[^\sA-Za-z0-9_]|[ \t\r\f\v]+")
# Words separated by single spaces: there ``_PIECE_RE`` yields exactly ``text.split(" ")`` with
# the space kept on every word but the first, which C-level str methods compute ~10x faster.
_SIMPLE_RE = re.compile(r"[A-Za-z0-9_]+(?: [A-Za-z0-9_]+)*")
_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "so", "ta", "vi", "ze", "po", "da", "fe"]


class ChatTemplateError(ValueError):
    pass


class Tokenizer:
    def __init__(
        self, vocab_size: int = 32000, template: str = "default", writes_effort: bool = False
    ) -> None:
        if template not in ("default", "alt"):
            raise ValueError("chat template must be 'default' or 'alt'")
        if vocab_size <= FIRST_REGULAR_ID + 1:
            raise ValueError("vocab too small")
        self.vocab_size = vocab_size
        self.template = template
        self.writes_effort = writes_effort
        """The template writes the ``reasoning_effort`` argument first, as GPT-OSS's does."""
        self._id_to_piece: dict[int, str] = {v: k for k, v in SPECIALS.items()}
        self._cache: dict[str, int] = {}

    def piece_id(self, piece: str) -> int:
        tid = self._cache.get(piece)
        if tid is None:
            span = self.vocab_size - FIRST_REGULAR_ID
            tid = FIRST_REGULAR_ID + xxhash.xxh64_intdigest(piece.encode()) % span
            if len(self._cache) < 1_000_000:  # bounded memo
                self._cache[piece] = tid
                self._id_to_piece.setdefault(tid, piece)
        return tid

    def pieces(self, text: str) -> list[str]:
        out: list[str] = []
        for part in _SPECIAL_RE.split(text):
            if not part:
                continue
            if part in SPECIALS:
                out.append(part)
            else:
                out.extend(_PIECE_RE.findall(part))
        return out

    def encode_keep_last(self, text: str, k: int) -> list[int]:
        """``text`` truncated to its last ``k`` tokens (this vocabulary adds no specials)."""
        ids = self.encode(text)
        return ids[len(ids) - k :] if k < len(ids) else ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Equal to [id of p for p in self.pieces(text)], by a faster route: prompts of tens of
        # thousands of tokens must tokenize in milliseconds, as vLLM's Rust tokenizers do.
        # ``add_special_tokens`` changes nothing: this vocabulary adds none to a prompt (the
        # captures' tokenizer does not either; chats get <s> from the template).
        if "<" not in text:
            return self._encode_plain(text)
        out: list[int] = []
        for part in _SPECIAL_RE.split(text):
            if not part:
                continue
            sid = SPECIALS.get(part)
            if sid is not None:
                out.append(sid)
            else:
                out.extend(self._encode_plain(part))
        return out

    def _encode_plain(self, text: str) -> list[int]:
        if _SIMPLE_RE.fullmatch(text):
            words = text.split(" ")
            pieces = [words[0], *map(" ".__add__, islice(words, 1, None))]
        else:
            pieces = _PIECE_RE.findall(text)
        ids = list(map(self._cache.get, pieces))
        if None in ids:
            piece_id = self.piece_id
            ids = [i if i is not None else piece_id(p) for i, p in zip(ids, pieces, strict=True)]
        return ids  # type: ignore[return-value]

    def token_strs(self, text: str) -> list[str]:
        return [
            p if p in SPECIALS else p.replace(" ", "\u0120").replace("\n", "\u010a")
            for p in self.pieces(text)
        ]

    def id_to_piece(self, tid: int) -> str:
        p = self._id_to_piece.get(tid)
        if p is not None:
            return p
        # A generated token never seen as input: a pronounceable fake word.
        n = tid
        word = ""
        for _ in range(2 + tid % 2):
            word += _SYLLABLES[n % len(_SYLLABLES)]
            n //= len(_SYLLABLES)
        return " " + word

    def decode(self, ids: list[int]) -> str:
        return "".join(self.id_to_piece(i) for i in ids)

    # ---- chat --------------------------------------------------------------------------------
    @staticmethod
    def _content(msg: Any) -> str:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ChatTemplateError("each message needs a string 'role'")
        c = msg.get("content")
        if c is None:
            return ""
        if isinstance(c, str):
            return c
        if isinstance(c, list):
            parts = []
            for p in c:
                if (
                    isinstance(p, dict)
                    and p.get("type") == "text"
                    and isinstance(p.get("text"), str)
                ):
                    parts.append(p["text"])
                else:
                    raise ChatTemplateError("only text content parts are supported")
            return "".join(parts)
        raise ChatTemplateError("message content must be a string or a list of parts")

    def render_chat(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The built-in template; of the template arguments it reads ``documents`` (a block
        before the messages), ``enable_thinking`` (false: an empty thinking block after the
        generation prompt, as Qwen3's template writes) and, with ``writes_effort``,
        ``reasoning_effort``; an assistant message's ``reasoning`` goes in a thinking block
        before its content."""
        kwargs = kwargs or {}
        if not isinstance(messages, list) or not messages:
            raise ChatTemplateError("'messages' must be a non-empty list")
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError(
                "cannot set both add_generation_prompt and continue_final_message"
            )
        out = [] if self.template == "alt" else ["<s>"]
        effort = kwargs.get("reasoning_effort")
        if self.writes_effort and isinstance(effort, str):
            out.append(f"Reasoning: {effort}\n")
        docs = kwargs.get("documents")
        if isinstance(docs, list) and docs:
            body = "\n".join(f"{d.get('title', '')}: {d.get('text', '')}" for d in docs
                              if isinstance(d, dict))  # fmt: skip
            out.append(f"<|documents|>\n{body}<|end|>\n")
        last = len(messages) - 1
        for i, m in enumerate(messages):
            content = self._content(m)
            role = m["role"]
            reasoning = m.get("reasoning")
            if role == "assistant" and isinstance(reasoning, str) and reasoning:
                content = f"<think>{reasoning}</think>{content}"
            close = not (continue_final_message and i == last)
            if self.template == "alt":
                out.append(f"<|im_start|>{role}\n{content}" + ("<|im_end|>\n" if close else ""))
            else:
                out.append(f"<|{role}|>\n{content}" + ("<|end|>\n" if close else ""))
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n" if self.template == "alt" else "<|assistant|>\n")
            if kwargs.get("enable_thinking") is False:
                out.append("<think>\n\n</think>\n\n")
        return "".join(out)

    def encode_chat(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        return self.encode(
            self.render_chat(messages, add_generation_prompt, continue_final_message, kwargs)
        )
