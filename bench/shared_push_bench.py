"""What publishing every load change costs: two replicas' shared state on a real Redis.

    python bench/shared_push_bench.py            # 5 s per mode, 1,000 changes/s, 16 engines

Replica A's own load changes ``--rate`` times a second (a send, a released prefill or an
answer's end each make one: three per request), over ``--engines`` engines, for ``--secs``
seconds; replica B listens. Two modes, side by side in one run: ``announced`` (every change
wakes A's push, as ``proxy.Ticket`` does through ``SharedState.loads_changed``) and
``unannounced`` (only the push task's own check every ``push_interval_s``). The LAST line is
one JSON object per mode: changes/s reached, A's pushes/s, pushes/s B heard on the channel,
and the process's CPU (both replicas and the driver share one event loop) in % of a core.
Needs ``redis-server`` on PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from indexer.index import EngineId
from router.load import EngineLoad
from router.shared_redis import RedisSharedState
from simulator.testing import find_port_block


async def run(url: str, announced: bool, rate: float, secs: float, engines: int) -> dict[str, Any]:
    mine: dict[EngineId, EngineLoad] = {}
    a = RedisSharedState(url, local_loads=lambda: mine)
    b = RedisSharedState(url, local_loads=dict)
    await a.start()
    await b.start()
    try:
        await asyncio.sleep(0.5)  # both up, first pushes and refreshes done
        pushes, heard = a.counters["load_pushes"], b.counters["load_received"]
        cpu0, t0, k = time.process_time(), time.monotonic(), 0
        while time.monotonic() - t0 < secs:
            k += 1
            mine[(f"http://w{k % engines}", 0)] = EngineLoad(k % 7 + 1, k % 3, 100 * (k % 11))
            if announced:
                a.loads_changed()
            await asyncio.sleep(1.0 / rate)
        dt = time.monotonic() - t0
        return {
            "changes_per_s": round(k / dt),
            "pushes_per_s": round((a.counters["load_pushes"] - pushes) / dt),
            "heard_per_s": round((b.counters["load_received"] - heard) / dt),
            "cpu_pct_of_core": round((time.process_time() - cpu0) / dt * 100, 1),
        }
    finally:
        await a.stop()
        await b.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=1000.0, help="load changes per second")
    ap.add_argument("--secs", type=float, default=5.0)
    ap.add_argument("--engines", type=int, default=16)
    args = ap.parse_args()
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found on PATH (apt-get install -y redis-server)")
    port = find_port_block(1)
    redis = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        out = {
            mode: asyncio.run(
                run(
                    f"redis://127.0.0.1:{port}/0",
                    mode == "announced",
                    args.rate,
                    args.secs,
                    args.engines,
                )
            )
            for mode in ("unannounced", "announced")
        }
    finally:
        redis.terminate()
        redis.wait(10)
    print(json.dumps({"rate": args.rate, "engines": args.engines, **out}))


if __name__ == "__main__":
    main()
