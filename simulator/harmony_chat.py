"""GPT-OSS chats as vLLM serves them: rendered in the harmony format (``--chat-format harmony``).

vLLM renders a ``gpt_oss`` model's chat completions in harmony, with the encoding's own o200k
vocabulary, while its ``/tokenize`` still applies the chat template. A simulated worker so
configured does the same: it writes the harmony text of the chat and encodes it with that
vocabulary (``oss-harmony``, where it is built in). The date is the worker's today unless
``VLLM_SYSTEM_START_DATE`` pins it, as in vLLM.

What it renders: the system message (model identity, knowledge cutoff, date, reasoning effort,
channels), a leading system or developer message as the developer message's instructions, user
turns, assistant answers (final channel) and reasoning (analysis channel, dropped before the
last final answer), later system or developer messages as developer messages. Tools and tool
calls are refused with a 400: their TypeScript-like schema is not written here.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

__all__ = ["HarmonyChat", "HarmonyChatError"]

_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
_CHANNELS = (
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
)
_EFFORTS = {"low", "medium", "high"}


class HarmonyChatError(ValueError):
    """A chat this renderer does not write (the worker answers 400)."""


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    raise HarmonyChatError("content must be a string or a list of parts")


def _message(role: str, text: str, channel: str | None = None) -> str:
    head = role if channel is None else f"{role}<|channel|>{channel}"
    return f"<|start|>{head}<|message|>{text}<|end|>"


class HarmonyChat:
    def __init__(self) -> None:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        self._enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)

    def render(self, data: dict[str, Any]) -> list[int]:
        msgs = data.get("messages")
        if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
            raise HarmonyChatError("messages must be a list of objects")
        if data.get("tools") or any(m.get("tool_calls") or m.get("role") == "tool" for m in msgs):
            raise HarmonyChatError("the simulator's harmony chats take no tools")
        effort = data.get("reasoning_effort") or "medium"
        if effort not in _EFFORTS:
            raise HarmonyChatError(f"Harmony does not support reasoning_effort={effort!r}")
        date = os.environ.get("VLLM_SYSTEM_START_DATE") or datetime.datetime.now().strftime(
            "%Y-%m-%d"
        )
        system = (
            f"{_IDENTITY}\nKnowledge cutoff: 2024-06\nCurrent date: {date}\n\n"
            f"Reasoning: {effort}\n\n{_CHANNELS}"
        )
        parts: list[tuple[str, str]] = [("system", _message("system", system))]
        if msgs and msgs[0].get("role") in ("system", "developer"):
            instructions = _text(msgs[0].get("content"))
            if instructions:
                parts.append(
                    ("developer", _message("developer", f"# Instructions\n\n{instructions}"))
                )
            msgs = msgs[1:]
        for m in msgs:
            role = m.get("role")
            if role == "assistant":
                # ``reasoning_content`` is the field's older name, which vLLM still reads.
                reasoning = m.get("reasoning")
                if reasoning is None:
                    reasoning = m.get("reasoning_content")
                if reasoning:
                    parts.append(("analysis", _message("assistant", str(reasoning), "analysis")))
                answer = _text(m.get("content"))
                if answer:
                    parts.append(("final", _message("assistant", answer, "final")))
            elif role in ("system", "developer"):
                parts.append(
                    (
                        "developer",
                        _message("developer", f"# Instructions\n\n{_text(m.get('content'))}"),
                    )
                )
            elif role == "user":
                parts.append(("user", _message("user", _text(m.get("content")))))
            else:
                raise HarmonyChatError(f"unknown role {role!r}")
        last_final = max((i for i, (kind, _) in enumerate(parts) if kind == "final"), default=-1)
        text = "".join(
            t for i, (kind, t) in enumerate(parts) if not (kind == "analysis" and i < last_final)
        )
        ids: list[int] = self._enc.encode(text + "<|start|>assistant", allowed_special="all")
        return ids
