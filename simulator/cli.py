"""``kvrouter-sim``: run N simulated vLLM workers in one process.

Worker i serves HTTP on ``base_port + i``. Its DP rank r publishes events on
``event_base_port + i*dp_size + r`` and serves replay on ``replay_base_port + i*dp_size + r``
(so rank r is on "port + r", as vLLM's ``offset_endpoint_port``). ``GET /kv_event_sources``
reports them as vLLM does (``tcp://*:PORT``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import uvicorn

from simulator.engine import EngineConfig
from simulator.events import ENCODINGS
from simulator.kv_cache import parse_groups
from simulator.lora import LoraSettings
from simulator.server import Worker, WorkerSettings


def _retention(v: str) -> int | None:
    if v.lower() == "none":
        return None
    n = int(v)
    if n < 0:
        raise argparse.ArgumentTypeError("retention interval must be >= 0 or 'none'")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvrouter-sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_fleet_args(p.add_argument)
    _add_kv_cache_args(p.add_argument)
    _add_timing_and_offload_args(p.add_argument)
    _add_event_args(p.add_argument)
    _add_request_args(p.add_argument)
    _add_lora_args(p.add_argument)
    return p


def _add_fleet_args(a: Callable[..., Any]) -> None:
    a("--workers", type=int, default=1)
    a("--host", default="127.0.0.1", help="HTTP bind host")
    a("--base-port", type=int, default=8100, help="worker i: HTTP port base+i")
    a("--event-base-port", type=int, default=None, help="default base-port+1000")
    a("--replay-base-port", type=int, default=None, help="default base-port+2000")
    a("--dp-size", type=int, default=1)
    a("--model", default="sim-model")
    a("--lora", action="append", default=[], help="declare a LoRA adapter name (repeatable)")


def _lora_module(v: str) -> tuple[str, str]:
    name, sep, path = v.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {v!r}")
    return name, path


def _add_lora_args(a: Callable[..., Any]) -> None:
    a("--enable-lora", action="store_true", help="serve LoRA adapters (implied by the others)")
    a(
        "--lora-modules",
        type=_lora_module,
        action="append",
        default=[],
        help="a static adapter NAME=PATH (repeatable)",
    )
    a("--max-loras", type=int, default=1, help="distinct adapters in one batch")
    a(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, also read from the environment)",
    )
    a("--lora-load-ms", type=float, default=0.0, help="time one adapter load takes")
    a(
        "--lora-resolvable",
        action="append",
        default=[],
        help="an adapter name a LoRA resolver plugin finds on first request (repeatable)",
    )


def _runtime_lora_env() -> bool:
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")


def _lora_settings(ns: argparse.Namespace) -> LoraSettings:
    if ns.max_loras < 1:
        raise ValueError("--max-loras must be >= 1")
    return LoraSettings(
        modules=dict(ns.lora_modules),
        enabled=ns.enable_lora,
        max_loras=ns.max_loras,
        runtime_updating=ns.allow_runtime_lora_updating or _runtime_lora_env(),
        load_s=ns.lora_load_ms / 1000.0,
        resolvable=frozenset(ns.lora_resolvable),
    )


def _add_kv_cache_args(a: Callable[..., Any]) -> None:
    a("--block-size", type=int, default=16)
    a(
        "--num-gpu-blocks",
        "--kv-blocks",
        dest="num_gpu_blocks",
        type=int,
        default=4096,
        help="KV capacity in blocks, shared by all groups",
    )
    a(
        "--groups",
        default="full",
        help='KV-cache groups in group_idx order, e.g. "full", "full,swa:64", "swa:64,full", '
        '"full,mamba", "chunked:8192,full" (Llama 4\'s chunked local attention); "@N" gives '
        'a group its own block size ("full@16,mamba@64")',
    )
    a(
        "--retention-interval",
        type=_retention,
        default=0,
        help="SWA/mamba prefix_cache_retention_interval: 0 (sparse, default), N, or none",
    )
    a("--max-model-len", type=int, default=131072)
    a(
        "--max-num-batched-tokens",
        "--token-budget",
        dest="max_num_batched_tokens",
        type=int,
        default=8192,
    )
    a("--max-num-seqs", type=int, default=256)
    a("--max-waiting", type=int, default=10000)
    a(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help="vLLM's: priority orders waiting requests by (priority, arrival), lowest first",
    )
    a(
        "--reject-priority",
        action="store_true",
        help="answer a non-zero priority under fcfs with 400, as vLLM's V0 engine did (V1 ignores "
        "it)",
    )


def _add_timing_and_offload_args(a: Callable[..., Any]) -> None:
    a("--prefill-tps", type=float, default=20000.0, help="prefill tokens/s (uncached)")
    a("--cpu-load-tps", type=float, default=200000.0, help="CPU->GPU load tokens/s")
    a("--decode-ms", type=float, default=20.0, help="decode step time per generated token")
    a("--step-overhead-ms", type=float, default=0.5)
    a("--cpu-chunks", type=int, default=0, help="CPU tier capacity in chunks (0 = off)")
    a("--cpu-chunk-tokens", type=int, default=256)


def _add_event_args(a: Callable[..., Any]) -> None:
    a("--cpu-events", choices=["placeholder", "self_describing"], default="placeholder")
    a(
        "--event-encoding",
        choices=list(ENCODINGS),
        default="map",
        help="map (vLLM >= 0.24), array (<= 0.23), map-0.32 (byte layout of the captures)",
    )
    a(
        "--legacy-replay",
        action="store_true",
        help="vLLM 0.23/0.24 replay bodies [seq, payload] (no topic frame)",
    )
    a("--topic", default="")
    a("--buffer-steps", type=int, default=10_000)
    a("--hwm", type=int, default=100_000)
    a("--max-queue-size", type=int, default=100_000)
    a("--no-events", action="store_true")
    a("--no-replay", action="store_true", help="publish events without a replay endpoint")
    a(
        "--no-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details is null (vLLM without --enable-prompt-tokens-details)",
    )
    a("--no-prefix-caching", action="store_true", help="vLLM's --no-enable-prefix-caching")
    a(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help="vLLM's flag: a chat completion with tool_choice none is rendered without its tools",
    )
    a(
        "--tokenizer-mode",
        choices=("auto", "mistral"),
        default="auto",
        help="vLLM's flag; mistral: tool-call ids cut to 9 characters by chat completions and "
        "refused otherwise, as on vLLM's Mistral tokenizer",
    )
    a(
        "--event-clock-skew",
        type=float,
        default=0.0,
        help="misconfiguration: event timestamps run this many seconds ahead",
    )


def _add_request_args(a: Callable[..., Any]) -> None:
    """Tokenizer, request limits and logging; and one misconfiguration, listed here to keep the
    order of ``--help``."""
    a("--chat-template", choices=["default", "alt"], default="default")
    a(
        "--chat-format",
        choices=["template", "harmony"],
        default="template",
        help="harmony: chat completions rendered as vLLM renders a gpt_oss model's (its "
        "/tokenize keeps the template); needs oss-harmony",
    )
    a(
        "--event-block-size-lie",
        type=int,
        default=None,
        help="misconfiguration: events report this block size",
    )
    a("--vocab-size", type=int, default=32000)
    a(
        "--tokenizer",
        default=None,
        help="model dir with tokenizer.json (+ tokenizer_config.json): tokenize with it "
        "(needs the tokenizers and jinja2 packages; the vocabulary sets --vocab-size)",
    )
    a("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    a(
        "--default-max-tokens",
        type=int,
        default=16,
        help="output length when a request sets none (finish_reason 'stop')",
    )
    a("--log-level", default="warning")


def settings_from_args(ns: argparse.Namespace, worker_idx: int) -> WorkerSettings:
    parse_groups(ns.groups)  # fail early with a clear message
    eng = EngineConfig(
        model=ns.model,
        block_size=ns.block_size,
        num_gpu_blocks=ns.num_gpu_blocks,
        groups=ns.groups,
        retention_interval=ns.retention_interval,
        max_model_len=ns.max_model_len,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        max_num_seqs=ns.max_num_seqs,
        max_waiting=ns.max_waiting,
        scheduling_policy=ns.scheduling_policy,
        reject_priority=ns.reject_priority,
        prefill_tokens_per_s=ns.prefill_tps,
        cpu_load_tokens_per_s=ns.cpu_load_tps,
        decode_s_per_token=ns.decode_ms / 1000.0,
        step_overhead_s=ns.step_overhead_ms / 1000.0,
        cpu_chunks=ns.cpu_chunks,
        cpu_chunk_tokens=ns.cpu_chunk_tokens,
        cpu_events=ns.cpu_events,
        enable_events=not ns.no_events,
        event_block_size_lie=ns.event_block_size_lie,
        event_clock_skew_s=ns.event_clock_skew,
        enable_prefix_caching=not ns.no_prefix_caching,
        loras=tuple(ns.lora),
        vocab_size=ns.vocab_size,
    )
    ev_base = ns.event_base_port if ns.event_base_port is not None else ns.base_port + 1000
    rp_base = ns.replay_base_port if ns.replay_base_port is not None else ns.base_port + 2000
    off = worker_idx * ns.dp_size
    return WorkerSettings(
        engine=eng,
        dp_size=ns.dp_size,
        events_endpoint=None if ns.no_events else f"tcp://*:{ev_base + off}",
        replay_endpoint=None if ns.no_events or ns.no_replay else f"tcp://*:{rp_base + off}",
        topic=ns.topic,
        buffer_steps=ns.buffer_steps,
        hwm=ns.hwm,
        max_queue_size=ns.max_queue_size,
        event_encoding=ns.event_encoding,
        legacy_replay=ns.legacy_replay,
        chat_template=ns.chat_template,
        chat_format=ns.chat_format,
        tokenizer_path=ns.tokenizer,
        max_body_bytes=ns.max_body_bytes,
        loras=tuple(ns.lora),
        lora=_lora_settings(ns),
        default_max_tokens=ns.default_max_tokens,
        prompt_tokens_details=not ns.no_prompt_tokens_details,
        exclude_tools_when_tool_choice_none=ns.exclude_tools_when_tool_choice_none,
        tokenizer_mode=ns.tokenizer_mode,
    )


async def serve(ns: argparse.Namespace) -> None:
    workers = [Worker(settings_from_args(ns, i)) for i in range(ns.workers)]
    for w in workers:
        await w.start()
    servers = [
        uvicorn.Server(
            uvicorn.Config(
                w.app,
                host=ns.host,
                port=ns.base_port + i,
                log_level=ns.log_level,
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=2,
            )
        )
        for i, w in enumerate(workers)
    ]
    for s in servers:
        s.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(s.serve()) for s in servers]
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
    for s in servers:
        s.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)
    for w in workers:
        await w.stop()
    for t in done:
        if t is not stopper and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
    if any(t is not stopper for t in done) and not stop.is_set():
        raise SystemExit(1)  # a server exited on its own (e.g. port in use)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.workers < 1 or ns.dp_size < 1:
        print("kvrouter-sim: --workers and --dp-size must be >= 1", file=sys.stderr)
        return 2
    try:
        settings_from_args(ns, 0)
    except ValueError as e:
        print(f"kvrouter-sim: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(ns))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
