"""The server's state, and the FastAPI dependencies every route uses to reach it.

`ServerState` is owned by the app (`build_app` makes one and stores it on `app.state`); routes get it and a
ready engine through `Depends` (the API key is checked before that, by `guard.py`). It reads the engine only
through the `AsyncEngine` facade: the published snapshot for numbers, `validate`/`add_requests` for work.

Must not import torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.metrics import PrometheusMetrics
from tokenmill.server.errors import APIError
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
    engine: AsyncEngine | None = None  # set once, by the loader thread, when the model is ready
    load_error: BaseException | None = None
    metrics: PrometheusMetrics | None = None
    tracer: Any = None  # tracing.RequestTracer where --otlp-traces-endpoint is given
    created: int = field(default_factory=lambda: int(time.time()))
    responses: ResponseStore = field(init=False)  # the Responses API's stored responses

    def __post_init__(self) -> None:
        self.responses = ResponseStore(self.config.responses_store_size)

    def ready_engine(self) -> AsyncEngine:
        if self.engine is None:
            raise APIError(503, "the model is still loading; retry shortly", headers={"Retry-After": "5"})
        if not self.engine.is_healthy:
            raise APIError(503, "the engine has stopped; the server must be restarted")
        fleet = getattr(self.engine, "replica_states", None)  # data parallel: replicas may be restarting
        if fleet is not None and not any(s.serving for s in fleet().values()):
            raise APIError(503, "no engine replica is serving (they are restarting); retry shortly",
                           headers={"Retry-After": "5"})  # fmt: skip
        return self.engine

    def check_model(self, model: str | None, adapters: bool = True) -> None:
        """404 unless `model` names the served model or (where `adapters`) one of its LoRA adapters."""
        self.adapter_for(model, adapters)

    def adapter_for(self, model: str | None, adapters: bool = True) -> str | None:
        """The one place a request's `model` is resolved: None for the served model (or no model given), the LoRA
        adapter's name for an adapter of it (where `adapters`: a generation route); 404 naming what is served
        otherwise."""
        served = self.config.served_model_name
        if model is None or model == served:
            return None
        engine = self.engine
        names = [name for name, _ in getattr(engine, "lora_adapters", list)()]  # (data-parallel replicas: none)
        if model in names:
            if adapters:
                return model
            raise APIError(400, f"`{model}` is a LoRA adapter, which applies to text generation only; use the base "
                           f"model `{served}` here", param="model")  # fmt: skip
        raise APIError(404, f"The model `{model}` does not exist; served: {', '.join([served, *names])}.",
                       param="model", code="model_not_found")  # fmt: skip

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


def ready_engine(request: Request) -> AsyncEngine:
    return get_state(request).ready_engine()
