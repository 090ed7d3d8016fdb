"""The architecture's hard lines: the server (and the engine facade it talks to), tokenizer, KV cache manager,
scheduler and the data contracts never import torch; and every import runs down the layers below, so there is no
import cycle and no upward arrow between the package's parts."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    "module",
    ["tokenmill.server.app", "tokenmill.server.openai_routes", "tokenmill.server.routes", "tokenmill.server.state",
     "tokenmill.server.streaming", "tokenmill.server.models_registry", "tokenmill.engine.async_engine",
     "tokenmill.tokenizer", "tokenmill.kv_cache", "tokenmill.scheduler", "tokenmill.sampling_params",
     "tokenmill.types"],
)  # fmt: skip
def test_module_does_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


# tokenmill's parts from the bottom up: a part imports only parts of lower layers (a lazy import inside a function
# counts too). Two parts of one layer never import each other.
LAYERS = [
    ["errors", "progress", "sampling_params", "pooling_params", "outputs", "memory", "reaper"],
    ["types", "kv_cache"],
    [
        "config",
        "model_config",
        "tokenizer",
        "kernels",
        "metrics",
        "structured_output",
        "step_plan",
        "fault_hooks",
        "pooling_share",
    ],
    ["attention", "sampling", "scheduler"],
    ["models"],
    ["weights", "make_model", "cuda_graphs"],
    ["forward"],  # the forward paths a runner chooses among
    ["runner"],
    ["assembly"],  # loads a model and wires its KV backend, KV manager and runner
    ["spec_decode", "tensor_parallel"],
    ["engine", "quality"],
    ["parallel"],  # Ray replicas: whole engines
    ["__init__"],  # the package's public names (LLM, SamplingParams, ...)
    ["server", "bench", "engine_flags"],  # engine_flags: EngineConfig's fields as flags
    ["make_model_cli"],  # `tokenmill make-model`'s flags and command
    ["cli"],
    ["__main__"],
]
PACKAGE = Path(__file__).resolve().parents[2] / "src" / "tokenmill"


def _part(module: str) -> str:
    """tokenmill.a.b -> "a"; the package itself -> "__init__"."""
    bits = module.split(".")
    if len(bits) == 1 or (not (PACKAGE / bits[1]).exists() and not (PACKAGE / f"{bits[1]}.py").exists()):
        return "__init__"  # `from tokenmill import LLM`
    return bits[1]


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tokenmill":
            found += [node.module] if node.module != "tokenmill" else [f"tokenmill.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "tokenmill"]
    return found


def test_every_import_runs_down_the_layers() -> None:
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    parts = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert parts == set(layer), (
        f"parts without a layer: {parts - set(layer)}; layers without a part: {set(layer) - parts}"
    )
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        for module in _imports(path):
            other = _part(module)
            if other != me and layer[other] >= layer[me]:
                wrong.append(f"{path.relative_to(PACKAGE)} imports {module} (layer {layer[me]} -> {layer[other]})")
    assert not wrong, "\n".join(wrong)
