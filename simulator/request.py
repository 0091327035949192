"""Per-request state shared by the scheduler, the KV manager and the CPU tier."""

from __future__ import annotations

from simulator.hashing import RequestHasher

WAITING = 0
WAITING_FOR_REMOTE_KVS = 1  # CPU -> GPU load in flight (vLLM RequestStatus of that name)
RUNNING = 2
FINISHED = 3


class Request:
    __slots__ = (
        "all_token_ids",
        "arrival_s",
        "blocks",
        "cached_tokens",
        "cpu_loaded_tokens",
        "finish_s",
        "first_hit",
        "first_token_s",
        "hasher",
        "hit_done",
        "load_ready_s",
        "lora_id",
        "lora_name",
        "max_tokens",
        "num_cached",
        "num_computed",
        "num_output",
        "num_prompt",
        "offloaded_chunks",
        "priority",
        "reachable",
        "report_full",
        "request_id",
        "session_id",
        "status",
        "user",
    )

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        arrival_s: float,
        n_groups: int,
        block_size: int,
        lora_name: str | None = None,
        lora_id: int | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
        hasher: RequestHasher | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt)
        self.num_prompt = len(prompt)
        self.max_tokens = max(1, int(max_tokens))
        self.arrival_s = arrival_s
        self.priority = priority  # vLLM's request priority: lower is scheduled earlier
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.num_computed = 0
        self.num_output = 0
        self.blocks: list[list[int]] = [[] for _ in range(n_groups)]
        self.num_cached: list[int] = [0] * n_groups
        self.hasher = hasher or RequestHasher(block_size, lora_name, cache_salt)
        self.lora_name = lora_name
        self.lora_id = lora_id
        self.session_id = session_id
        self.status = WAITING
        self.hit_done = False
        self.reachable: set[int] | None = None  # block boundaries that can serve a hit
        self.cached_tokens = 0
        self.cpu_loaded_tokens = 0
        # (GPU hit, CPU-loaded tokens) of the first admission: what usage reports, as vLLM's
        # num_cached_tokens is set once (it starts at -1). A preempted request is admitted again
        # and finds its own freed blocks cached; that second hit must not be reported.
        self.first_hit: tuple[int, int] | None = None
        self.load_ready_s = 0.0
        self.offloaded_chunks = 0
        self.report_full = False  # vllm_xargs kv_cache_report_mode == "full"
        self.user: object = None  # opaque slot for the HTTP layer

    def usage_hit(self) -> tuple[int, int]:
        """(GPU prefix-cache hit, CPU-loaded tokens) to report: the first admission's."""
        if self.first_hit is not None:
            return self.first_hit
        return self.cached_tokens, self.cpu_loaded_tokens
