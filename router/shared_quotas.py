"""Per-key limits shared between router replicas: token buckets in Redis.

:class:`RedisQuotas` enforces the keys file's rpm / tpm limits (router/quotas.py) with one
bucket per key and limit in Redis, so N replicas behind a balancer together admit what one
limit allows, not N times it. The keys file itself is still read by every replica.

* **Atomic refill-and-take.** One Lua script (``EVALSHA``) refills the bucket for the time since
  it was last touched, then takes the amount or answers how long until it fits, in one step no
  other replica can interleave with. Buckets are hashes ``<prefix>:limit:<sha256(key)>:rpm`` /
  ``:tpm`` ``{level, at, rate}`` (the key is hashed: API keys are secrets, and Redis key names
  are listed by ``SCAN``), expiring once they would be full again (a missing bucket is full).
* **Redis's clock.** The script reads ``TIME``: every replica's refill is measured on one
  clock, so skew between the replicas' clocks cannot mint or withhold tokens (client-supplied
  time would need the hosts synchronised to well under the refill interval). Scripts that read
  ``TIME`` and write are replicated by effects, Redis's default since 5.0.
* **On the request path, by necessity.** Enforcing one limit across replicas means asking the
  one place that holds it: a request of a key with limits waits for one script call (a round
  trip, bounded like every ordinary Redis call: 200 ms), once for its request and once for its
  prompt tokens. Keys without limits never touch Redis. Completion tokens are charged after the
  response by a background task.
* **Redis down.** While ``RedisSharedState.up`` is false, or when a call fails, the replica's
  own buckets (:class:`router.quotas.QuotaTable`) decide: the limit then holds per replica,
  and each fallback is counted (``kvrouter_redis_fallbacks_total{state="limits"}``).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from typing import Any

from router.quotas import KeyLimits, Limits, QuotaTable, RateLimited
from router.shared_redis import cancel_tasks
from router.shared_state import RedisSharedState, SharedState

__all__ = ["RedisQuotas", "shared_quotas"]

_BUCKET_LUA = """
local rate = tonumber(ARGV[1])
local amount = tonumber(ARGV[2])
local period = tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local b = redis.call('HMGET', KEYS[1], 'level', 'at', 'rate')
local level = tonumber(b[1])
local at = tonumber(b[2])
if level == nil or at == nil or tonumber(b[3]) ~= rate then
  level = rate
  at = now
end
if now > at then
  level = math.min(rate, level + (now - at) * rate / period)
end
if ARGV[3] == 'take' then
  local need = math.min(amount, rate)
  if level < need then
    return {0, tostring((need - level) * period / rate)}
  end
end
level = level - amount
redis.call('HSET', KEYS[1], 'level', tostring(level), 'at', tostring(now), 'rate', ARGV[1])
redis.call('PEXPIRE', KEYS[1], math.ceil((rate - level) * period * 1000 / rate) + 1000)
return {1, '0'}
"""
"""ARGV: rate (per period), amount, ``take`` (refuse what does not fit; a request larger than
the whole bucket fits once it is full, as in router/quotas.py) or ``charge`` (spend after the
fact, the level may go below zero), period in seconds. Returns {1, '0'} or {0, wait seconds}
(a string: Lua numbers returned to Redis are cut to integers)."""


class RedisQuotas:
    """:class:`router.quotas.Limits` with the buckets in Redis (module docstring)."""

    def __init__(
        self,
        local: QuotaTable,
        shared: RedisSharedState,
        on_fallback: Callable[[], None] | None = None,
    ) -> None:
        self.local = local
        self.shared = shared
        self.on_fallback = on_fallback
        self.prefix = f"{shared.prefix}:limit:"
        self._script: Any = None
        self._charges: set[asyncio.Task[None]] = set()
        self.counters = {"checks": 0, "refused": 0, "charges": 0, "fallbacks": 0}

    def keys(self) -> dict[str, KeyLimits]:
        return self.local.keys()

    async def take_request(self, key: str | None) -> None:
        lim = self.local.limits_of(key)
        if key is None or lim is None or lim.rpm is None:
            return
        if not await self._take(key, "rpm", lim.rpm, 1.0, "requests per minute"):
            self.local.admit(key)

    async def take_prompt(self, key: str | None, tokens: int) -> None:
        lim = self.local.limits_of(key)
        if key is None or lim is None or lim.tpm is None or tokens <= 0:
            return
        if not await self._take(key, "tpm", lim.tpm, float(tokens), "tokens per minute"):
            self.local.spend_prompt(key, tokens)

    def charge_completion(self, key: str | None, tokens: int) -> None:
        lim = self.local.limits_of(key)
        if key is None or lim is None or lim.tpm is None or tokens <= 0:
            return
        task = asyncio.get_running_loop().create_task(self._charge(key, lim.tpm, tokens))
        self._charges.add(task)
        task.add_done_callback(self._charges.discard)

    async def close(self) -> None:
        """Let pending completion charges finish (bounded), then drop the rest."""
        if self._charges:
            await asyncio.wait(set(self._charges), timeout=self.shared.op_timeout_s * 3)
        await cancel_tasks(list(self._charges))

    # ---------------------------------------------------------------- internals

    async def _take(self, key: str, kind: str, rate: float, amount: float, what: str) -> bool:
        """True: Redis took it (RateLimited when it does not fit). False: Redis could not be
        asked, the caller takes it from the local bucket."""
        got = await self._run(key, kind, rate, amount, "take")
        if got is None:
            return False
        self.counters["checks"] += 1
        ok, wait = got
        if not ok:
            self.counters["refused"] += 1
            raise RateLimited(what, wait)
        return True

    async def _charge(self, key: str, rate: float, tokens: int) -> None:
        if await self._run(key, "tpm", rate, float(tokens), "charge") is None:
            self.local.charge_completion(key, tokens)
        else:
            self.counters["charges"] += 1

    async def _run(
        self, key: str, kind: str, rate: float, amount: float, mode: str
    ) -> tuple[bool, float] | None:
        if not self.shared.up:
            self._fell_back()
            return None
        if self._script is None:
            self._script = self.shared.client.register_script(_BUCKET_LUA)
        bucket = f"{self.prefix}{hashlib.sha256(key.encode()).hexdigest()[:32]}:{kind}"
        args = [rate, amount, mode, self.local.period_s]
        try:
            ok, wait = await self.shared.call(self._script(keys=[bucket], args=args))
        except asyncio.CancelledError:
            raise
        except Exception:
            self._fell_back()
            return None
        return bool(ok), float(wait)

    def _fell_back(self) -> None:
        self.counters["fallbacks"] += 1
        if self.on_fallback is not None:
            self.on_fallback()


def shared_quotas(
    local: QuotaTable, shared: SharedState, on_fallback: Callable[[], None] | None = None
) -> Limits:
    """The limits the request path uses: buckets in Redis with ``redis.url``, else ``local``."""
    if isinstance(shared, RedisSharedState):
        return RedisQuotas(local, shared, on_fallback)
    return local
