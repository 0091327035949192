"""The bodies of vLLM's completion answers: the JSON of a whole completion and the SSE chunks
of a streamed one, for ``/v1/completions`` and ``/v1/chat/completions``."""

from __future__ import annotations

import json
import time
from typing import Any

SSE_DONE = b"data: [DONE]\n\n"


def usage(prompt: int, completion: int, cached: int, details: bool = True) -> dict[str, Any]:
    """``details=False``: vLLM without ``--enable-prompt-tokens-details`` (null details)."""
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached} if details else None,
    }


def completion_body(
    rid: str, model: str, chat: bool, texts: list[str], usage: dict[str, Any], finish: str
) -> dict[str, Any]:
    """A whole (non-streamed) completion: one choice per text (``n``)."""
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_choice(i, chat, text, finish) for i, text in enumerate(texts)],
        "usage": usage,
    }


def _choice(index: int, chat: bool, text: str, finish: str) -> dict[str, Any]:
    if chat:
        return {
            "index": index,
            "message": {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "tool_calls": [],
            },
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "prompt_logprobs": None,
    }


class ChunkWriter:
    """The SSE chunks of one streamed completion (same id, object and ``created`` in each)."""

    def __init__(self, rid: str, model: str, chat: bool) -> None:
        self.rid, self.model, self.chat = rid, model, chat
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.created = int(time.time())

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        d: dict[str, Any] = {
            "id": self.rid,
            "object": self.obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            d["usage"] = usage
        return b"data: " + json.dumps(d, separators=(",", ":")).encode() + b"\n\n"

    def role(self, index: int = 0) -> bytes:
        """A chat stream's first chunk of a choice: the assistant role, no text yet."""
        return self.chunk(
            [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )

    def token(self, text: str, finish: str | None, index: int = 0) -> bytes:
        choice: dict[str, Any]
        if self.chat:
            choice = {
                "index": index,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
        else:
            choice = {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
        return self.chunk([choice])
