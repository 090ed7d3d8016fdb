"""OpenTelemetry traces, one per engine request, when `--otlp-traces-endpoint` is given (extra `tokenmill[otel]`).

Only launch.py imports this module, and only when the flag is set: a server without it never imports opentelemetry.
A finished request becomes one span `llm_request` from its arrival to now, with child spans for the phases its
`RequestMetrics` timed: `queue` (arrival to first scheduled), `prefill` (to the first token), `decode` (to the
last token) and `detokenize` (from the last token to the server holding its text: the output processor turns
tokens into text as they come, so this is what remained after the last one). Attributes follow vLLM's
`gen_ai.*` names: the request id, prompt and completion tokens, cached tokens, finish reasons. Spans go out in
batches from the SDK's own thread (OTLP over HTTP/protobuf).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from tokenmill.outputs import RequestOutput


def _exporter(endpoint: str) -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ValueError("--otlp-traces-endpoint needs OpenTelemetry: pip install 'tokenmill[otel]'") from None
    return OTLPSpanExporter(endpoint=endpoint)


class RequestTracer:
    def __init__(self, endpoint: str, model_name: str, exporter: Any = None) -> None:
        """`exporter`: where spans go (default: OTLP/HTTP to `endpoint`)."""
        exporter = exporter or _exporter(endpoint)
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.provider = TracerProvider(resource=Resource.create({"service.name": "tokenmill"}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        self.tracer = self.provider.get_tracer("tokenmill")
        self.model_name = model_name

    def finished(self, out: RequestOutput, model: str | None = None) -> None:
        """Record one finished request (called once, with its final output) of `model` (default: the one served)."""
        m = out.metrics
        if m is None:
            return
        now_perf, now_ns = time.perf_counter(), time.time_ns()

        def ns(t: float) -> int:  # a perf_counter time (any process on this machine: one monotonic clock) to epoch ns
            return now_ns - int((now_perf - t) * 1e9)

        attrs: dict[str, Any] = {"gen_ai.request.id": out.request_id, "gen_ai.response.model": model or self.model_name,
                 "gen_ai.usage.prompt_tokens": m.num_prompt_tokens,
                 "gen_ai.usage.completion_tokens": m.num_generated_tokens,
                 "gen_ai.usage.cached_tokens": m.num_cached_tokens,
                 "gen_ai.response.finish_reasons": [c.finish_reason or "unknown" for c in out.outputs]}  # fmt: skip
        root = self.tracer.start_span("llm_request", start_time=ns(m.arrival_time), attributes=attrs)
        from opentelemetry import trace

        context = trace.set_span_in_context(root)
        marks = [("queue", m.arrival_time), ("prefill", m.first_scheduled_time), ("decode", m.first_token_time),
                 ("detokenize", m.last_token_time), ("", now_perf)]  # fmt: skip
        known = [(name, t) for name, t in marks if t is not None]
        for (name, start), (_, end) in itertools.pairwise(known):
            span = self.tracer.start_span(name, context=context, start_time=ns(start),
                                          attributes={"gen_ai.request.id": out.request_id})  # fmt: skip
            span.end(end_time=ns(max(end, start)))
        root.end(end_time=now_ns)

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes what is still batched
