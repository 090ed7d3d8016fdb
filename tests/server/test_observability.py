"""What a server tells its operators: `--log-format json` (one JSON object per line, the access log included, the
request id on the lines written while serving a request) and `--otlp-traces-endpoint` (a trace per request,
received here by a tiny OTLP/HTTP receiver: a span per request with its phases as child spans). A server without
the flag never imports OpenTelemetry's SDK."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server.helpers import Server, running

pytest.importorskip("opentelemetry.sdk", reason="OpenTelemetry is not installed: pip install 'tokenmill[otel]'")


class _Receiver(BaseHTTPRequestHandler):
    bodies: list[bytes]

    def do_POST(self) -> None:
        self.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        return


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[str, list[bytes]]]:
    bodies: list[bytes] = []
    handler = type("Receiver", (_Receiver,), {"bodies": bodies})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1/traces", bodies
    httpd.shutdown()


@pytest.fixture(scope="module")
def observed(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory,
             receiver: tuple[str, list[bytes]]) -> Iterator[Server]:  # fmt: skip
    flags = ("--log-format", "json", "--log-level", "debug", "--otlp-traces-endpoint", receiver[0])
    with running(checkpoint, tmp_path_factory.mktemp("observed"), *flags) as server:
        yield server


def _spans(bodies: list[bytes]) -> list[Any]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans = []
    for body in bodies:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        spans += [s for r in request.resource_spans for scope in r.scope_spans for s in scope.spans]
    return spans


def _attrs(span: Any) -> dict[str, Any]:
    def value(v: Any) -> Any:
        kind = v.WhichOneof("value")
        return [value(x) for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)

    return {a.key: value(a.value) for a in span.attributes}


def test_a_request_is_one_trace_with_its_phases(observed: Server, receiver: tuple[str, list[bytes]]) -> None:
    client = openai.OpenAI(base_url=f"{observed.url}/v1", api_key="x", timeout=60, max_retries=0)
    done = client.completions.create(model=observed.model, prompt=[11, 12, 13], max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    request_id = f"{done.id}-0"  # the call's first prompt
    deadline = time.monotonic() + 60  # the SDK sends its batch from its own thread, every half second
    while not any(s.name == "llm_request" and _attrs(s)["gen_ai.request.id"] == request_id
                  for s in _spans(receiver[1])):  # fmt: skip
        assert time.monotonic() < deadline, "no span for the request reached the receiver"
        time.sleep(0.1)  # bounded polling
    spans = _spans(receiver[1])
    root = next(s for s in spans if s.name == "llm_request" and _attrs(s)["gen_ai.request.id"] == request_id)
    attrs = _attrs(root)
    assert attrs["gen_ai.usage.prompt_tokens"] == 3 and attrs["gen_ai.usage.completion_tokens"] == 5, attrs
    assert attrs["gen_ai.response.finish_reasons"] == ["length"], attrs
    children = sorted((s for s in spans if s.parent_span_id == root.span_id), key=lambda s: s.start_time_unix_nano)
    assert [c.name for c in children] == ["queue", "prefill", "decode", "detokenize"]
    assert all(c.trace_id == root.trace_id for c in children)
    assert root.start_time_unix_nano <= children[0].start_time_unix_nano
    assert children[-1].end_time_unix_nano <= root.end_time_unix_nano
    for before, after in itertools.pairwise(children):
        assert before.end_time_unix_nano == after.start_time_unix_nano  # the phases follow one another


def test_json_logs_one_object_per_line(observed: Server) -> None:
    client = openai.OpenAI(base_url=f"{observed.url}/v1", api_key="x", timeout=60, max_retries=0)
    done = client.completions.create(model=observed.model, prompt=[20, 21], max_tokens=2)
    deadline = time.monotonic() + 30
    while "POST /v1/completions" not in observed.log_tail(1_000_000):  # the access line is written after the reply
        assert time.monotonic() < deadline, observed.log_tail()
        time.sleep(0.05)  # bounded polling
    lines = [json.loads(line) for line in observed.log_tail(1_000_000).splitlines() if line.strip()]
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines), lines[:5]
    assert any(line["logger"] == "uvicorn.access" and "POST /v1/completions" in line["message"] for line in lines)
    assert any(line.get("request_id") == done.id for line in lines), [line for line in lines if "request_id" in line]


def test_no_opentelemetry_sdk_without_the_flag() -> None:
    # (FastAPI itself imports opentelemetry's API where it is installed; the SDK and the exporter are ours)
    code = ("import sys, tokenmill.cli, tokenmill.server.launch, tokenmill.server.app; "
            "sys.exit(any(m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter', 'tokenmill.server.tracing')) "
            "for m in sys.modules))")  # fmt: skip
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
