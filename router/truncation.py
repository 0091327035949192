"""Which of a prompt's tokens vLLM prefills when the request asks it to truncate the prompt.

vLLM's ``truncate_prompt_tokens`` (completions and chat) keeps ``k`` tokens of the prompt: the
last ``k`` (``truncation_side`` "left", the default of generative models) or the first ``k``
("right"). What the worker caches and reports is that window, so the router matches, credits
and verifies the window, not the prompt it tokenized.

The window is known exactly when vLLM slices a token list (vLLM 0.32 ``TokenizeParams``):

* the prompt fits (``n <= k``): nothing is cut;
* token-id prompts, and any prompt with an explicit ``truncation_side``: the full tokens, sliced;
* text tokenized without special tokens (chat's default, or ``add_special_tokens: false``): the
  tokenizer truncates the same tokens from the same side, which is the same slice.

It is not known for a text prompt tokenized *with* special tokens and no explicit side: the
tokenizer truncates the text's tokens and then adds its specials (a BOS stays first), which
depends on the tokenizer's post-processor. Nor for ``-1`` (the model's context less one
token: a prompt that fits is uncut, one that does not is cut to a length the router does not
know), ``0``, or a value vLLM refuses. Such requests are matched as they are but not checked
against the worker's report, or routed by load (:func:`prefilled_window` says which).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Window", "prefilled_window"]


class Window:
    """The prefilled tokens ``[start, stop)`` of an ``n``-token prompt, and whether the worker's
    ``cached_tokens`` for it can be checked against a prediction made on them."""

    __slots__ = ("start", "stop", "verifiable")

    def __init__(self, start: int, stop: int, *, verifiable: bool = True) -> None:
        self.start, self.stop, self.verifiable = start, stop, verifiable

    def whole(self, n: int) -> bool:
        return self.start == 0 and self.stop == n


def prefilled_window(body: dict[str, Any], n: int, *, text_with_specials: bool) -> Window | str:
    """The window of the ``n`` prompt tokens the router has for ``body`` that vLLM prefills,
    or why it cannot be known (the request is then routed by load and not verified).

    ``text_with_specials``: the tokens come from text tokenized with ``add_special_tokens``."""
    k = body.get("truncate_prompt_tokens")
    if k is None:
        return Window(0, n)
    side = body.get("truncation_side")
    if type(k) is not int or k < -1 or side not in (None, "left", "right"):
        return "truncate_prompt_tokens / truncation_side not as vLLM takes them: routed by load"
    if k == -1:
        # Cut only past the model's context, which vLLM would refuse without -1.
        return Window(0, n, verifiable=False)
    if n <= k:
        return Window(0, n)
    if k == 0:
        return "truncate_prompt_tokens=0 leaves no prompt: routed by load"
    if text_with_specials and side is None:
        return (
            f"truncate_prompt_tokens={k} on text with special tokens: the tokenizer decides "
            "which tokens stay: routed by load"
        )
    return Window(0, k) if side == "right" else Window(n - k, n)
