"""tokenmill: a fast, exact, readable LLM inference engine and OpenAI-compatible server."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# OpenMP workers that spin after every parallel region fight the engine's own threads and every other process
# for the cores: on a busy 2-core machine that cost 2-4x (docs/archive/benchmark-log-2026-11.md, the Zen 3
# sitting's "Fixed overhead per step"). Set before torch loads its OpenMP runtime, which reads it once; a value
# set by the user wins. TOKENMILL_OMP_DEFAULT=0 leaves it alone: `bench compare` runs its peers (llama.cpp,
# transformers) in the environment their own users have.
USER_OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")
if os.environ.get("TOKENMILL_OMP_DEFAULT") != "0":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tokenmill.outputs import CompletionOutput, RequestOutput  # noqa: E402
from tokenmill.pooling_params import PoolingParams  # noqa: E402
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

if TYPE_CHECKING:
    from tokenmill.engine.llm import LLM, LoRARequest

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "LoRARequest", "PoolingParams", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]  # fmt: skip


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; import it lazily so torch-free parts (tokenizer, server) stay light.
    if name in ("LLM", "LoRARequest"):
        from tokenmill.engine import llm

        return getattr(llm, name)
    raise AttributeError(name)
