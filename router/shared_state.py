"""State several router replicas share: in-flight load, speculative entries, index snapshots.

Two implementations, one interface:

* :class:`SharedState` (``router.shared_local``): embedded, in memory (the default without
  ``redis.url``): a single replica's own view. Nothing leaves the process.
* :class:`RedisSharedState` (``router.shared_redis``): the same plus Redis, so every replica
  routes as if one router decided. Nothing here is on the request path: requests read and write
  local structures only, background tasks move data to and from Redis. (Session bindings and
  per-key limits, router/shared_sessions.py and shared_quotas.py, say when they ask Redis.)

**In-flight load.** Each replica owns one hash ``<prefix>:load:<replica>`` (field: engine
``url#rank``; value ``requests,prefilling,prefill_tokens``, absolute, not deltas, so a lost
write heals itself on the next one; field ``_n``: the number of the push that wrote it) with a
TTL of ``heartbeat_ttl_s``. Every change of the replica's own load (a send, a prefill released,
an answer's end: ``loads_changed``) wakes a push task, which rewrites the hash and publishes the
engines whose record changed since its last push on the channel ``<prefix>:loads`` (msgpack
``[replica, n, {url#rank: value}]``, ``0,0,0`` for an engine left idle) in one MULTI; it pushes
at most every ``push_min_interval_s`` (5 ms: a burst of sends is one push), looks for an
unannounced change every ``push_interval_s`` (50 ms), and rewrites the hash at least every
``heartbeat_ttl_s / 3`` (heartbeat). Every other replica applies a published push at once, so
another replica's send is seen one round trip after it is made: a burst of requests spread over
the replicas does not land on the engines that looked emptiest to all of them, and a short
prefill's release is seen before the next request (the routing bench's ``--replicas``;
docs/benchmarks.md has the figures). A refresh task reads every live replica's hash every
``refresh_interval_s`` (100 ms) and takes it as that replica's load unless a push published
after it was already heard (``_n``), which heals whatever pub/sub lost; the router adds the
others' sum to its own exact local accounting. Replicas are enumerated through the ZSET
``<prefix>:replicas``, but a contribution counts only while its hash exists: a replica that
dies stops refreshing it and Redis expires it after at most ``heartbeat_ttl_s``, so no phantom
load survives it. Staleness of another replica's load as seen here: one round trip through
Redis after the push (at most ``push_min_interval_s`` after the change); with its message lost,
``push_interval_s + refresh_interval_s + 2 RTT`` (about 160 ms with defaults on a LAN); one's
own load is always exact. Bounds: one push per ``push_min_interval_s`` per replica, each
message at most one record per engine of that replica.

**Speculative entries.** :class:`SharedSpeculativeCache` is the policy's
:class:`SpeculativeCache` whose ``record`` also queues the entry for publication on the
channel ``<prefix>:spec`` (msgpack ``[replica, url, rank, ttl_ms, keys]``, at most
``max_spec_keys`` chained content keys = the prompt's first ``max_spec_keys * unit`` tokens).
Every other replica records it locally with its own clock (no clock skew; the TTL runs from
receipt, so it may outlive the origin by the delivery latency, about one RTT). Pub/sub is
fire-and-forget: a replica that is disconnected misses entries, which only costs herding
protection for ``speculative_ttl_s``. The publish queue is bounded (``max_spec_queue``).

**Index snapshots.** One replica at a time holds the lease ``<prefix>:snapshot:leader``
(``SET NX PX``, renewed by compare-and-PEXPIRE) and every ``snapshot_interval_s`` writes each
engine whose index is exact (not degraded, not replaying, seq known) as a hash
``<prefix>:snap:<url#rank>`` ``{data, seq, ts, blocks, writer, event_ts}`` (``data`` =
``PrefixIndex.export_engine_chunks``, whose cut is taken in the same synchronous step as
``seq`` = the subscriber's ``last_seq``, then encoded a slice per loop turn while events keep
being applied) and indexes it in the ZSET ``<prefix>:snaps``. An engine whose ``(seq,
event_ts)`` is the one last written is only re-confirmed (``ts``); a restarted engine can reach
the same seq again, with another batch timestamp. A starting replica loads all
of them in :meth:`start` (bounded by ``startup_timeout_s``); the router imports an engine's
snapshot right before subscribing to it and starts its event source at ``seq`` (see
:func:`seed_subscriber`), so only later batches are replayed.

**Degradation.** Every Redis call is bounded (``op_timeout_s``, 100 ms, also enforced with
``asyncio.wait_for``; snapshot transfers get ``snapshot_timeout_s``). The first failure marks
Redis down: one log line, ``on_redis_up(False)`` (the ``kvrouter_redis_up`` gauge), the other
replicas' loads are forgotten (per-replica state, as without Redis). A probe task PINGs with
exponential backoff (0.1 s to 2 s); the first answer marks it up again (one log line), pushes
this replica's load at once and resumes. The pub/sub listener reconnects on its own.

**Keys.** All keys start with ``key_prefix`` (default ``{kvrouter}``): the braces are a Redis
Cluster hash tag, so every key is in one slot and multi-key pipelines/transactions are legal.
"""

from __future__ import annotations

from typing import Any

from router.shared_local import (
    ExportedEngine,
    SharedSpeculativeCache,
    SharedState,
    Snapshot,
    WarmStart,
    engine_key,
    parse_engine_key,
    seed_subscriber,
)
from router.shared_redis import RedisSharedState

__all__ = [
    "ExportedEngine",
    "RedisSharedState",
    "SharedSpeculativeCache",
    "SharedState",
    "Snapshot",
    "WarmStart",
    "engine_key",
    "make_shared_state",
    "parse_engine_key",
    "seed_subscriber",
]


def make_shared_state(
    redis_url: str | None,
    *,
    key_prefix: str = "{kvrouter}",
    heartbeat_ttl_s: float = 10.0,
    snapshot_interval_s: float = 30.0,
    op_timeout_s: float = 0.1,
    **kw: Any,
) -> SharedState:
    """:class:`RedisSharedState` when ``redis_url`` is set, else the embedded one."""
    if redis_url:
        return RedisSharedState(
            redis_url,
            key_prefix=key_prefix,
            heartbeat_ttl_s=heartbeat_ttl_s,
            snapshot_interval_s=snapshot_interval_s,
            op_timeout_s=op_timeout_s,
            **kw,
        )
    return SharedState(**kw)
