"""Per-key limits: requests per minute and tokens per minute, as token buckets.

Keys and their limits come from ``server.api_keys_file`` (a mounted Secret), a YAML mapping::

    team-a-key: {rpm: 600, tpm: 2000000}
    team-b-key: {rpm: 60}
    batch-key: {}            # a valid key without limits

The file is read at start and again whenever its modification time changes (checked at most
every ``RELOAD_CHECK_S``), so keys are added, revoked and re-limited without a restart; a file
that fails to parse keeps the last good table and logs why. Its keys are accepted beside
``server.api_keys``.

A request spends one request token before routing and its prompt tokens once they are known
(after tokenization, before it is forwarded); its completion tokens are charged from the usage
the worker reports, so a key that overran its budget waits for the refill. A bucket holds one
minute of its limit (``server.rate_limit_period_s``) and refills continuously. Over a limit:
429 with ``Retry-After`` (seconds until the bucket holds what the request needs).

:class:`QuotaTable` keeps the buckets in this replica: with N replicas behind a balancer, each
enforces the full limit. :class:`Limits` is what the request path uses; with ``redis.url``
:class:`router.shared_quotas.RedisQuotas` implements it with buckets in Redis, so the replicas
together enforce one limit.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Protocol

import yaml

__all__ = ["KeyLimits", "Limits", "QuotaTable", "RateLimited"]

log = logging.getLogger("kvrouter.quotas")

RELOAD_CHECK_S = 2.0
"""How often at most the keys file's modification time is looked at."""


class RateLimited(Exception):
    def __init__(self, what: str, retry_after_s: float) -> None:
        super().__init__(what)
        self.what = what
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class KeyLimits:
    rpm: float | None = None
    tpm: float | None = None


class Limits(Protocol):
    """Per-key limits as the request path sees them; ``take_*`` raise :class:`RateLimited`."""

    def keys(self) -> dict[str, KeyLimits]: ...

    async def take_request(self, key: str | None) -> None: ...

    async def take_prompt(self, key: str | None, tokens: int) -> None: ...

    def charge_completion(self, key: str | None, tokens: int) -> None: ...

    async def close(self) -> None: ...


@dataclass(slots=True)
class _Bucket:
    per_minute: float
    level: float
    at: float
    period_s: float = 60.0

    def refill(self, now: float) -> None:
        gained = (now - self.at) * self.per_minute / self.period_s
        self.level = min(self.per_minute, self.level + gained)
        self.at = now

    def take(self, amount: float, now: float, what: str) -> None:
        """Spend ``amount`` now, or raise with the wait until it fits. A request larger than
        the whole minute's budget goes through once the bucket is full (it then owes the
        rest), so no prompt is refused forever."""
        self.refill(now)
        need = min(amount, self.per_minute)
        if self.level < need:
            raise RateLimited(what, (need - self.level) * self.period_s / self.per_minute)
        self.level -= amount

    def charge(self, amount: float, now: float) -> None:
        """Spend after the fact (completion tokens): the level may go below zero."""
        self.refill(now)
        self.level -= amount


class QuotaTable:
    def __init__(self, path: str | None, period_s: float = 60.0) -> None:
        self.path = path
        self.period_s = period_s
        self.limits: dict[str, KeyLimits] = {}
        self._mtime: float | None = None
        self._checked = 0.0
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}
        if path is not None:
            self._load(force=True)

    def keys(self) -> dict[str, KeyLimits]:
        """The keys file's keys and limits as last read (empty without a file); not copied:
        every request checks its key here."""
        if self.path is None:
            return self.limits
        self._maybe_reload()
        return self.limits

    async def take_request(self, key: str | None) -> None:
        self.admit(key)

    async def take_prompt(self, key: str | None, tokens: int) -> None:
        self.spend_prompt(key, tokens)

    async def close(self) -> None:
        return None

    def admit(self, key: str | None, now: float | None = None) -> None:
        """Spend one request of ``key``'s RPM. RateLimited when there is none left."""
        lim = self.limits_of(key)
        if lim is None or lim.rpm is None:
            return
        t = time.monotonic() if now is None else now
        self._bucket(self._requests, key, lim.rpm, t).take(1.0, t, "requests per minute")  # type: ignore[arg-type]

    def spend_prompt(self, key: str | None, tokens: int, now: float | None = None) -> None:
        """Spend ``tokens`` prompt tokens of ``key``'s TPM. RateLimited when they do not fit."""
        lim = self.limits_of(key)
        if lim is None or lim.tpm is None or tokens <= 0:
            return
        t = time.monotonic() if now is None else now
        self._bucket(self._tokens, key, lim.tpm, t).take(float(tokens), t, "tokens per minute")  # type: ignore[arg-type]

    def charge_completion(self, key: str | None, tokens: int, now: float | None = None) -> None:
        lim = self.limits_of(key)
        if lim is None or lim.tpm is None or tokens <= 0:
            return
        t = time.monotonic() if now is None else now
        self._bucket(self._tokens, key, lim.tpm, t).charge(float(tokens), t)  # type: ignore[arg-type]

    def limits_of(self, key: str | None) -> KeyLimits | None:
        """``key``'s limits (None: no such key, or no keys file)."""
        if key is None or self.path is None:
            return None
        self._maybe_reload()
        return self.limits.get(key)

    # ---------------------------------------------------------------- internals

    def _bucket(
        self, table: dict[str, _Bucket], key: str, per_minute: float, now: float
    ) -> _Bucket:
        b = table.get(key)
        if b is None or b.per_minute != per_minute:  # new key, or its limit changed
            b = table[key] = _Bucket(per_minute, per_minute, now, self.period_s)
        return b

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked >= RELOAD_CHECK_S:
            self._checked = now
            self._load(force=False)

    def _load(self, force: bool) -> None:
        assert self.path is not None
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError as exc:
            if force:
                raise ValueError(f"server.api_keys_file: cannot read it ({exc})") from None
            log.warning("keys file %s unreadable (%s): keeping the last table", self.path, exc)
            return
        if not force and mtime == self._mtime:
            return
        try:
            with open(self.path) as f:
                table = parse_keys(yaml.safe_load(f))
        except (OSError, ValueError, yaml.YAMLError) as exc:
            if force:
                raise ValueError(f"server.api_keys_file: {exc}") from None
            log.warning("keys file %s not reloaded (%s): keeping the last table", self.path, exc)
            return
        self._mtime = mtime
        if not force:
            log.info("keys file %s reloaded: %d keys", self.path, len(table))
        self.limits = table
        for buckets in (self._requests, self._tokens):
            for gone in [k for k in buckets if k not in table]:
                del buckets[gone]


def parse_keys(doc: object) -> dict[str, KeyLimits]:
    """The keys file's mapping, checked: every key a non-empty string, limits positive."""
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ValueError("must be a mapping of key -> {rpm, tpm}")
    out = {}
    for key, spec in doc.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"bad key {key!r}")
        spec = spec or {}
        if not isinstance(spec, dict) or set(spec) - {"rpm", "tpm"}:
            raise ValueError(f"key {key[:4]}...: limits are rpm and tpm only")
        vals = {}
        for name in ("rpm", "tpm"):
            v = spec.get(name)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, int | float) or not v > 0
            ):
                raise ValueError(f"key {key[:4]}...: {name} must be a positive number")
            vals[name] = None if v is None else float(v)
        out[key] = KeyLimits(**vals)
    return out


def retry_after(seconds: float) -> str:
    """A ``Retry-After`` value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
