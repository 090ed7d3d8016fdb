"""Property-based fuzzing of every route from the server's own /openapi.json (schemathesis): valid and invalid
bodies, a bounded number of each per operation. No request may get a 5xx, and the server stays healthy.

The context is kept short (--max-model-len 64) so a generated request is cheap whatever it asks for.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.helpers import Server

SERVER_FLAGS = ("--max-model-len", "64", "--max-n", "4", "--max-prompts", "4")
EXAMPLES_PER_OPERATION = 30


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_input_gets_a_server_error(server: Server, mode: str) -> None:
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/generate", "/tokenize"}
    failures: list[tuple[str, int, str, Any]] = []
    calls: dict[str, int] = {}
    for op in operations:
        strategy = op.as_strategy(generation_mode=GenerationMode(mode))

        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=strategy)
        def call(case: Any) -> None:
            response = case.call(base_url=server.url, timeout=60)
            where = f"{case.method.upper()} {case.path}"
            calls[case.path] = calls.get(case.path, 0) + 1
            if response.status_code >= 500:
                failures.append((where, response.status_code, response.text[:300], case.body))

        try:
            call()
        except Unsatisfiable:  # an operation with no inputs has no invalid form (GET /health)
            assert mode == "negative" and op.method.upper() == "GET", op.path
    assert not failures, failures[:5]
    assert all(calls.get(path, 0) >= 10 for path in ("/v1/completions", "/v1/chat/completions", "/generate")), calls
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
