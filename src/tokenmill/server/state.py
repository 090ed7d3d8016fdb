"""The server's state, and the FastAPI dependencies every route uses to reach it.

`ServerState` is owned by the app (`build_app` makes one and stores it on `app.state`); routes get it and a
ready engine through `Depends` (the API key is checked before that, by `guard.py`). The engine is the one of the
model the request names (`model_name`; the models and their engines are `ModelRegistry`'s). It reads the engine
only through the `AsyncEngine` facade: the published snapshot for numbers, `validate`/`add_requests` for work.

Must not import torch.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.metrics import PrometheusMetrics
from tokenmill.server.errors import APIError
from tokenmill.server.models_registry import ModelRegistry
from tokenmill.server.responses_store import ResponseStore


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_waiting_requests: int | None = None  # sequences queued before a request gets 503 (None: no limit)
    max_n: int = 128  # samples per request (OpenAI's own cap)
    max_prompts: int = 256  # prompts in one /v1/completions call
    max_body_bytes: int = 4 * 2**20
    public_docs: bool = False  # serve /docs and /openapi.json without the API key
    tool_call_parser: str = "auto"  # how "auto" tool calls are read: hermes | llama3_json | auto (by template)
    grammar_compile_timeout: float = 10.0  # seconds a structured-output grammar may take to compile
    responses_store_size: int = 1000  # Responses API responses kept for previous_response_id (least recent dropped)
    reasoning_parser: str = "auto"  # how reasoning is told from the answer: qwen3 | deepseek_r1 | gpt_oss | none | auto
    max_pooling_inputs: int = 2048  # inputs in one embeddings call, documents in one rerank, pairs in one score
    web_ui: bool = True  # serve the page at / and its files under /ui/ (web_ui.py), without the key


@dataclass
class ServerState:
    config: ServerConfig
    models: ModelRegistry  # the served models, their engines and states
    metrics: PrometheusMetrics | None = None
    tracer: Any = None  # tracing.RequestTracer where --otlp-traces-endpoint is given
    created: int = field(default_factory=lambda: int(time.time()))
    responses: ResponseStore = field(init=False)  # the Responses API's stored responses

    def __post_init__(self) -> None:
        self.responses = ResponseStore(self.config.responses_store_size)

    def model_name(self, model: str | None) -> str:
        """The served model a request's `model` names (for a LoRA adapter, its base model); without one, the only
        model when one is served. Any other: 404 naming the models and adapters served."""
        names = self.models.names
        if model is None and len(names) == 1:
            return names[0]
        if model in names:
            return model
        if model is None:
            raise APIError(404, f"this server serves several models; name one in `model`: {', '.join(names)}",
                           param="model", code="model_not_found")  # fmt: skip
        adapters = self.adapters()
        if model in adapters:
            return adapters[model]
        raise APIError(404, f"The model `{model}` does not exist; served: {', '.join([*names, *adapters])}.",
                       param="model", code="model_not_found")  # fmt: skip

    def check_model(self, model: str | None, adapters: bool = True) -> None:
        """404 unless `model` names a served model or (where `adapters`) a LoRA adapter of one."""
        self.adapter_for(model, adapters)

    def adapter_for(self, model: str | None, adapters: bool = True) -> str | None:
        """None for a served model (or no model given), the LoRA adapter's name for an adapter (where `adapters`: a
        generation route; else 400); 404 naming what is served otherwise."""
        base = self.model_name(model)
        if model is None or model in self.models.names:
            return None
        if adapters:
            return model
        raise APIError(400, f"`{model}` is a LoRA adapter, which applies to text generation only; use the base "
                       f"model `{base}` here", param="model")  # fmt: skip

    def adapters(self) -> dict[str, str]:
        """Each LoRA adapter served, by name, to its base model's name (only loaded models serve adapters)."""
        found: dict[str, str] = {}
        for name in self.models.names:
            engine = self.models.engine(name)
            for adapter, _ in getattr(engine, "lora_adapters", list)():  # (data-parallel replicas: none)
                found.setdefault(adapter, name)
        return found

    def lease(self, model: str | None) -> AbstractAsyncContextManager[AsyncEngine]:
        """The one place a request's `model` becomes an engine: the model it names (a LoRA adapter's base), loaded
        first if need be, and held loaded (never unloaded) until the block ends."""
        names = self.models.names
        sole = self.models.engine(names[0]) if self.models.keep_loaded else None
        if self.models.keep_loaded and (sole is None or not sole.is_healthy):
            return self.models.lease(names[0])  # not serving (503 saying why), whatever the request names
        return self.models.lease(self.model_name(model))

    def name_of(self, engine: AsyncEngine) -> str:
        """The served name of `engine`'s model (what responses carry in `model`)."""
        return self.models.name_of(engine) or self.config.served_model_name

    def admit(self, engine: AsyncEngine, num_sequences: int) -> None:
        """Refuse overload cleanly instead of queueing without bound: 400 for a request that could never be
        queued, 503 (retry later) for one that must wait for room."""
        limit = self.config.max_waiting_requests
        if limit is not None and num_sequences > limit:
            raise APIError(400, f"this request has {num_sequences} sequences (prompts x n) but the server queues at "
                           f"most {limit} (--max-waiting-requests); send fewer", param="n")  # fmt: skip
        pending = engine.num_pending
        if limit is not None and pending + num_sequences > limit:
            raise APIError(
                503, f"server overloaded: {pending} requests already waiting (limit {limit}); retry later",
                headers={"Retry-After": "1"},
            )  # fmt: skip


# -- dependencies -----------------------------------------------------------------------------------------------
def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.tokenmill
    return state


async def ready_engine(request: Request) -> AsyncIterator[AsyncEngine]:
    """The engine of the model the request names (its body's `model`, the path's model id, or `?model=`), loaded
    first if need be, and held loaded until the response has been sent."""
    async with get_state(request).lease(await _requested_model(request)) as engine:
        yield engine


async def _requested_model(request: Request) -> str | None:
    """The `model` a request names. FastAPI has read and parsed a JSON body before any dependency runs (the
    request caches it), so this costs no second parse; a body that is not a JSON object names none."""
    named = request.path_params.get("model_id") or request.query_params.get("model")
    if named is not None or request.method != "POST":
        return named
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None
