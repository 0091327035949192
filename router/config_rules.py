"""The configuration's ranges and cross-field rules: the checks msgspec's types cannot say.

``router/config.py`` declares the sections and converts YAML and environment into them; every
rule here raises a ``ConfigError`` whose message names the key and what it accepts.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import yaml

from router import harmony
from router.quotas import parse_keys
from router.tracing import config_problem

if TYPE_CHECKING:
    from router.config import (
        AdmissionConfig,
        Config,
        EventsConfig,
        IndexConfig,
        KubernetesDiscoveryConfig,
        ModelConfig,
        RedisConfig,
        ServerConfig,
        SessionConfig,
        TokenizerConfig,
        VerifyConfig,
        WorkerSpec,
    )
    from router.policy import PolicyParams

__all__ = ["POLICIES", "ConfigError", "validate"]

POLICIES = ("kvrouter", "round_robin", "least_loaded", "random")
TOKENIZER_MODES = ("remote", "local")
CHAT_FORMATS = ("auto", "template", "harmony")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
LOG_FORMATS = ("text", "json")
ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")
ADMISSION_ORDERS = ("fair", "shortest_prompt")


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key."""


def _check_url(where: str, url: str, schemes: tuple[str, ...]) -> None:
    parts = urlsplit(url)
    if parts.scheme not in schemes or not parts.netloc:
        raise ConfigError(f"{where}: {url!r} is not a {'/'.join(schemes)}:// URL")


def _check_server(s: ServerConfig) -> None:
    for key, port in (("port", s.port), ("admin_port", s.admin_port), ("epp_port", s.epp_port)):
        if port is not None and not 0 <= port <= 65535:
            raise ConfigError(f"server.{key}: {port} is not a TCP port (0-65535)")
    if s.max_body_bytes <= 0:
        raise ConfigError("server.max_body_bytes: must be positive")
    if s.connect_timeout_s <= 0 or s.first_byte_timeout_s <= 0:
        raise ConfigError("server.connect_timeout_s / first_byte_timeout_s: must be positive")
    if s.worker_stall_s < 0:
        raise ConfigError("server.worker_stall_s: must be >= 0 (0 never skips a stalled worker)")
    if s.worker_poll_s < 0.05:
        raise ConfigError("server.worker_poll_s: must be >= 0.05 (seconds between polls)")
    if s.request_timeout_s is not None and s.request_timeout_s <= 0:
        raise ConfigError("server.request_timeout_s: must be positive (or null: no total limit)")
    if s.pool_timeout_s <= 0 or s.rate_limit_period_s <= 0:
        raise ConfigError("server.pool_timeout_s / rate_limit_period_s: must be positive")
    if s.api_keys_file is not None:
        try:
            with open(s.api_keys_file) as f:
                parse_keys(yaml.safe_load(f))
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise ConfigError(f"server.api_keys_file: {exc}") from None
    if s.upstream_api_key is not None and s.upstream_api_key_file is not None:
        raise ConfigError("server.upstream_api_key / upstream_api_key_file: give one, not both")
    if s.upstream_api_key_file is not None:
        try:
            with open(s.upstream_api_key_file) as f:
                key = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"server.upstream_api_key_file: cannot read it ({exc})") from None
        if not key:
            raise ConfigError("server.upstream_api_key_file: the file is empty")
    if s.drain_timeout_s < 0 or s.drain_delay_s < 0:
        raise ConfigError("server.drain_timeout_s / drain_delay_s: must be >= 0")
    if s.max_header_bytes < 1024:
        raise ConfigError("server.max_header_bytes: must be >= 1024")
    if s.max_connections_per_worker < 1:
        raise ConfigError("server.max_connections_per_worker: must be >= 1")
    if s.epp_endpoints < 1:
        raise ConfigError("server.epp_endpoints: must be >= 1")
    if s.log_level.lower() not in LOG_LEVELS:
        raise ConfigError(
            f"server.log_level: {s.log_level!r} is not one of {', '.join(LOG_LEVELS)}"
        )
    if s.log_format not in LOG_FORMATS:
        raise ConfigError(
            f"server.log_format: {s.log_format!r} is not one of {', '.join(LOG_FORMATS)}"
        )


def _check_model_and_tokenizer(m: ModelConfig, t: TokenizerConfig) -> None:
    if m.block_size is not None and m.block_size <= 0:
        raise ConfigError("model.block_size: must be positive")
    if m.cpu_chunk_tokens <= 0:
        raise ConfigError("model.cpu_chunk_tokens: must be positive")
    if m.attention_chunk_tokens is not None and m.attention_chunk_tokens <= 0:
        raise ConfigError("model.attention_chunk_tokens: must be positive or null")
    if m.chat_format not in CHAT_FORMATS:
        raise ConfigError(
            f"model.chat_format: {m.chat_format!r} is not one of {', '.join(CHAT_FORMATS)}"
        )
    if m.chat_format == "harmony" and not harmony.available():
        raise ConfigError(
            "model.chat_format: harmony needs the harmony library: pip install 'kvrouter[harmony]'"
        )
    r = m.prefix_cache_retention_interval
    if r is not None and r < 0:
        raise ConfigError("model.prefix_cache_retention_interval: must be >= 0 or null")
    if t.mode not in TOKENIZER_MODES:
        raise ConfigError(f"tokenizer.mode: {t.mode!r} is not one of {', '.join(TOKENIZER_MODES)}")
    if t.mode == "local" and not t.path:
        raise ConfigError("tokenizer.path: required when tokenizer.mode is local")
    if t.cache_entries < 0:
        raise ConfigError("tokenizer.cache_entries: must be >= 0")
    if t.cache_tokens < 0:
        raise ConfigError("tokenizer.cache_tokens: must be >= 0")


def _check_policy(p: PolicyParams) -> None:
    if p.name not in POLICIES:
        raise ConfigError(f"policy.name: {p.name!r} is not one of {', '.join(POLICIES)}")
    if not 0.0 <= p.cpu_transfer_discount <= 1.0:
        raise ConfigError("policy.cpu_transfer_discount: must be within [0, 1]")
    if p.speculative_ttl_s < 0:
        raise ConfigError("policy.speculative_ttl_s: must be >= 0")
    if p.near_tie_tokens < 0:
        raise ConfigError("policy.near_tie_tokens: must be >= 0")
    if p.recompute_weight != 0 and p.recompute_weight < 1:
        raise ConfigError(
            "policy.recompute_weight: must be 0 (learned) or >= 1 (uncached tokens count once)"
        )
    if p.prefill_tokens_per_s <= 0:
        raise ConfigError("policy.prefill_tokens_per_s: must be positive")
    for name in (
        "running_request_tokens",
        "kv_pressure_tokens",
        "queue_drain",
        "follow_on_weight",
        "new_holder_weight",
    ):
        if getattr(p, name) < 0:
            raise ConfigError(f"policy.{name}: must be >= 0")
    if p.mean_prompt_tokens < 0:
        raise ConfigError("policy.mean_prompt_tokens: must be >= 0")
    if not 0.0 <= p.kv_pressure_threshold <= 1.0:
        raise ConfigError("policy.kv_pressure_threshold: must be within [0, 1]")
    if not 0.0 <= p.hit_loss_budget <= 1.0:
        raise ConfigError(
            "policy.hit_loss_budget: must be within [0, 1] (a share of prompt tokens; 1 = none)"
        )
    if not 0.0 < p.prefill_priority_max_wait_s < math.inf:
        raise ConfigError(
            "policy.prefill_priority_max_wait_s: must be a positive number of seconds (how long "
            "a request may be passed over by shorter ones on its engine)"
        )


def _check_workers(workers: list[WorkerSpec]) -> None:
    """Also drops a trailing ``/`` from each URL, so one worker has one spelling."""
    seen: set[str] = set()
    for i, w in enumerate(workers):
        _check_url(f"workers[{i}].url", w.url, ("http", "https"))
        w.url = w.url.rstrip("/")
        if w.url in seen:
            raise ConfigError(f"workers[{i}].url: duplicate worker {w.url}")
        seen.add(w.url)
        for key in ("events", "replay"):
            ep = getattr(w, key)
            if ep is not None and not ep.startswith(ZMQ_SCHEMES):
                raise ConfigError(
                    f"workers[{i}].{key}: {ep!r} is not a tcp://, ipc:// or inproc://"
                )
        if w.replay is not None and w.events is None:
            raise ConfigError(f"workers[{i}].replay: set without workers[{i}].events")
        if w.dp_size < 1:
            raise ConfigError(f"workers[{i}].dp_size: must be >= 1")


def _check_events_and_index(e: EventsConfig, index: IndexConfig) -> None:
    if e.bind is not None and not e.bind.startswith(ZMQ_SCHEMES):
        raise ConfigError(f"events.bind: {e.bind!r} is not a tcp://, ipc:// or inproc:// endpoint")
    for key in ("queue_depth", "queue_bytes", "replay_concurrency"):
        if getattr(e, key) < 1:
            raise ConfigError(f"events.{key}: must be >= 1")
    if e.replay_timeout_s <= 0:
        raise ConfigError("events.replay_timeout_s: must be positive")
    if index.max_blocks < 1:
        raise ConfigError("index.max_blocks: must be >= 1")


def _check_discovery_and_redis(k: KubernetesDiscoveryConfig, r: RedisConfig) -> None:
    for key, port in (
        ("port", k.port),
        ("events_port", k.events_port),
        ("replay_port", k.replay_port),
    ):
        if port is not None and not 0 < port <= 65535:
            raise ConfigError(f"discovery.kubernetes.{key}: {port} is not a TCP port")
    if any(not ns for ns in k.namespaces):
        raise ConfigError("discovery.kubernetes.namespaces: an empty namespace name")
    if r.url is not None:
        _check_url("redis.url", r.url, ("redis", "rediss", "unix"))
    if r.heartbeat_ttl_s <= 0:
        raise ConfigError("redis.heartbeat_ttl_s: must be positive")
    if r.snapshot_interval_s <= 0:
        raise ConfigError("redis.snapshot_interval_s: must be positive")
    if not 0 < r.op_timeout_s <= 10:
        raise ConfigError("redis.op_timeout_s: must be in (0, 10] seconds")


def _check_verify(v: VerifyConfig) -> None:
    if v.window < 1 or v.min_samples < 1:
        raise ConfigError("verify.window / verify.min_samples: must be >= 1")
    if v.min_samples > v.window:
        raise ConfigError("verify.min_samples: must be <= verify.window")
    if not 0.0 <= v.min_accuracy <= 1.0:
        raise ConfigError("verify.min_accuracy: must be within [0, 1]")
    if v.reset_after_misses < 0:
        raise ConfigError("verify.reset_after_misses: must be >= 0 (0: never reset)")
    if v.selfcheck_timeout_s <= 0:
        raise ConfigError("verify.selfcheck_timeout_s: must be positive")


def validate(cfg: Config) -> None:
    """The checks beyond types; router/cli.py runs them again after its flags are applied."""
    _check_server(cfg.server)
    _check_model_and_tokenizer(cfg.model, cfg.tokenizer)
    _check_policy(cfg.policy)
    _check_workers(cfg.workers)
    _check_events_and_index(cfg.events, cfg.index)
    _check_discovery_and_redis(cfg.discovery.kubernetes, cfg.redis)
    _check_verify(cfg.verify)
    _check_session(cfg.session)
    for problem in cfg.lora.problems():
        raise ConfigError(problem)
    _check_admission(cfg.admission)
    if (problem := config_problem(cfg.tracing)) is not None:
        raise ConfigError(problem)


def _check_session(s: SessionConfig) -> None:
    if s.mode not in ("off", "soft", "hard"):
        raise ConfigError(f"session.mode: must be off, soft or hard, got {s.mode!r}")
    if s.ttl_s <= 0 or s.max_sessions < 1:
        raise ConfigError("session.ttl_s / session.max_sessions: must be positive")
    if not s.header:
        raise ConfigError("session.header: must name a header")


def _check_admission(a: AdmissionConfig) -> None:
    t = a.queued_prefill_tokens_threshold
    if t is not None and t < 1:
        raise ConfigError("admission.queued_prefill_tokens_threshold: must be >= 1 (or null: off)")
    if a.max_queue < 0:
        raise ConfigError("admission.max_queue: must be >= 0")
    if a.max_wait_s <= 0 or a.retry_after_s <= 0:
        raise ConfigError("admission.max_wait_s / admission.retry_after_s: must be positive")
    if a.order not in ADMISSION_ORDERS:
        raise ConfigError(f"admission.order: one of {', '.join(ADMISSION_ORDERS)}, not {a.order!r}")
    if a.shortest_first_max_wait_s <= 0:
        raise ConfigError("admission.shortest_first_max_wait_s: must be positive")
