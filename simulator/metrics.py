"""``GET /metrics``: vLLM's metric names, labels ``engine`` (DP rank) and ``model_name``."""

from __future__ import annotations

from collections.abc import Iterable

from simulator.engine import TTFT_BUCKETS_S
from simulator.runner import EngineRunner


def metrics_text(model: str, runners: list[EngineRunner], extra: Iterable[str] = ()) -> str:
    """The exposition; ``extra``: whole families rendered elsewhere (the LoRA gauge)."""
    lines: list[str] = []

    def fam(name: str, typ: str, help_: str, values: list[tuple[int, float]]) -> None:
        # prometheus_client (what vLLM uses): a Counter "x" is declared as "x" and
        # sampled as "x_total".
        base = name.removesuffix("_total") if typ == "counter" else name
        lines.append(f"# HELP {base} {help_}")
        lines.append(f"# TYPE {base} {typ}")
        for rank, v in values:
            lines.append(f'{name}{{engine="{rank}",model_name="{model}"}} {v}')

    rs = runners
    fam(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        [(r.dp_rank, float(len(r.engine.running))) for r in rs],
    )
    fam(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        [(r.dp_rank, float(len(r.engine.waiting))) for r in rs],
    )
    fam(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        [(r.dp_rank, r.engine.kv_usage()) for r in rs],
    )
    fam(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        [(r.dp_rank, float(r.engine.prefix_queries)) for r in rs],
    )
    fam(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        [(r.dp_rank, float(r.engine.prefix_hits)) for r in rs],
    )
    fam(
        "vllm:external_prefix_cache_queries_total",
        "counter",
        "External prefix cache queries from KV connector, in terms of number of tokens.",
        [(r.dp_rank, float(r.engine.external_queries)) for r in rs],
    )
    fam(
        "vllm:external_prefix_cache_hits_total",
        "counter",
        "External prefix cache hits from KV connector, in terms of number of tokens.",
        [(r.dp_rank, float(r.engine.external_hits)) for r in rs],
    )
    # vLLM's CacheConfig as labels of a gauge set to 1, one sample per engine (a subset of
    # its fields: the ones a router reads).
    name = "vllm:cache_config_info"
    lines.append(f"# HELP {name} Information of the LLMEngine CacheConfig")
    lines.append(f"# TYPE {name} gauge")
    for r in rs:
        c = r.engine.config
        info = {
            "block_size": c.block_size,
            "enable_prefix_caching": c.enable_prefix_caching,
            "engine": r.dp_rank,
            "num_gpu_blocks": c.num_gpu_blocks,
            "prefix_cache_retention_interval": c.retention_interval,
        }
        labels = ",".join(f'{k}="{v}"' for k, v in info.items())
        lines.append(f"{name}{{{labels}}} 1.0")
    name = "vllm:engine_sleep_state"
    lines.append(
        f"# HELP {name} Engine sleep state; awake = 0 means engine is sleeping; awake = 1 "
        "means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 "
        "means sleep level 2."
    )
    lines.append(f"# TYPE {name} gauge")
    for r in rs:
        level = r.engine.sleep_level
        states = {
            "awake": level is None,
            "weights_offloaded": level == 1,
            "discard_all": level == 2,
        }
        for state, on in states.items():
            labels = f'engine="{r.dp_rank}",model_name="{model}",sleep_state="{state}"'
            lines.append(f"{name}{{{labels}}} {float(on)}")
    name = "vllm:time_to_first_token_seconds"
    lines.append(f"# HELP {name} Histogram of time to first token in seconds.")
    lines.append(f"# TYPE {name} histogram")
    for r in rs:
        e, labels = r.engine, f'engine="{r.dp_rank}",model_name="{model}"'
        for bound, n in zip(TTFT_BUCKETS_S, e.ttft_buckets, strict=True):
            lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {float(n)}')
        lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(e.first_tokens)}')
        lines.append(f"{name}_count{{{labels}}} {float(e.first_tokens)}")
        lines.append(f"{name}_sum{{{labels}}} {e.ttft_sum_s}")
    lines.extend(extra)
    return "\n".join(lines) + "\n"
