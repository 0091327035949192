"""kvrouter configuration: the contract of docs/config.md, validated with clear errors.

``load_config(path, env)`` reads the YAML, applies ``KVROUTER_<SECTION>_<KEY>`` environment
overrides (``KVROUTER_DISCOVERY_KUBERNETES_<KEY>`` for the nested section) and validates
everything. Each section is declared once, as a msgspec Struct with its defaults; msgspec
converts the parsed YAML into them (types, unknown keys, the one required field) and small
per-section checks add the ranges and cross-field rules. Every error is a ``ConfigError`` whose
message names the key. Sections the router does not act on yet (``redis``, ``discovery``) are
validated all the same, so a typo there is caught the same way.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, get_args, get_origin
from urllib.parse import urlsplit

import msgspec
import yaml

from router.lora import LoraConfig
from router.policy import PolicyParams
from router.quotas import parse_keys

__all__ = [
    "POLICIES",
    "Config",
    "ConfigError",
    "WorkerSpec",
    "load_config",
    "parse_config",
    "parse_worker_arg",
    "upstream_api_key",
]

POLICIES = ("kvrouter", "round_robin", "least_loaded", "random")
TOKENIZER_MODES = ("remote", "local")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
LOG_FORMATS = ("text", "json")
ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key."""


class _Section(msgspec.Struct, forbid_unknown_fields=True):
    """A mapping of the configuration; a key it does not declare is an error."""


class ServerConfig(_Section):
    host: str = "0.0.0.0"
    port: int = 8000
    admin_port: int | None = None
    admin_token: str | None = None
    api_keys: list[str] = []
    api_keys_file: str | None = None
    """More keys with per-key rpm / tpm limits, from a file reloaded on change (quotas.py)."""
    rate_limit_period_s: float = 60.0
    """The period a key's rpm and tpm count over: its buckets hold one period of the limit."""
    forward_authorization: bool = False
    max_body_bytes: int = 10_485_760
    cors_origins: list[str] = []
    log_level: str = "info"
    log_format: str = "text"
    """``text`` (one readable line per record) or ``json`` (one JSON object per line, for log
    pipelines); uvicorn's records and the access lines (router/access.py) use it too."""
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 600.0
    max_connections_per_worker: int = 256
    request_timeout_s: float | None = None
    """Total time for one request, streaming included (None: no limit)."""
    pool_timeout_s: float = 5.0
    """Wait for a free upstream connection, then 503."""
    max_header_bytes: int = 32_768
    """Request line + headers; 431 above (router/limits.py)."""
    upstream_api_key: str | None = None
    """Sent to every worker as ``Authorization: Bearer`` (vLLM's ``--api-key``), independent of
    the clients' keys; a client's own Authorization then never reaches a worker."""
    upstream_api_key_file: str | None = None
    """A file holding ``upstream_api_key`` (a mounted Secret), read at start."""
    drain_timeout_s: float = 55.0
    """On SIGTERM: how long in-flight requests (streams included) may still run before they are
    cut. Keep it below the pod's ``terminationGracePeriodSeconds``."""
    drain_delay_s: float = 5.0
    """On SIGTERM: ``/ready`` answers 503 at once, but new requests are still accepted this
    long (within ``drain_timeout_s``), while load balancers take the replica out."""
    epp_port: int | None = None
    """gRPC port of the Endpoint Picker (Envoy ext_proc, router/epp.py); None: no EPP."""
    epp_tls: bool = False
    """Serve the EPP over TLS with a self-signed certificate made at start."""
    epp_endpoints: int = 1
    """How many ranked endpoints the EPP names (a fallback list for gateways that walk it)."""


class ModelConfig(_Section):
    name: str | None = None
    block_size: int | None = None
    cpu_chunk_tokens: int = 256
    speculative: bool = False
    """The workers run EAGLE / MTP speculative decoding: vLLM drops the last matched block."""


class TokenizerConfig(_Section):
    mode: str = "remote"
    path: str | None = None
    cache_entries: int = 4096
    cache_tokens: int = 32_000_000
    """Token budget of the tokenization cache (whichever of the two bounds is hit first)."""
    forward_ids: bool = True
    """Completions: send the worker the ids its /tokenize returned instead of the text, so the
    prompt is tokenized once per request, not twice (router/tokenize.py: upstream_ids)."""


class WorkerSpec(_Section):
    url: str
    events: str | None = None
    replay: str | None = None
    dp_size: int = 1
    topic: str = ""
    prefer_event_sources: bool = False
    """Ask the worker's ``GET /kv_event_sources`` first; ``events`` / ``replay`` / ``dp_size``
    are used only when it has none (an older vLLM, or events off). Discovered pods set it."""

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"


class EventsConfig(_Section):
    bind: str | None = None
    queue_depth: int = 10_000
    queue_bytes: int = 64 << 20
    """Payload bytes queued per event source (past it: a counted overflow, then replay)."""
    replay_timeout_s: float = 2.0
    replay_concurrency: int = 4


class IndexConfig(_Section):
    max_blocks: int = 5_000_000


class KubernetesDiscoveryConfig(_Section):
    enabled: bool = False
    namespace: str = "default"
    label_selector: str = "app=vllm"
    namespaces: list[str] = msgspec.field(default_factory=list)
    """Watch these namespaces (one list+watch each) instead of ``namespace``."""
    port: int = 8000
    events_port: int = 5557
    """A pod's events port when neither ``/kv_event_sources`` nor an annotation gives one."""
    replay_port: int | None = 5558
    """Likewise for the replay port; None: no replay socket (pods set up the llm-d way)."""
    events_port_annotation: str = "kvrouter.io/events-port"
    replay_port_annotation: str = "kvrouter.io/replay-port"
    dp_size_annotation: str = "kvrouter.io/dp-size"
    inference_pool: str | None = None
    """An InferencePool (inference.networking.k8s.io/v1) of ``namespace``: its selector
    replaces ``label_selector`` and each of its ``targetPorts`` is one worker per pod
    (router/discovery.py)."""


class DiscoveryConfig(_Section):
    kubernetes: KubernetesDiscoveryConfig = msgspec.field(default_factory=KubernetesDiscoveryConfig)


class RedisConfig(_Section):
    url: str | None = None
    key_prefix: str = "{kvrouter}"
    heartbeat_ttl_s: float = 10.0
    snapshot_interval_s: float = 30.0


class SessionConfig(_Section):
    """Session affinity (router/sessions.py)."""

    mode: str = "soft"
    """off, soft (the last turn's engine is credited its prompt as a hit) or hard (pinned)."""
    header: str = "x-session-id"
    user_field: bool = True
    """Also take the session from the OpenAI ``user`` field when the header is absent."""
    ttl_s: float = 600.0
    max_sessions: int = 100_000


class VerifyConfig(_Section):
    """Prediction verification, drift handling and the worker self-check."""

    enabled: bool = True
    window: int = 50
    min_samples: int = 20
    min_accuracy: float = 0.8
    reset_after_misses: int = 3
    stream_usage: bool = True
    selfcheck: bool = True
    selfcheck_timeout_s: float = 5.0
    require_selfcheck: bool = True


class Config(_Section):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = msgspec.field(default_factory=TokenizerConfig)
    policy: PolicyParams = msgspec.field(default_factory=PolicyParams)
    workers: list[WorkerSpec] = []
    events: EventsConfig = msgspec.field(default_factory=EventsConfig)
    index: IndexConfig = msgspec.field(default_factory=IndexConfig)
    discovery: DiscoveryConfig = msgspec.field(default_factory=DiscoveryConfig)
    redis: RedisConfig = msgspec.field(default_factory=RedisConfig)
    verify: VerifyConfig = msgspec.field(default_factory=VerifyConfig)
    session: SessionConfig = msgspec.field(default_factory=SessionConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)


# ---------------------------------------------------------------- reading the declarations


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _fields(cls: type) -> dict[str, Any]:
    """Key name -> declared type of one section."""
    return {f.name: f.type for f in msgspec.structs.fields(cls)}


_STEP = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _steps(where: str) -> list[str | int]:
    """``workers[0].url`` -> ``["workers", 0, "url"]``."""
    return [name or int(index) for name, index in _STEP.findall(where)]


def _type_at(where: str) -> Any:
    """The declared type at a path such as ``discovery.kubernetes`` or ``workers[0]``."""
    tp: Any = Config
    for step in _steps(where):
        tp = get_args(tp)[0] if isinstance(step, int) else _fields(tp)[step]
    return tp


def _value_at(data: Any, where: str) -> Any:
    for step in _steps(where):
        data = data[step]
    return data


def _unknown_key(prefix: str, where: str, key: str) -> ConfigError:
    known = ", ".join(sorted(_fields(_type_at(where))))
    if not where:
        return ConfigError(f"{prefix}unknown key {key} (known sections: {known})")
    return ConfigError(f"{prefix}unknown key {where}.{key} (known keys of {where}: {known})")


# ---------------------------------------------------------------- building: YAML + env -> Config


def _plain(value: Any) -> Any:
    """A copy made of dicts and lists, so env overrides never touch the caller's data."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _env_value(name: str, raw: str, tp: Any) -> Any:
    """An environment string as the value the YAML would hold for a key of type ``tp``."""
    if get_origin(tp) is list:
        return [x.strip() for x in raw.split(",") if x.strip()]
    if tp is str:
        return raw  # plain string: no YAML interpretation ("on", "0.0.0.0" stay strings)
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{name}: cannot parse {raw!r}: {exc}") from None
    if str in get_args(tp) and value is not None and not isinstance(value, str):
        value = raw
    return value


def _apply_env(data: dict[str, Any], env: Mapping[str, str]) -> None:
    """Apply ``KVROUTER_<SECTION>_<KEY>`` overrides; nested sections add their name's part.

    Variables of an unknown section are ignored (other tools share the prefix, e.g. test flags);
    an unknown key within a known section is an error naming the variable.
    """
    sections = [name for name, tp in _fields(Config).items() if _is_section(tp)]
    for name, raw in env.items():
        if not name.startswith("KVROUTER_"):
            continue
        rest = name[len("KVROUTER_") :].lower()
        section = next((s for s in sections if rest.startswith(s + "_")), None)
        if section is None:
            continue
        path, key = [section], rest[len(section) + 1 :]
        while key not in (known := _fields(_type_at(".".join(path)))):
            nested = next(
                (k for k, t in known.items() if _is_section(t) and key.startswith(k + "_")), None
            )
            if nested is None:
                raise _unknown_key(f"{name}: ", ".".join(path), key)
            path.append(nested)
            key = key[len(nested) + 1 :]
        target = data
        for i, part in enumerate(path):
            if target.get(part) is None:
                target[part] = {}
            if not isinstance(target[part], dict):
                raise ConfigError(f"{'.'.join(path[: i + 1])}: must be a mapping")
            target = target[part]
        target[key] = _env_value(name, raw, known[key])


def _drop_null_sections(data: dict[str, Any], cls: type) -> None:
    """A section given as null (``server:`` with nothing under it) takes its defaults."""
    for name, tp in _fields(cls).items():
        if name in data and data[name] is None and (_is_section(tp) or name == "workers"):
            del data[name]
        elif _is_section(tp) and isinstance(data.get(name), dict):
            _drop_null_sections(data[name], tp)


def _worker_entries(raw: Any) -> list[Any]:
    """``workers`` entries as mappings (a bare string is the URL), shapes checked."""
    if not isinstance(raw, list):
        raise ConfigError(f"workers: must be a list of worker entries, got {raw!r}")
    entries = [{"url": item} if isinstance(item, str) else item for item in raw]
    for i, item in enumerate(entries):
        if not isinstance(item, dict):
            raise ConfigError(f"workers[{i}]: must be a mapping with at least url, got {item!r}")
    return entries


_TYPE_WORDS = {
    "str": "string",
    "int": "integer",
    "float": "number",
    "bool": "boolean",
    "array": "list",
    "object": "mapping",
}


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {value!r}"
    return repr(value)


def _explain(exc: msgspec.ValidationError, data: dict[str, Any]) -> ConfigError:
    """msgspec's message ("Expected `int`, got `str` - at `$.server.port`") in the config's
    words ("server.port: must be a integer, got 'eighty'")."""
    text, _, at = str(exc).partition(" - at `")
    where = at.removesuffix("`").removeprefix("$").lstrip(".")
    if m := re.fullmatch(r"Object contains unknown field `(.+)`", text):
        return _unknown_key("", where, m[1])
    if m := re.fullmatch(r"Object missing required field `(.+)`", text):
        hint = " (every worker needs its base URL)" if _type_at(where) is WorkerSpec else ""
        return ConfigError(f"{where}.{m[1]}: missing{hint}")
    if m := re.fullmatch(r"Expected `(.+?)`, got `.+`", text):
        expected = " or ".join(_TYPE_WORDS.get(t, t) for t in m[1].split(" | "))
        return ConfigError(f"{where}: must be a {expected}, got {_shown(_value_at(data, where))}")
    if where.startswith("key` in `$"):  # a key that is not a string cannot be a known one
        where = where.removeprefix("key` in `$").lstrip(".")
        key = next(k for k in _value_at(data, where) if not isinstance(k, str))
        return _unknown_key("", where, key)
    return ConfigError(f"{where or 'top level'}: {text}")


def parse_config(data: Any, env: Mapping[str, str] | None = None) -> Config:
    """Build a validated :class:`Config` from parsed YAML (a mapping or None) plus env."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"top level: must be a mapping of sections, got {type(data).__name__}")
    data = _plain(data)
    _apply_env(data, os.environ if env is None else env)
    _drop_null_sections(data, Config)
    if "workers" in data:
        data["workers"] = _worker_entries(data["workers"])
    try:
        cfg = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise _explain(exc, data) from None
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


# ---------------------------------------------------------------- ranges and cross-field rules


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
    if p.recompute_weight < 1:
        raise ConfigError("policy.recompute_weight: must be >= 1 (uncached tokens count once)")
    if p.prefill_tokens_per_s <= 0:
        raise ConfigError("policy.prefill_tokens_per_s: must be positive")
    for name in ("running_request_tokens", "kv_pressure_tokens", "queue_drain"):
        if getattr(p, name) < 0:
            raise ConfigError(f"policy.{name}: must be >= 0")
    if p.mean_prompt_tokens < 0:
        raise ConfigError("policy.mean_prompt_tokens: must be >= 0")
    if not 0.0 <= p.kv_pressure_threshold <= 1.0:
        raise ConfigError("policy.kv_pressure_threshold: must be within [0, 1]")


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


def _validate(cfg: Config) -> None:
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


def _check_session(s: SessionConfig) -> None:
    if s.mode not in ("off", "soft", "hard"):
        raise ConfigError(f"session.mode: must be off, soft or hard, got {s.mode!r}")
    if s.ttl_s <= 0 or s.max_sessions < 1:
        raise ConfigError("session.ttl_s / session.max_sessions: must be positive")
    if not s.header:
        raise ConfigError("session.header: must name a header")


def upstream_api_key(cfg: Config) -> str | None:
    """``server.upstream_api_key``, or the content of ``server.upstream_api_key_file``."""
    s = cfg.server
    if s.upstream_api_key_file is None:
        return s.upstream_api_key
    with open(s.upstream_api_key_file) as f:
        return f.read().strip()
