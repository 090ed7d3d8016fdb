"""tokenmill: a fast, exact, readable LLM inference engine and OpenAI-compatible server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; import it lazily so torch-free parts (tokenizer, server) stay light.
    if name == "LLM":
        from tokenmill.engine.llm import LLM

        return LLM
    raise AttributeError(name)
