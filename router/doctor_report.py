"""What ``kvrouter doctor`` found, declared once: findings, per-worker and fleet reports, the
fixes it suggests, and the two renderings (an aligned table for a person, JSON for scripts).

A finding's ``status`` is ``ok``, ``warn`` (routing stays exact, but worth knowing), ``fail``
(the fleet is not routable exactly until it is fixed) or ``skip`` (could not be checked because
an earlier check failed). The exit code is 0 only when nothing failed.
"""

from __future__ import annotations

import msgspec

__all__ = ["CHECKS", "FIX", "Finding", "Report", "WorkerReport", "render_json", "render_table"]

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"

# Row order of the table, per worker.
CHECKS = (
    "reach",
    "models",
    "tokenizer",
    "events",
    "replay",
    "usage",
    "prefix-cache",
    "block-size",
    "groups",
    "dp",
    "clock",
)

_KV_EVENTS = (
    """--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", """
    """"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'"""
)

FIX = {
    "events_off": f"vllm serve ... {_KV_EVENTS}",
    "no_sources": "kvrouter: --worker 'URL;events=tcp://HOST:5557;replay=tcp://HOST:5558' "
    f"(this vLLM has no /kv_event_sources), and vllm serve ... {_KV_EVENTS}",
    "unreachable": "let the router host reach the worker's ZMQ ports (firewall, published "
    "container ports); bind the publisher on tcp://*:PORT",
    "silent": f'vllm serve ... {_KV_EVENTS} ("publisher" must be "zmq")',
    "replay": 'add "replay_endpoint": "tcp://*:5558" to vLLM\'s --kv-events-config',
    "replay_down": "let the router host reach the worker's replay port (ROUTER socket)",
    "usage": "vllm serve ... --enable-prompt-tokens-details",
    "prefix": "vllm serve ... --enable-prefix-caching (drop --no-enable-prefix-caching)",
    "events_or_prefix": f"vllm serve ... --enable-prefix-caching {_KV_EVENTS}",
    "tokenizer": "serve the same model with the same --tokenizer and --chat-template on every "
    "worker",
    "harmony": "a GPT-OSS worker renders chats in harmony: pip install 'kvrouter[harmony]' on "
    "the router host (model.chat_format: auto finds it, or set harmony)",
    "chat": "the worker renders chat completions otherwise than its /tokenize: check its "
    "--chat-template and, for GPT-OSS, VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS against "
    "model.harmony_system_instructions",
    "block_size": "vllm serve ... --block-size N with the same N on every worker",
    "attention_chunk": "kvrouter config: model.attention_chunk_tokens: the model's "
    "attention_chunk_size (Llama 4: 8192), or tokenizer.mode local with the model folder; "
    "without it long prompts' hits are under-counted",
    "block_size_events": "events must describe whole blocks of block_size tokens: run a vLLM "
    "whose events match its --block-size",
    "dp": "let the router host reach every DP rank's ports (rank r publishes on port + r)",
    "clock": "synchronise the worker's clock (chrony / NTP)",
    "models": "if these workers should serve one model: vllm serve ... --served-model-name NAME "
    "with the same NAME on each",
    "lora": "vllm serve ... --enable-lora --lora-modules NAME=PATH on every worker of the base "
    "model, or let the router load adapters (lora.dynamic_loading)",
    "reach": "start the worker, or check the URL",
    "deadline": "raise --deadline, or check why the worker answers slowly",
}


class Finding(msgspec.Struct):
    check: str
    status: str
    detail: str
    fix: str | None = None


class WorkerReport(msgspec.Struct):
    url: str
    models: list[str] = []
    loras: list[str] = []
    dp_size: int | None = None
    block_sizes: list[int] = []
    events_endpoints: list[str] = []
    replay_endpoints: list[str] = []
    topic: str | None = None
    cached_tokens: int | None = None
    """``cached_tokens`` the worker reported for the repeated probe."""
    clock_skew_s: float | None = None
    """Event timestamp minus local clock (positive: the worker's clock is ahead)."""
    checks: list[Finding] = []

    def add(self, check: str, status: str, detail: str, fix: str | None = None) -> None:
        self.checks = [f for f in self.checks if f.check != check]
        self.checks.append(Finding(check, status, detail, fix))

    def status(self, check: str) -> str | None:
        return next((f.status for f in self.checks if f.check == check), None)

    def ordered(self) -> list[Finding]:
        rank = {c: i for i, c in enumerate(CHECKS)}
        return sorted(self.checks, key=lambda f: rank.get(f.check, len(rank)))


class Report(msgspec.Struct):
    ok: bool
    exit_code: int
    elapsed_s: float
    workers: list[WorkerReport]
    fleet: list[Finding]

    def failures(self) -> list[tuple[str, Finding]]:
        rows = [(w.url, f) for w in self.workers for f in w.checks]
        rows += [("fleet", f) for f in self.fleet]
        return [(who, f) for who, f in rows if f.status == FAIL]


def render_json(report: Report) -> str:
    return msgspec.json.format(msgspec.json.encode(report).decode(), indent=2)


def render_table(report: Report) -> str:
    """Plain text, columns aligned; every failing row is followed by its fix."""
    rows: list[tuple[str, Finding]] = []
    for w in report.workers:
        rows += [(w.url, f) for f in w.ordered()]
    rows += [("fleet", f) for f in report.fleet]
    head = ("WORKER", "CHECK", "STATUS", "DETAIL")
    widths = [max([len(head[0]), *(len(who) for who, _ in rows)])]
    widths.append(max([len(head[1]), *(len(f.check) for _, f in rows)]))
    widths.append(len(head[2]))
    indent = " " * (sum(widths) + 3 * 2)

    def line(cells: tuple[str, str, str, str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells[:3], widths, strict=True)) + (
            "  " + cells[3]
        )

    out = [line(head)]
    last = None
    for who, f in rows:
        out.append(line((who if who != last else "", f.check, f.status.upper(), f.detail)))
        last = who
        if f.fix and f.status in (FAIL, WARN):
            out.append(f"{indent}fix: {f.fix}")
    n = len(report.failures())
    verdict = (
        "routable: every check passed"
        if report.ok
        else f"NOT routable exactly: {n} failing check{'s' if n != 1 else ''}"
    )
    out.append("")
    out.append(f"{verdict} ({report.elapsed_s:.1f}s, exit {report.exit_code})")
    return "\n".join(out)
