"""kvrouter configuration: the contract of docs/config.md, validated with clear errors.

``load_config(path, env)`` reads the YAML, applies ``KVROUTER_<SECTION>_<KEY>`` environment
overrides (``KVROUTER_DISCOVERY_KUBERNETES_<KEY>`` for the nested section) and validates
everything. Each section is declared once, as a msgspec Struct with its defaults; msgspec
converts the parsed YAML into them (types, unknown keys, the one required field), and
router/config_rules.py adds the ranges and cross-field rules. Every error is a ``ConfigError``
whose message names the key.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, get_args, get_origin
from urllib.parse import urlsplit

import msgspec
import yaml

from router.config_rules import POLICIES, ConfigError, validate
from router.lora import LoraConfig
from router.policy import PolicyParams
from router.tracing import TracingConfig

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
    worker_stall_s: float = 30.0
    """An engine whose worker's /metrics shows it with requests waiting and none running for
    this long is skipped until it runs requests again, and this router's requests waiting there
    are taken back (its scheduler stalled; 0: never). Keep it above the longest such wait a
    healthy engine has (a P/D decode worker waiting for remote KV)."""
    worker_poll_s: float = 1.0
    """How often each worker's /health and /metrics are read: the load gauges, the stall check
    and the first-token count that releases requests answered whole (0.05 s at the least)."""
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
    attention_chunk_tokens: int | None = None
    """The model's ``attention_chunk_size`` (Llama 4: 8192), for models with chunked local
    attention: vLLM's events do not carry it. None: read from ``config.json`` beside a local
    tokenizer (``tokenizer.path``), else unknown, and such groups are matched as full
    attention (never more than vLLM hits; exact for prompts within the first chunk)."""
    chat_format: str = "auto"
    """How the workers render a chat: ``template`` (the model's chat template; every model but
    GPT-OSS), ``harmony`` (vLLM renders a ``gpt_oss`` model's chats in the harmony format, and
    the router renders them the same way: router/harmony.py), ``auto`` (harmony when a local
    tokenizer's ``config.json`` says ``model_type: gpt_oss``, else for the models whose workers
    the self-check finds rendering harmony)."""
    exclude_tools_when_tool_choice_none: bool | None = None
    """As the workers' ``--exclude-tools-when-tool-choice-none``: a chat with ``tool_choice:
    "none"`` is rendered without its tools. None: learned per model by the self-check (a
    one-token chat with a tool and ``tool_choice: "none"``)."""
    harmony_start_date: str | None = None
    """As the workers' ``VLLM_SYSTEM_START_DATE``: the date harmony's system message carries
    (null: today, as a worker without it renders)."""
    harmony_system_instructions: bool = False
    """As the workers' ``VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS``: system messages go into
    harmony's system message rather than its developer message."""
    prefix_cache_retention_interval: int | None = 0
    """As the workers' ``--prefix-cache-retention-interval``: which sliding-window and Mamba
    blocks vLLM keeps (0, its default: at replay boundaries and junctions; N: also every N
    tokens; null: all). What a prediction made before an engine's events arrive credits there
    (router/speculative.py), for workers whose /metrics does not report it
    (``vllm:cache_config_info``); the index follows the events either way."""


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
    op_timeout_s: float = 0.1
    """Socket timeout of one ordinary Redis operation (abandoned after twice this); the first
    one over it marks Redis down. A Redis in another zone, or a loaded one, needs more."""


class SessionConfig(_Section):
    """Session affinity (router/sessions.py)."""

    mode: str = "soft"
    """off, soft (the last turn's engine is credited its prompt as a hit) or hard (pinned)."""
    header: str = "x-session-id"
    user_field: bool = True
    """Also take the session from the OpenAI ``user`` field when the header is absent."""
    ttl_s: float = 600.0
    max_sessions: int = 100_000


class AdmissionConfig(_Section):
    """The router-side admission queue (router/admission.py); off while the threshold is null."""

    queued_prefill_tokens_threshold: int | None = None
    """A request waits while every engine serving its model has at least this many prefill
    tokens queued (this router's and the other replicas'); null: admission off."""
    max_queue: int = 1000
    """Requests waiting at most; a request arriving past it gets 429 at once."""
    max_wait_s: float = 30.0
    """A request still waiting after this long gets 429."""
    retry_after_s: float = 1.0
    """Retry-After of a 429 until the queue has been seen draining (then: the time the
    requests ahead take at the observed rate)."""
    order: str = "fair"
    """Within a priority: ``fair`` (API keys in turn, first come first served within a key) or
    ``shortest_prompt`` (the smallest request body first, for mean TTFT on engines that each
    serve first come first served; docs/benchmarks.md has the A/B)."""
    shortest_first_max_wait_s: float = 5.0
    """With ``order: shortest_prompt``, a request waiting this long goes ahead of every later
    arrival: the most any request is passed over by shorter ones."""


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
    admission: AdmissionConfig = msgspec.field(default_factory=AdmissionConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)


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
    validate(cfg)
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


def upstream_api_key(cfg: Config) -> str | None:
    """``server.upstream_api_key``, or the content of ``server.upstream_api_key_file``."""
    s = cfg.server
    if s.upstream_api_key_file is None:
        return s.upstream_api_key
    with open(s.upstream_api_key_file) as f:
        return f.read().strip()
