"""Simulated vLLM worker for kvrouter tests and benchmarks (speaks only vLLM's formats).

Fast in-process mode (simulated clock, no sockets), used by ``bench/routing_bench.py``::

    from simulator.engine import EngineConfig
    from simulator.fleet import FastFleet

    cfg = EngineConfig(block_size=16, num_gpu_blocks=20000, groups="full",
                       prefill_tokens_per_s=20000, decode_s_per_token=0.02,
                       max_num_batched_tokens=8192, cpu_chunks=0)
    fleet = FastFleet(n_workers, cfg)  # optional: encoding="map"|"array", dp_size=1
    fleet.submit(worker_idx, request_id, token_ids, max_tokens, arrival_s, cache_salt=None)
    fleet.run_until(t_s)               # advance the simulated clock, running engine steps
    fleet.next_event_time() -> float   # next arrival / step start / step end (inf if idle)
    fleet.drain_events() -> list[(worker_idx, dp_rank, seq, payload_bytes)]  # publish order;
                                       # payload = exact vLLM msgpack KVEventBatch
    fleet.completed() -> list[CompletedRequest]  # request_id, worker_idx, arrival_s,
                                       # first_token_s, finish_s, prompt_tokens,
                                       # cached_tokens (GPU), cpu_loaded_tokens, output_tokens
    fleet.load(worker_idx) -> WorkerLoad(running, waiting, queued_prefill_tokens, kv_usage)

``fleet.rejected`` lists ids of future arrivals refused at admission (prompt larger than the
KV cache or queue full); ``submit`` raises ValueError for those when they arrive now.

Driver loop: ``while pending: t = min(next_arrival, fleet.next_event_time());
fleet.run_until(t); route/submit arrivals at t; feed fleet.drain_events() to the index``.
``drain_events``/``completed`` return what happened since the previous call.

Process mode: ``kvrouter-sim --workers N --base-port P ...`` (see ``simulator.cli``), and
``simulator.testing.running_fleet(n, **flags)`` to start it from tests.

Modules: ``hashing`` (vLLM block hashes), ``tokenizer`` (built-in tokenizer + chat
templates), ``block_pool`` (GPU pool + LRU), ``kv_cache`` (groups, hits, sparse retention),
``offload`` (CPU tier), ``engine`` (scheduler + timing), ``events`` (wire structs, both eras),
``publisher`` (ZMQ PUB + replay), ``runner`` (wall-clock driver), ``server`` (one worker:
engines, request parsing, generation), ``routes`` (its HTTP app), ``responses`` (completion
bodies and SSE chunks), ``metrics`` (``/metrics``), ``faults`` (``/sim/faults``),
``api_errors`` (error bodies), ``fleet`` (fast mode), ``cli``, ``testing``.
"""

from simulator.engine import EngineConfig, SimEngine
from simulator.fleet import CompletedRequest, FastFleet, WorkerLoad

__all__ = ["CompletedRequest", "EngineConfig", "FastFleet", "SimEngine", "WorkerLoad"]
