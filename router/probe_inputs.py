"""The fixed inputs the self-check and ``kvrouter doctor`` send every worker.

Fixed, so that workers' answers compare across the fleet and between the two tools: a prompt
with punctuation, digits and non-ASCII text (tokenizers differ there first), a two-message
chat, and one function tool for the chat with ``tool_choice: "none"``."""

from __future__ import annotations

from typing import Any

__all__ = ["CHAT", "PROMPT", "TOOL", "tools_verdict"]

PROMPT = "Hello, world! The quick brown fox: 123 \u00fc \u2713"
CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
]
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def tools_verdict(prompt_tokens: int | None, with_tools: int, without: int) -> str | None:
    """What the worker did with :data:`TOOL` in the chat sent with ``tool_choice: "none"``
    (``prompt_tokens``), given the chat's length rendered with and without it: ``kept``,
    ``dropped`` (vLLM's ``--exclude-tools-when-tool-choice-none``), or None when the count
    tells nothing (the template renders no tools, or the count is neither)."""
    if with_tools == without or prompt_tokens not in (with_tools, without):
        return None
    return "kept" if prompt_tokens == with_tools else "dropped"
