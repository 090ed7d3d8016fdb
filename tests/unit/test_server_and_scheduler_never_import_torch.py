"""The architecture's hard lines: the server (and the engine facade it talks to), tokenizer, KV cache manager,
scheduler and the data contracts never import torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module",
    ["tokenmill.server.app", "tokenmill.server.openai_routes", "tokenmill.server.routes", "tokenmill.server.state",
     "tokenmill.server.streaming", "tokenmill.engine.async_engine", "tokenmill.tokenizer", "tokenmill.kv_cache",
     "tokenmill.scheduler", "tokenmill.sampling_params", "tokenmill.types"],
)  # fmt: skip
def test_module_does_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
