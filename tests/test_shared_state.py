"""router.shared_state against a real redis-server: load sharing, TTL expiry, speculative
entries, snapshots with a leader lease, degradation when Redis dies, and reconnection."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import pytest
from redis_server import RedisServer, redis_server
from test_router_support import until

from indexer.index import EngineId
from router.load import EngineLoad
from router.shared_redis import _LoadMsg
from router.shared_state import (
    ExportedEngine,
    RedisSharedState,
    SharedState,
    engine_key,
    make_shared_state,
    parse_engine_key,
)

pytestmark = pytest.mark.timeout(60)

E0: EngineId = ("http://10.0.0.1:8000", 0)
E1: EngineId = ("http://10.0.0.2:8000", 1)


@pytest.fixture
def srv() -> Iterator[RedisServer]:
    with redis_server() as s:
        yield s


class Replica:
    """One RedisSharedState with a mutable local load table and recorded up/down calls."""

    def __init__(self, url: str, **kw: Any) -> None:
        self.loads: dict[EngineId, EngineLoad] = {}
        self.ups: list[bool] = []
        self.exports: dict[EngineId, ExportedEngine] = {}
        kw.setdefault("heartbeat_ttl_s", 2.0)
        kw.setdefault("snapshot_interval_s", 60.0)
        self.state = RedisSharedState(
            url,
            local_loads=lambda: self.loads,
            on_redis_up=self.ups.append,
            snapshot_engines=lambda: list(self.exports),
            export_engine=self.exports.get,
            **kw,
        )


@asynccontextmanager
async def replica(url: str, **kw: Any) -> AsyncIterator[Replica]:
    r = Replica(url, **kw)
    await r.state.start()
    try:
        yield r
    finally:
        await r.state.stop()


def test_engine_keys_round_trip() -> None:
    assert parse_engine_key(engine_key(("http://h:1", 3))) == ("http://h:1", 3)
    with pytest.raises(ValueError):
        parse_engine_key("no-rank")


async def test_embedded_state_is_local_only() -> None:
    ups: list[bool] = []
    st = make_shared_state(None, on_redis_up=ups.append, speculative_ttl_s=2.0)
    assert type(st) is SharedState
    await st.start()
    assert ups == [False] and not st.up
    assert st.remote_load(E0).inflight_requests == 0
    st.speculative.record(E0, [1, 2, 3], now=10.0)
    assert st.speculative.hit_tokens(E0, [1, 2, 3, 4], 16, now=10.5) == 48
    assert st.take_snapshot(E0) is None
    assert st.status()["backend"] == "memory"
    await st.stop()


async def test_load_is_shared_and_own_load_is_not_double_counted(srv: RedisServer) -> None:
    async with replica(srv.url) as a, replica(srv.url) as b:
        assert a.state.up and b.state.up and a.ups == [False, True]
        a.loads[E0] = EngineLoad(3, 1, 700)
        b.loads[E0] = EngineLoad(2, 2, 50)
        b.loads[E1] = EngineLoad(1, 0, 0)
        await until(lambda: b.state.remote_load(E0).inflight_requests == 3, 5, "b to see a's load")
        assert b.state.status()["other_replicas"] == [a.state.replica_id]
        r = b.state.remote_load(E0)
        assert (r.inflight_requests, r.prefilling_requests, r.queued_prefill_tokens) == (3, 1, 700)
        await until(
            lambda: a.state.remote_load(E1).inflight_requests == 1, 5, "a to see b's E1 load"
        )
        r = a.state.remote_load(E0)
        assert (r.inflight_requests, r.prefilling_requests, r.queued_prefill_tokens) == (
            2,
            2,
            50,
        )  # b only, not a
        # Load drains: the zero is propagated too.
        a.loads.clear()
        await until(lambda: b.state.remote_load(E0).inflight_requests == 0, 5, "a's load to drain")
        # A clean stop removes the contribution at once (no TTL wait).
        a.loads[E0] = EngineLoad(5, 0, 0)
        await until(lambda: b.state.remote_load(E0).inflight_requests == 5, 5)
    st = b.state.status()
    assert st["backend"] == "redis" and st["counters"]["load_refreshes"] > 0


async def test_a_change_is_published_at_once_not_at_the_next_refresh(srv: RedisServer) -> None:
    """With refreshes 30 s apart and the change announced (``loads_changed``, as the router's
    tickets do), the other replica hears a send and its end within a round trip of the push;
    a push older than what it heard is ignored, and a malformed one is dropped."""
    slow = {"refresh_interval_s": 30.0, "push_interval_s": 30.0, "heartbeat_ttl_s": 90.0}
    async with replica(srv.url, **slow) as a, replica(srv.url, **slow) as b:
        await until(lambda: a.state.counters["load_pushes"] > 0, 5, "a's first push")
        await until(
            lambda: (
                b.state.counters["load_refreshes"] > 0 and a.state.counters["load_refreshes"] > 0
            ),
            5,
            "the first refreshes",
        )
        a.loads[E0] = EngineLoad(1, 1, 8000)
        t0 = time.monotonic()
        a.state.loads_changed()
        await until(lambda: b.state.remote_load(E0).queued_prefill_tokens == 8000, 2, "the send")
        assert time.monotonic() - t0 < 1.0
        a.loads[E1] = EngineLoad(1, 1, 300)
        a.loads[E0] = EngineLoad(1, 0, 0)  # prefilled: tokens released, still decoding
        a.state.loads_changed()
        await until(lambda: b.state.remote_load(E1).queued_prefill_tokens == 300, 2, "E1")
        assert b.state.remote_load(E0).queued_prefill_tokens == 0
        assert b.state.remote_load(E0).inflight_requests == 1
        a.loads.clear()
        a.state.loads_changed()
        await until(lambda: not b.state.remote_loads(), 2, "a's load gone")
        assert b.state.counters["load_refreshes"] == 1  # nothing came by a refresh
        received = b.state.counters["load_received"]
        # An older push of a (a message delivered late) changes nothing.
        old = _LoadMsg(a.state.replica_id, a.state._push_n - 1, {engine_key(E0): "9,9,9"})
        b.state._on_load(msgspec.msgpack.encode(old))
        b.state._on_load(b"not msgpack at all")
        b.state._on_load(msgspec.msgpack.encode(["x", 1, {"no-engine-key": "1,1,1"}]))
        assert not b.state.remote_loads()
        assert b.state.counters["load_received"] == received


async def test_a_replica_restarted_under_its_id_is_heard_again(srv: RedisServer) -> None:
    """Pushes are numbered from the wall clock: a replica back under the same id (a pod's
    name) numbers its pushes after the ones heard before, so they are not taken as old."""
    async with replica(srv.url) as b:
        async with replica(srv.url, replica_id="pod-a") as a:
            a.loads[E0] = EngineLoad(2, 0, 0)
            a.state.loads_changed()
            await until(lambda: b.state.remote_load(E0).inflight_requests == 2, 5, "first life")
        async with replica(srv.url, replica_id="pod-a") as a2:
            a2.loads[E0] = EngineLoad(7, 0, 0)
            a2.state.loads_changed()
            await until(lambda: b.state.remote_load(E0).inflight_requests == 7, 5, "second life")


async def test_killed_replica_leaves_no_phantom_load_after_ttl(srv: RedisServer) -> None:
    ttl = 1.0
    async with replica(srv.url, heartbeat_ttl_s=ttl) as b:
        a = Replica(srv.url, heartbeat_ttl_s=ttl)
        await a.state.start()
        a.loads[E0] = EngineLoad(4, 4, 4000)
        await until(lambda: b.state.remote_load(E0).inflight_requests == 4, 5, "b to see a's load")
        # Crash: a's tasks stop without the clean goodbye (no DEL, no ZREM).
        for t in a.state._tasks:
            t.cancel()
        await asyncio.gather(*a.state._tasks, return_exceptions=True)
        killed = time.monotonic()
        await until(
            lambda: b.state.remote_load(E0).inflight_requests == 0, 5 * ttl, "TTL to expire it"
        )
        gone_after = time.monotonic() - killed
        assert gone_after <= ttl + 1.0, gone_after
        a.state._up = False  # skip the goodbye in stop(): it is dead
        await a.state.stop()


async def test_speculative_entries_reach_every_replica(srv: RedisServer) -> None:
    async with replica(srv.url, speculative_ttl_s=2.0) as a, replica(srv.url) as b:
        await until(lambda: b.state.counters.get("spec_received", 0) >= 0 and b.state.up, 5)
        keys = [11, 12, 13, 14]

        async def seen() -> bool:
            # Re-record until the listener is subscribed (pub/sub has no backlog).
            a.state.speculative.record(E1, keys, time.monotonic())
            await asyncio.sleep(0.05)
            return b.state.speculative.hit_tokens(E1, keys, 16, time.monotonic()) == 64

        await until(seen, 10, "b to hold a's speculative entry")
        # The entry expires with its TTL on b too, and b does not echo it back to a.
        assert a.state.counters["spec_received"] == 0
        later = time.monotonic() + 2.5
        assert b.state.speculative.hit_tokens(E1, keys, 16, later) == 0


async def test_redis_outage_degrades_then_recovers(srv: RedisServer) -> None:
    async with replica(srv.url) as a, replica(srv.url) as b:
        a.loads[E0] = EngineLoad(2, 0, 10)
        await until(lambda: b.state.remote_load(E0).inflight_requests == 2, 5)
        srv.kill()
        await until(lambda: not b.state.up, 5, "b to notice Redis is gone")
        await until(lambda: not a.state.up, 5, "a to notice Redis is gone")
        assert b.ups[-1] is False and b.ups.count(False) == 2  # start + one transition
        # Per-replica state now: the other replica's load is forgotten, calls stay cheap.
        assert b.state.remote_load(E0).inflight_requests == 0
        t = time.perf_counter()
        for _ in range(1000):
            b.state.speculative.record(E0, [1, 2], time.monotonic())
            b.state.remote_load(E0)
        assert time.perf_counter() - t < 0.5
        await asyncio.sleep(0.3)  # several failing probe rounds: still one transition logged
        assert b.state.counters["transitions_down"] == 1
        srv.restart()
        await until(lambda: a.state.up and b.state.up, 10, "both to reconnect")
        assert b.ups[-1] is True
        # The restarted Redis is empty: a's next push restores its load there.
        await until(lambda: b.state.remote_load(E0).inflight_requests == 2, 5, "load shared again")
        keys = [21, 22]

        async def seen() -> bool:
            a.state.speculative.record(E0, keys, time.monotonic())
            await asyncio.sleep(0.05)
            return b.state.speculative.hit_tokens(E0, keys, 16, time.monotonic()) == 32

        await until(seen, 10, "pub/sub to resubscribe after the restart")


async def test_unreachable_redis_at_start_is_bounded_and_reconnects() -> None:
    with redis_server() as srv:
        port_url = srv.url
        srv.kill()
        t = time.monotonic()
        async with replica(port_url, startup_timeout_s=1.0) as a:
            assert time.monotonic() - t < 2.0
            assert not a.state.up and a.ups == [False]
            assert a.state.status()["warm_start"]["warm"] is False
            srv.start()
            await until(lambda: a.state.up, 10, "reconnect after Redis comes up")
            assert a.ups == [False, True]


async def test_snapshots_one_leader_and_a_late_replica_loads_them(srv: RedisServer) -> None:
    async with (
        replica(srv.url, snapshot_interval_s=0.2) as a,
        replica(srv.url, snapshot_interval_s=0.2) as b,
    ):
        for r in (a, b):
            r.exports[E0] = (b"snapshot-of-e0-" + r.state.replica_id.encode(), 41, 7, 1234.5)
            r.exports[E1] = (b"snapshot-of-e1", 9, 3, None)
        await until(
            lambda: (
                a.state.counters["snapshots_written"] + b.state.counters["snapshots_written"] >= 4
            ),
            10,
            "snapshots to be written",
        )
        assert a.state.leader != b.state.leader  # exactly one holds the lease
        leader = a if a.state.leader else b
        async with replica(srv.url) as late:
            s0 = late.state.take_snapshot(E0)
            assert s0 is not None and s0.seq == 41 and s0.blocks == 7 and s0.event_ts == 1234.5
            assert s0.data == b"snapshot-of-e0-" + leader.state.replica_id.encode()
            assert s0.writer == leader.state.replica_id
            assert time.time() - s0.written_at < 5
            assert late.state.take_snapshot(E0) is None  # handed out once
            assert late.state.warm.snapshots_found == 2
        # The leader stops: the other replica takes the lease over and keeps writing.
        other = b if leader is a else a
        await leader.state.stop()
        before = other.state.counters["snapshots_written"]
        await until(
            lambda: other.state.leader and other.state.counters["snapshots_written"] > before,
            10,
            "the other replica to take the lease",
        )
        await leader.state.start()  # let the context manager's stop() run normally


def test_a_longer_remote_ttl_retires_no_local_record_early() -> None:
    s = SharedState(speculative_ttl_s=2.0)
    cache = s.speculative
    cache.record(E0, [1, 2, 3], 0.0)
    cache.record_remote(E1, [7, 8], 1.0, 10.0)  # another replica's 10 s record, at t = 1
    assert cache.hit_tokens(E0, [1, 2, 3], 16, 1.5) == 48, "the local record was retired early"
    assert cache.hit_tokens(E1, [7, 8], 16, 10.5) == 32
    cache.expire(2.5)
    assert len(cache) == 2 and cache.hit_tokens(E0, [1, 2, 3], 16, 2.5) == 0


def test_records_expire_in_time_order_whatever_their_ttl() -> None:
    cache = SharedState(speculative_ttl_s=2.0).speculative
    cache.record(E0, [1, 2], 0.0)  # until 2.0
    cache.record_remote(E1, [5, 6, 7], 0.1, 0.5)  # until 0.6, recorded after
    cache.expire(0.7)
    assert len(cache) == 2, "the shorter record was not retired in its turn"
    # A shorter record never shortens a key a longer one holds.
    cache.record_remote(E0, [1, 2], 0.8, 0.5)
    assert cache.hit_tokens(E0, [1, 2], 16, 1.9) == 32
    cache.expire(2.1)
    assert len(cache) == 0


def test_a_sampled_remote_record_covers_its_prefix_at_the_stride() -> None:
    from router.policy import SAMPLE_STRIDE
    from router.shared_redis import sampled_keys

    keys = list(range(1000, 1000 + 512))  # an 8k-token prompt's chained keys
    sent = sampled_keys(keys, 2048)
    assert len(sent) == 512 // SAMPLE_STRIDE and sent[-1] == keys[-1]
    odd = keys[:300]
    assert sampled_keys(odd, 2048)[-1] == odd[-1] and len(sampled_keys(odd, 2048)) == 19
    cache = SharedState(speculative_ttl_s=2.0).speculative
    cache.record_remote(E1, sent, 0.0, 2.0)
    assert cache.hit_tokens(E1, keys, 16, 1.0) == 512 * 16  # the same prompt: all of it
    sibling = keys[:200] + [1] * 312  # shares 200 keys: found at the stride below
    assert cache.hit_tokens(E1, sibling, 16, 1.0) == 192 * 16
    cache.record_remote(E0, sampled_keys(odd, 2048), 0.0, 2.0)
    longer = [*odd, 2, 3, 4]  # the next turn of the 300-key conversation: its whole prefix
    assert cache.hit_tokens(E0, longer, 16, 1.0) == 300 * 16


async def test_one_slow_call_does_not_mark_redis_down(srv: RedisServer) -> None:
    async with replica(srv.url) as a:
        await until(lambda: a.state.up, 5, "redis up")
        for _ in range(a.state.down_after_failures - 1):
            with pytest.raises(TimeoutError):
                await a.state._call(asyncio.sleep(1), timeout=0.01)
        assert a.state.up and a.ups == [False, True], "one slow call flipped the shared state"
        await a.state._call(a.state._client.ping())  # a success resets the count
        for _ in range(a.state.down_after_failures):
            with pytest.raises(TimeoutError):
                await a.state._call(asyncio.sleep(1), timeout=0.01)
        assert not a.state.up and a.ups[-1] is False


async def test_speculative_bytes_per_routed_8k_prompt(srv: RedisServer) -> None:
    async with replica(srv.url) as a:
        await until(lambda: a.state.up, 5, "redis up")
        a.state.speculative.record(E0, list(range(2**62, 2**62 + 512)), time.monotonic())
        per_request = a.state.counters["spec_published_bytes"]
        assert 0 < per_request < 400, per_request  # 33 keys; all 512 were ~4.7 KB
