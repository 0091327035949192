"""Who the client is and what it may spend, for both front ends (HTTP proxy and EPP).

The API key comes from ``Authorization: Bearer <key>``; it is checked against
``server.api_keys`` and the keys file, and spends its per-key limits (router/quotas.py): one
request before routing, the prompt's tokens once they are known, the completion's tokens from
the usage the worker reports. Refusals are :class:`router.errors.BodyError` 401 / 429 (with
``Retry-After``), which each front end answers in its own way: the proxy as an HTTP response,
the EPP as an ext_proc ImmediateResponse with the same JSON.
"""

from __future__ import annotations

from router.errors import BodyError
from router.quotas import Limits, RateLimited, retry_after

__all__ = ["bearer", "check_key", "limited", "spend_prompt"]


def bearer(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header value (None for anything else)."""
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip()
    return None


async def check_key(
    key: str | None, keys: set[str], quotas: Limits | None = None, *, charge: bool = True
) -> str | None:
    """``key``, checked against ``server.api_keys`` and the keys file, and (with ``charge``)
    one request spent of its per-minute limit (BodyError 401 / 429)."""
    extra = quotas.keys() if quotas is not None else {}
    if (keys or extra) and key not in keys and key not in extra:
        raise BodyError(401, "invalid or missing API key (Authorization: Bearer <key>)")
    if quotas is not None and charge:
        try:
            await quotas.take_request(key)
        except RateLimited as exc:
            raise limited(exc) from None
    return key


def limited(exc: RateLimited) -> BodyError:
    """The 429 of a key over one of its limits, with the wait in ``Retry-After``."""
    err = BodyError(429, f"rate limit of this API key exceeded ({exc.what})", "rate_limit_exceeded")
    err.headers = {"retry-after": retry_after(exc.retry_after_s)}
    return err


async def spend_prompt(quotas: Limits, key: str | None, tokens: int | None) -> None:
    """Spend the prompt's ``tokens`` (None: the prompt was not tokenized, nothing to spend)
    of ``key``'s per-minute token limit (BodyError 429)."""
    if tokens is not None:
        try:
            await quotas.take_prompt(key, tokens)
        except RateLimited as exc:
            raise limited(exc) from None
