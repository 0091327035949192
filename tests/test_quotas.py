"""Per-key limits from a keys file: requests and tokens per minute trip with 429 and a
Retry-After, recover as the bucket refills, and follow the file when it changes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest
from test_router_support import config_for, serve_router, until, words

from router import quotas
from router.quotas import QuotaTable, RateLimited
from simulator.testing import running_fleet


def test_buckets_trip_and_refill(tmp_path: Path) -> None:
    f = tmp_path / "keys.yaml"
    f.write_text("k1: {rpm: 60, tpm: 600}\nk2: {}\n")
    q = QuotaTable(str(f))
    q.admit("k1", 0.0)
    for _ in range(59):
        q.admit("k1", 0.0)
    with pytest.raises(RateLimited) as exc:
        q.admit("k1", 0.0)
    assert 0.9 < exc.value.retry_after_s <= 1.0  # one request refills in a second
    q.admit("k1", 1.0)
    q.spend_prompt("k1", 500, 1.0)
    with pytest.raises(RateLimited):
        q.spend_prompt("k1", 200, 1.0)
    q.charge_completion("k1", 300, 1.0)  # owed: the level goes below zero
    with pytest.raises(RateLimited) as exc:
        q.spend_prompt("k1", 100, 2.0)
    assert exc.value.retry_after_s > 10
    q.spend_prompt("k1", 5000, 100.0)  # larger than a minute's budget: once the bucket is full
    for _ in range(100):
        q.admit("k2", 0.0)  # no limits
    with pytest.raises(ValueError, match="rpm"):
        quotas.parse_keys({"k": {"rpm": -1}})


async def test_a_key_trips_its_limit_recovers_and_follows_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quotas, "RELOAD_CHECK_S", 0.0)
    f = tmp_path / "keys.yaml"
    f.write_text("slow: {rpm: 120}\nbig: {}\n")
    with running_fleet(1, decode_ms=1, prefill_tps=400000) as ws:
        # 120 requests per 360 s: one back every 3 s, so a stall of the machine between two
        # requests (CI runners have stalled for 0.3 s and more) does not refill the bucket.
        cfg = config_for(ws, server={"api_keys_file": str(f), "rate_limit_period_s": 360.0})
        async with serve_router(cfg) as (base, _router), httpx.AsyncClient(timeout=30) as c:

            async def ask(key: str) -> httpx.Response:
                body = {"model": "sim-model", "prompt": words(10, key), "max_tokens": 1}
                return await c.post(
                    base + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}
                )

            assert (await ask("unknown")).status_code == 401
            listing = {"authorization": "Bearer slow"}
            assert (await c.get(base + "/v1/models", headers=listing)).status_code == 200
            assert (await c.get(base + "/v1/models")).status_code == 401
            # Asked faster than it refills, the bucket of 120 runs dry; a slow machine only
            # takes more requests to get there.
            codes = [(await ask("slow")).status_code]
            while codes[-1] != 429 and len(codes) < 1000:
                codes.append((await ask("slow")).status_code)
            assert codes[0] == 200 and codes[-1] == 429 and len(codes) > 120
            limited = await ask("slow")
            assert limited.status_code == 429
            assert limited.json()["error"]["type"] == "rate_limit_exceeded"
            wait = int(limited.headers["retry-after"])
            assert 1 <= wait <= 3
            # Served again within its Retry-After.
            t = time.monotonic()
            await until(lambda: _ok(ask("slow")), 10, "the limit to recover")
            assert time.monotonic() - t < wait + 0.5
            assert all([(await ask("big")).status_code == 200 for _ in range(20)])
            # Revoke "big", add "new": the file is followed without a restart.
            f.write_text("slow: {rpm: 120}\nnew: {}\n")
            os.utime(f, ns=(time.time_ns(), time.time_ns() + 10**9))
            await until(lambda: _ok(ask("new")), 5, "the new key accepted")
            assert (await ask("big")).status_code == 401


async def _ok(r: object) -> bool:
    return (await r).status_code == 200  # type: ignore[misc,attr-defined]
