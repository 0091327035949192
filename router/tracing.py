"""OpenTelemetry spans for proxied requests: the optional extra ``tracing`` (off by default).

One server span per request, with children ``tokenize``, ``route`` and ``upstream``; the
upstream request carries the W3C ``traceparent`` (and ``tracestate``) of the ``upstream`` span,
so vLLM's own spans (``--otlp-traces-endpoint``) join the same trace. An incoming
``traceparent`` continues the client's trace. Spans are exported over OTLP/HTTP by a batch
processor on its own thread.

The request path holds a :class:`RequestTrace` or None: with ``tracing.enabled`` false,
:func:`make_tracer` returns None and nothing here imports OpenTelemetry, so a request costs a
few None checks. The SDK is imported only by :class:`Tracer`.

The tracer provider is the router's own, never the global one: FastAPI instruments every
request itself as soon as a global provider is set (a second server span around ours), and
tests run several routers in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import msgspec

if TYPE_CHECKING:
    from router.policy import Decision
    from router.proxy import Outcome
    from router.tokenize import Tokenized

__all__ = ["INSTALL_HINT", "RequestTrace", "Tracer", "TracingConfig", "config_problem"]

INSTALL_HINT = "pip install 'kvrouter[tracing]'"

_PROPAGATED = (b"traceparent", b"tracestate")


class TracingConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The ``tracing`` section (docs/config.md)."""

    enabled: bool = False
    endpoint: str | None = None
    """OTLP/HTTP traces URL (``http://collector:4318/v1/traces``); None: the SDK's
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``, else localhost."""
    service_name: str | None = None
    """None: ``OTEL_SERVICE_NAME`` (or ``service.name`` of ``OTEL_RESOURCE_ATTRIBUTES``), else
    ``kvrouter``."""
    sample_ratio: float | None = None
    """Share of new traces recorded (a client's sampled flag is followed); None: the SDK's
    ``OTEL_TRACES_SAMPLER`` (default: every trace)."""
    headers: dict[str, str] = {}
    """Sent with every export (a collector's API key); empty: ``OTEL_EXPORTER_OTLP_HEADERS``."""


def config_problem(cfg: TracingConfig) -> str | None:
    """What is wrong with the section (the message names the key), or None."""
    if cfg.sample_ratio is not None and not 0.0 <= cfg.sample_ratio <= 1.0:
        return "tracing.sample_ratio: must be within [0, 1] (or null: OTEL_TRACES_SAMPLER)"
    if cfg.endpoint is not None:
        parts = urlsplit(cfg.endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return f"tracing.endpoint: {cfg.endpoint!r} is not an http(s):// OTLP/HTTP URL"
    if cfg.enabled:
        try:
            import opentelemetry.exporter.otlp.proto.http.trace_exporter
            import opentelemetry.sdk.trace  # noqa: F401
        except ImportError as exc:
            return f"tracing.enabled: OpenTelemetry is not installed ({exc.name}): {INSTALL_HINT}"
    return None


def make_tracer(cfg: TracingConfig) -> Tracer | None:
    """The router's tracer, or None when tracing is off (nothing imported then)."""
    if not cfg.enabled:
        return None
    problem = config_problem(cfg)
    if problem is not None:
        from router.config import ConfigError  # here: router.config imports this module

        raise ConfigError(problem)
    return Tracer(cfg)


class Tracer:
    """An OpenTelemetry tracer provider of the router's own, exporting over OTLP/HTTP."""

    def __init__(self, cfg: TracingConfig) -> None:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({"service.name": cfg.service_name} if cfg.service_name else {})
        if resource.attributes["service.name"].startswith("unknown_service"):
            # Neither the config nor OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES names it.
            resource = resource.merge(Resource({"service.name": "kvrouter"}))
        sampler = (
            None if cfg.sample_ratio is None else ParentBased(TraceIdRatioBased(cfg.sample_ratio))
        )
        self.provider = TracerProvider(
            sampler=sampler,
            resource=resource,
            shutdown_on_exit=False,  # Router.stop flushes it
        )
        exporter = OTLPSpanExporter(endpoint=cfg.endpoint, headers=cfg.headers or None)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("kvrouter")
        self.propagator = TraceContextTextMapPropagator()
        self.in_context: Callable[[Any], Any] = trace.set_span_in_context
        self.kinds = (trace.SpanKind.SERVER, trace.SpanKind.CLIENT)
        self.error = trace.Status(trace.StatusCode.ERROR)

    def failed(self, message: str) -> Any:
        """An error status with its message (``error.type`` stays low-cardinality)."""
        return type(self.error)(self.error.status_code, message)

    def start(self, headers: list[tuple[bytes, bytes]], path: str, request_id: str) -> RequestTrace:
        """A request's server span, continuing the client's trace when it sent a traceparent."""
        return RequestTrace(self, headers, path, request_id)

    def shutdown(self) -> None:
        """Exports what is queued and stops the exporter thread (blocks: run it off the loop)."""
        self.provider.shutdown()


class RequestTrace:
    """One request's spans. The request path calls, in order: :meth:`tokenizing`,
    :meth:`routing`, :meth:`routed`, :meth:`upstream`, then :meth:`finish` once it is answered
    (or :meth:`refused` for a request answered before it was forwarded)."""

    __slots__ = ("_ctx", "_step", "_t", "_upstream", "server")

    def __init__(
        self, t: Tracer, headers: list[tuple[bytes, bytes]], path: str, request_id: str
    ) -> None:
        self._t = t
        carrier = {k.decode(): v.decode("latin-1") for k, v in headers if k in _PROPAGATED}
        parent = t.propagator.extract(carrier) if carrier else None
        self.server: Any = t.tracer.start_span(
            f"POST {path}",
            parent,
            t.kinds[0],
            {"http.request.method": "POST", "url.path": path, "kvrouter.request_id": request_id},
        )
        self._ctx = t.in_context(self.server)
        self._step: Any = None
        """The open tokenize or route span."""
        self._upstream: Any = None

    def tokenizing(self) -> None:
        self._step = self._t.tracer.start_span("tokenize", self._ctx)

    def routing(self, tok: Tokenized | None, error: str | None) -> None:
        """Ends ``tokenize`` (when it ran) and starts ``route``."""
        span = self._step
        if span is not None and span.is_recording():
            if tok is not None:
                span.set_attributes(
                    {"kvrouter.prompt_tokens": tok.n_tokens, "kvrouter.tokenize.source": tok.source}
                )
            if error is not None:
                span.set_status(self._t.failed(error))
                span.set_attribute("error.type", "tokenize")
        if span is not None:
            span.end()
        self._step = self._t.tracer.start_span("route", self._ctx)

    def routed(self, decision: Decision, candidates: int, model: Any) -> None:
        span, self._step = self._step, None
        if span is None:
            return
        if span.is_recording():
            attrs = {
                "kvrouter.worker": decision.engine[0],
                "kvrouter.dp_rank": decision.engine[1],
                "kvrouter.predicted_hit_tokens": decision.predicted_hit_tokens,
                "kvrouter.candidates": candidates,
                "kvrouter.reason": decision.reason,
            }
            if isinstance(model, str):
                attrs["gen_ai.request.model"] = model
            span.set_attributes(attrs)
        span.end()

    def upstream(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """Starts ``upstream``; the headers for the worker carry its traceparent instead of the
        client's (which the server span continues)."""
        t = self._t
        self._upstream = t.tracer.start_span("upstream", self._ctx, t.kinds[1])
        out = [(k, v) for k, v in headers if k.lower() not in _PROPAGATED]
        carrier: dict[str, str] = {}
        t.propagator.inject(carrier, t.in_context(self._upstream))
        out.extend((k.encode(), v.encode("latin-1")) for k, v in carrier.items())
        return out

    def attempt_failed(self, engine: tuple[str, int], reason: str) -> None:
        if self._upstream is not None:
            attrs = {"kvrouter.worker": engine[0], "kvrouter.dp_rank": engine[1]}
            self._upstream.add_event("attempt failed", {**attrs, "error.type": reason})

    def finish(self, o: Outcome) -> None:
        """The request was answered: its outcome on ``upstream``, and both spans ended."""
        span, self._upstream = self._upstream, None
        if span is not None:
            if span.is_recording():
                _outcome_attributes(span, o)
                if o.status >= 500:
                    span.set_status(self._t.error)
            span.end()
        self._end_server(o.status, None)

    def refused(self, status: int, error: str) -> None:
        """Answered before (or instead of) forwarding: open spans end with the error."""
        for span in (self._step, self._upstream):
            if span is not None:
                span.set_status(self._t.failed(error))
                span.set_attribute("error.type", str(status))
                span.end()
        self._step = self._upstream = None
        self._end_server(status, error)

    def _end_server(self, status: int, error: str | None) -> None:
        span, self.server = self.server, None
        if span is None:
            return  # answered already (a refusal after the outcome)
        span.set_attribute("http.response.status_code", status)
        if status >= 400:
            span.set_attribute("error.type", str(status))  # HTTP semantic conventions
        if error is not None:
            span.set_attribute("kvrouter.error", error)
        if status >= 500:
            span.set_status(self._t.failed(error) if error is not None else self._t.error)
        span.end()


def _outcome_attributes(span: Any, o: Outcome) -> None:
    attrs: dict[str, Any] = {"http.response.status_code": o.status}
    if o.worker is not None:
        attrs["kvrouter.worker"] = o.worker
    if o.engine is not None:
        attrs["kvrouter.dp_rank"] = o.engine[1]
    if o.cached_tokens is not None:
        attrs["kvrouter.cached_tokens"] = o.cached_tokens
    if o.ttft_s is not None:
        attrs["kvrouter.ttft_s"] = o.ttft_s
    if o.prompt_tokens is not None:
        attrs["gen_ai.usage.input_tokens"] = o.prompt_tokens
    if o.completion_tokens is not None:
        attrs["gen_ai.usage.output_tokens"] = o.completion_tokens
    span.set_attributes(attrs)
