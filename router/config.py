"""kvrouter configuration: the contract of docs/config.md, validated with clear errors.

``load_config(path, env)`` reads the YAML, applies ``KVROUTER_<SECTION>_<KEY>`` environment
overrides and validates everything. Unknown keys are an error naming the key (``ConfigError``).
Sections the router does not act on yet (``redis``, ``discovery``) are still parsed and validated
so a typo there is caught the same way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

import yaml

__all__ = [
    "POLICIES",
    "Config",
    "ConfigError",
    "WorkerSpec",
    "load_config",
    "parse_config",
    "parse_worker_arg",
]

POLICIES = ("kvrouter", "round_robin", "least_loaded", "random")
TOKENIZER_MODES = ("remote", "local")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key."""


@dataclass
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    admin_port: int | None = None
    admin_token: str | None = None
    api_keys: list[str] = field(default_factory=list)
    forward_authorization: bool = False
    max_body_bytes: int = 10_485_760
    cors_origins: list[str] = field(default_factory=list)
    log_level: str = "info"
    # Not yet in docs/config.md (reported): upstream HTTP client bounds.
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 600.0
    max_connections_per_worker: int = 256
    # Issue 8 bounds (reported for docs/config.md).
    request_timeout_s: float | None = None  # total time for one request, streaming included
    pool_timeout_s: float = 5.0  # wait for a free upstream connection, then 503
    max_header_bytes: int = 32_768  # request line + headers; 431 above


@dataclass
class ModelConfig:
    name: str | None = None
    block_size: int | None = None
    cpu_chunk_tokens: int = 256


@dataclass
class TokenizerConfig:
    mode: str = "remote"
    path: str | None = None
    cache_entries: int = 4096
    cache_tokens: int = 32_000_000  # token budget of that cache (issue 8; reported)
    # Completions: send the worker the ids its /tokenize returned instead of the text, so the
    # prompt is tokenized once per request, not twice (router/tokenize.py: upstream_ids).
    forward_ids: bool = True


@dataclass
class PolicyConfig:
    name: str = "kvrouter"
    cpu_transfer_discount: float = 0.25
    speculative_ttl_s: float = 2.0
    near_tie_tokens: int = 64
    # The cost model's weights (router/policy.py: PolicyParams, where each default is justified
    # by bench/routing_bench.py); the defaults here are the same.
    recompute_weight: float = 4.0
    running_request_tokens: float = 16.0
    kv_pressure_threshold: float = 0.9
    kv_pressure_tokens: float = 2048.0
    queue_drain: float = 1.0


@dataclass
class WorkerSpec:
    url: str
    events: str | None = None
    replay: str | None = None
    dp_size: int = 1
    topic: str = ""

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"


@dataclass
class EventsConfig:
    bind: str | None = None
    queue_depth: int = 10_000
    replay_timeout_s: float = 2.0
    replay_concurrency: int = 4


@dataclass
class IndexConfig:
    max_blocks: int = 5_000_000


@dataclass
class KubernetesDiscoveryConfig:
    enabled: bool = False
    namespace: str = "default"
    label_selector: str = "app=vllm"
    port: int = 8000
    events_port_annotation: str = "kvrouter.io/events-port"
    replay_port_annotation: str = "kvrouter.io/replay-port"
    dp_size_annotation: str = "kvrouter.io/dp-size"


@dataclass
class DiscoveryConfig:
    kubernetes: KubernetesDiscoveryConfig = field(default_factory=KubernetesDiscoveryConfig)


@dataclass
class RedisConfig:
    url: str | None = None
    key_prefix: str = "{kvrouter}"
    heartbeat_ttl_s: float = 10.0
    snapshot_interval_s: float = 30.0


@dataclass
class VerifyConfig:
    """Issue 9: prediction verification, drift handling and the worker self-check."""

    enabled: bool = True
    window: int = 50
    min_samples: int = 20
    min_accuracy: float = 0.8
    reset_after_misses: int = 3
    stream_usage: bool = True
    selfcheck: bool = True
    selfcheck_timeout_s: float = 5.0
    require_selfcheck: bool = True


@dataclass
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    workers: list[WorkerSpec] = field(default_factory=list)
    events: EventsConfig = field(default_factory=EventsConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)


_SECTIONS: dict[str, type] = {
    "server": ServerConfig,
    "model": ModelConfig,
    "tokenizer": TokenizerConfig,
    "policy": PolicyConfig,
    "events": EventsConfig,
    "index": IndexConfig,
    "discovery": DiscoveryConfig,
    "redis": RedisConfig,
    "verify": VerifyConfig,
}

# Field types, spelled out (dataclass annotations are strings under ``from __future__``).
_TYPES: dict[str, dict[str, tuple[type, ...]]] = {
    "server": {
        "host": (str,),
        "port": (int,),
        "admin_port": (int, type(None)),
        "admin_token": (str, type(None)),
        "api_keys": (list,),
        "forward_authorization": (bool,),
        "max_body_bytes": (int,),
        "cors_origins": (list,),
        "log_level": (str,),
        "connect_timeout_s": (float,),
        "first_byte_timeout_s": (float,),
        "max_connections_per_worker": (int,),
        "request_timeout_s": (float, type(None)),
        "pool_timeout_s": (float,),
        "max_header_bytes": (int,),
    },
    "model": {
        "name": (str, type(None)),
        "block_size": (int, type(None)),
        "cpu_chunk_tokens": (int,),
    },
    "tokenizer": {
        "mode": (str,),
        "path": (str, type(None)),
        "cache_entries": (int,),
        "cache_tokens": (int,),
        "forward_ids": (bool,),
    },
    "policy": {
        "name": (str,),
        "cpu_transfer_discount": (float,),
        "speculative_ttl_s": (float,),
        "near_tie_tokens": (int,),
        "recompute_weight": (float,),
        "running_request_tokens": (float,),
        "kv_pressure_threshold": (float,),
        "kv_pressure_tokens": (float,),
        "queue_drain": (float,),
    },
    "events": {
        "bind": (str, type(None)),
        "queue_depth": (int,),
        "replay_timeout_s": (float,),
        "replay_concurrency": (int,),
    },
    "index": {"max_blocks": (int,)},
    "discovery.kubernetes": {
        "enabled": (bool,),
        "namespace": (str,),
        "label_selector": (str,),
        "port": (int,),
        "events_port_annotation": (str,),
        "replay_port_annotation": (str,),
        "dp_size_annotation": (str,),
    },
    "redis": {
        "url": (str, type(None)),
        "key_prefix": (str,),
        "heartbeat_ttl_s": (float,),
        "snapshot_interval_s": (float,),
    },
    "verify": {
        "enabled": (bool,),
        "window": (int,),
        "min_samples": (int,),
        "min_accuracy": (float,),
        "reset_after_misses": (int,),
        "stream_usage": (bool,),
        "selfcheck": (bool,),
        "selfcheck_timeout_s": (float,),
        "require_selfcheck": (bool,),
    },
    "workers[]": {
        "url": (str,),
        "events": (str, type(None)),
        "replay": (str, type(None)),
        "dp_size": (int,),
        "topic": (str,),
    },
}


def _typename(types: tuple[type, ...]) -> str:
    names = {
        str: "string",
        int: "integer",
        float: "number",
        bool: "boolean",
        list: "list",
        type(None): "null",
    }
    return " or ".join(names.get(t, t.__name__) for t in types)


def _coerce(where: str, value: Any, types: tuple[type, ...]) -> Any:
    if value is None:
        if type(None) in types:
            return None
        raise ConfigError(f"{where}: must be a {_typename(types)}, got null")
    if bool in types:
        if isinstance(value, bool):
            return value
    elif isinstance(value, bool):
        raise ConfigError(f"{where}: must be a {_typename(types)}, got boolean {value!r}")
    if float in types and isinstance(value, int | float):
        return float(value)
    if int in types and isinstance(value, int):
        return value
    if str in types and isinstance(value, str):
        return value
    if list in types and isinstance(value, list):
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise ConfigError(f"{where}[{i}]: must be a string, got {item!r}")
        return list(value)
    raise ConfigError(f"{where}: must be a {_typename(types)}, got {value!r}")


def _build(section: str, cls: type, raw: Any) -> Any:
    if raw is None:
        return cls()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{section}: must be a mapping, got {raw!r}")
    types = _TYPES.get(section, {})
    known = {f.name for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(
                f"unknown key {section}.{key} (known keys of {section}: {', '.join(sorted(known))})"
            )
        if section == "discovery" and key == "kubernetes":
            kwargs[key] = _build("discovery.kubernetes", KubernetesDiscoveryConfig, value)
            continue
        kwargs[key] = _coerce(f"{section}.{key}", value, types[key])
    return cls(**kwargs)


def _build_workers(raw: Any) -> list[WorkerSpec]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(f"workers: must be a list of worker entries, got {raw!r}")
    out = []
    known = {f.name for f in fields(WorkerSpec)}
    for i, item in enumerate(raw):
        where = f"workers[{i}]"
        if isinstance(item, str):
            item = {"url": item}
        if not isinstance(item, Mapping):
            raise ConfigError(f"{where}: must be a mapping with at least url, got {item!r}")
        for key in item:
            if key not in known:
                raise ConfigError(
                    f"unknown key {where}.{key} (known keys: {', '.join(sorted(known))})"
                )
        if "url" not in item:
            raise ConfigError(f"{where}.url: missing (every worker needs its base URL)")
        kwargs = {k: _coerce(f"{where}.{k}", v, _TYPES["workers[]"][k]) for k, v in item.items()}
        out.append(WorkerSpec(**kwargs))
    return out


def _env_value(name: str, raw: str, types: tuple[type, ...]) -> Any:
    if list in types:
        return [x.strip() for x in raw.split(",") if x.strip()]
    if str in types and type(None) not in types and int not in types:
        return raw  # plain string: no YAML interpretation ("on", "0.0.0.0" stay strings)
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{name}: cannot parse {raw!r}: {exc}") from None
    if str in types and value is not None and not isinstance(value, str):
        value = raw
    return value


def _apply_env(data: dict[str, Any], env: Mapping[str, str]) -> None:
    """Apply ``KVROUTER_<SECTION>_<KEY>`` overrides (``KVROUTER_DISCOVERY_KUBERNETES_<KEY>``).

    Variables of an unknown section are ignored (other tools share the prefix, e.g. test flags);
    an unknown key within a known section is an error naming the variable.
    """
    for name, raw in env.items():
        if not name.startswith("KVROUTER_"):
            continue
        rest = name[len("KVROUTER_") :].lower()
        section = next((s for s in _SECTIONS if rest.startswith(s + "_")), None)
        if section is None:
            continue
        key = rest[len(section) + 1 :]
        path = section
        if section == "discovery":
            if not key.startswith("kubernetes_"):
                raise ConfigError(f"{name}: unknown key discovery.{key}")
            path, key = "discovery.kubernetes", key[len("kubernetes_") :]
        types = _TYPES[path].get(key)
        if types is None:
            raise ConfigError(
                f"{name}: unknown key {path}.{key} "
                f"(known keys of {path}: {', '.join(sorted(_TYPES[path]))})"
            )
        target = data.setdefault(section, {})
        if target is None:
            target = data[section] = {}
        if not isinstance(target, dict):
            raise ConfigError(f"{section}: must be a mapping")
        if path == "discovery.kubernetes":
            sub = target.setdefault("kubernetes", {})
            if sub is None:
                sub = target["kubernetes"] = {}
            target = sub
        target[key] = _env_value(name, raw, types)


def _check_url(where: str, url: str, schemes: tuple[str, ...]) -> None:
    parts = urlsplit(url)
    if parts.scheme not in schemes or not parts.netloc:
        raise ConfigError(f"{where}: {url!r} is not a {'/'.join(schemes)}:// URL")


def _validate(cfg: Config) -> None:
    s = cfg.server
    for key, port in (("port", s.port), ("admin_port", s.admin_port)):
        if port is not None and not 0 <= port <= 65535:
            raise ConfigError(f"server.{key}: {port} is not a TCP port (0-65535)")
    if s.max_body_bytes <= 0:
        raise ConfigError("server.max_body_bytes: must be positive")
    if s.connect_timeout_s <= 0 or s.first_byte_timeout_s <= 0:
        raise ConfigError("server.connect_timeout_s / first_byte_timeout_s: must be positive")
    if s.request_timeout_s is not None and s.request_timeout_s <= 0:
        raise ConfigError("server.request_timeout_s: must be positive (or null: no total limit)")
    if s.pool_timeout_s <= 0:
        raise ConfigError("server.pool_timeout_s: must be positive")
    if s.max_header_bytes < 1024:
        raise ConfigError("server.max_header_bytes: must be >= 1024")
    if s.max_connections_per_worker < 1:
        raise ConfigError("server.max_connections_per_worker: must be >= 1")
    if s.log_level.lower() not in LOG_LEVELS:
        raise ConfigError(
            f"server.log_level: {s.log_level!r} is not one of {', '.join(LOG_LEVELS)}"
        )
    if cfg.model.block_size is not None and cfg.model.block_size <= 0:
        raise ConfigError("model.block_size: must be positive")
    if cfg.model.cpu_chunk_tokens <= 0:
        raise ConfigError("model.cpu_chunk_tokens: must be positive")
    if cfg.tokenizer.mode not in TOKENIZER_MODES:
        raise ConfigError(
            f"tokenizer.mode: {cfg.tokenizer.mode!r} is not one of {', '.join(TOKENIZER_MODES)}"
        )
    if cfg.tokenizer.mode == "local" and not cfg.tokenizer.path:
        raise ConfigError("tokenizer.path: required when tokenizer.mode is local")
    if cfg.tokenizer.cache_entries < 0:
        raise ConfigError("tokenizer.cache_entries: must be >= 0")
    if cfg.tokenizer.cache_tokens < 0:
        raise ConfigError("tokenizer.cache_tokens: must be >= 0")
    p = cfg.policy
    if p.name not in POLICIES:
        raise ConfigError(f"policy.name: {p.name!r} is not one of {', '.join(POLICIES)}")
    if not 0.0 <= p.cpu_transfer_discount <= 1.0:
        raise ConfigError("policy.cpu_transfer_discount: must be within [0, 1]")
    if p.speculative_ttl_s < 0:
        raise ConfigError("policy.speculative_ttl_s: must be >= 0")
    if p.near_tie_tokens < 0:
        raise ConfigError("policy.near_tie_tokens: must be >= 0")
    if p.recompute_weight < 1:
        raise ConfigError("policy.recompute_weight: must be >= 1 (uncached tokens count once)")
    for name in ("running_request_tokens", "kv_pressure_tokens", "queue_drain"):
        if getattr(p, name) < 0:
            raise ConfigError(f"policy.{name}: must be >= 0")
    if not 0.0 <= p.kv_pressure_threshold <= 1.0:
        raise ConfigError("policy.kv_pressure_threshold: must be within [0, 1]")
    seen: set[str] = set()
    for i, w in enumerate(cfg.workers):
        _check_url(f"workers[{i}].url", w.url, ("http", "https"))
        w.url = w.url.rstrip("/")
        if w.url in seen:
            raise ConfigError(f"workers[{i}].url: duplicate worker {w.url}")
        seen.add(w.url)
        for key in ("events", "replay"):
            ep = getattr(w, key)
            if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(
                    f"workers[{i}].{key}: {ep!r} is not a tcp://, ipc:// or inproc://"
                )
        if w.replay is not None and w.events is None:
            raise ConfigError(f"workers[{i}].replay: set without workers[{i}].events")
        if w.dp_size < 1:
            raise ConfigError(f"workers[{i}].dp_size: must be >= 1")
    e = cfg.events
    if e.bind is not None and not e.bind.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(f"events.bind: {e.bind!r} is not a tcp://, ipc:// or inproc:// endpoint")
    for key in ("queue_depth", "replay_concurrency"):
        if getattr(e, key) < 1:
            raise ConfigError(f"events.{key}: must be >= 1")
    if e.replay_timeout_s <= 0:
        raise ConfigError("events.replay_timeout_s: must be positive")
    if cfg.index.max_blocks < 1:
        raise ConfigError("index.max_blocks: must be >= 1")
    k = cfg.discovery.kubernetes
    if not 0 < k.port <= 65535:
        raise ConfigError(f"discovery.kubernetes.port: {k.port} is not a TCP port")
    r = cfg.redis
    if r.url is not None:
        _check_url("redis.url", r.url, ("redis", "rediss", "unix"))
    if r.heartbeat_ttl_s <= 0:
        raise ConfigError("redis.heartbeat_ttl_s: must be positive")
    if r.snapshot_interval_s <= 0:
        raise ConfigError("redis.snapshot_interval_s: must be positive")
    v = cfg.verify
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


def parse_config(data: Any, env: Mapping[str, str] | None = None) -> Config:
    """Build a validated :class:`Config` from parsed YAML (a mapping or None) plus env."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"top level: must be a mapping of sections, got {type(data).__name__}")
    data = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
    for key in data:
        if key not in _SECTIONS and key != "workers":
            raise ConfigError(
                f"unknown key {key} (known sections: {', '.join(sorted([*_SECTIONS, 'workers']))})"
            )
    if isinstance(data.get("discovery"), dict) and isinstance(
        data["discovery"].get("kubernetes"), Mapping
    ):
        data["discovery"]["kubernetes"] = dict(data["discovery"]["kubernetes"])
    _apply_env(data, os.environ if env is None else env)
    kwargs: dict[str, Any] = {s: _build(s, cls, data.get(s)) for s, cls in _SECTIONS.items()}
    cfg = Config(workers=_build_workers(data.get("workers")), **kwargs)
    _validate(cfg)
    return cfg


def load_config(path: str | None, env: Mapping[str, str] | None = None) -> Config:
    """Read and validate a YAML config file (``None``: defaults plus env overrides)."""
    data: Any = None
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    return parse_config(data, env)


def parse_worker_arg(arg: str) -> WorkerSpec:
    """``http://h:8000;events=tcp://h:5557;replay=tcp://h:5558;dp_size=2;topic=t``."""
    parts = [p.strip() for p in arg.split(";") if p.strip()]
    if not parts:
        raise ConfigError("--worker: empty value")
    spec: dict[str, Any] = {"url": parts[0]}
    for p in parts[1:]:
        key, sep, value = p.partition("=")
        key = key.strip()
        if not sep or key not in ("events", "replay", "dp_size", "topic"):
            raise ConfigError(
                f"--worker {arg!r}: unknown option {key!r} (use events=, replay=, dp_size=, topic=)"
            )
        if key == "dp_size":
            try:
                spec[key] = int(value)
            except ValueError:
                raise ConfigError(f"--worker {arg!r}: dp_size must be an integer") from None
        else:
            spec[key] = value.strip()
    return WorkerSpec(**spec)
