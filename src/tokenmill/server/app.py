"""The FastAPI app: lifecycle (the models and their loading are `ModelRegistry`'s: one model given alone loads at
start, and /health says 503 until it is ready; several load on demand),
the request guard (guard.py), error handlers, and the routers (`routes.py`: health, metrics, stats, models,
tokenize, /generate; `openai_routes.py`: completions and chat; `anthropic_routes.py`: Anthropic's messages;
`responses_routes.py`: OpenAI's Responses API; `embeddings_routes.py` and `score_routes.py`: embeddings, rerank and
score; `lora_routes.py`: loading and unloading LoRA adapters; `web_ui.py`: the web page at /).

Must not import torch: it talks to the engine only through the `AsyncEngine` it is handed.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.metrics import EngineSnapshot, PrometheusMetrics
from tokenmill.server import (
    anthropic_routes,
    embeddings_routes,
    lora_routes,
    openai_routes,
    responses_routes,
    routes,
    score_routes,
    web_ui,
)
from tokenmill.server.errors import install_error_handlers
from tokenmill.server.guard import RequestGuard
from tokenmill.server.models_registry import ModelRegistry
from tokenmill.server.state import ServerConfig, ServerState

log = logging.getLogger("tokenmill.server")


def build_app(models: ModelRegistry, config: ServerConfig, tracer: Any = None) -> FastAPI:
    """`models`: what the server serves; the registry starts (and a `keep_loaded` model loads) with the app.
    `tracer`: a `tracing.RequestTracer` that records every finished request, or None."""
    state = ServerState(config, models, tracer=tracer)
    if models.keep_loaded:
        models.on_loaded = lambda name, engine: _engine_metrics(state, name, engine)
    else:
        state.metrics = PrometheusMetrics(models.names, lambda: _by_model(models.snapshots()))
        state.metrics.track_models(models.states)
        models.metrics = state.metrics

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        models.start()
        yield
        models.shutdown()
        if tracer is not None:
            tracer.shutdown()

    app = FastAPI(title="tokenmill", lifespan=lifespan)
    app.state.tokenmill = state
    install_error_handlers(app)
    app.add_middleware(RequestGuard, state=state)  # auth, body size, and no exception past it (guard.py)
    app.include_router(routes.router)
    app.include_router(openai_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(embeddings_routes.router)
    app.include_router(score_routes.router)
    app.include_router(lora_routes.router)
    if config.web_ui:
        web_ui.install(app)
    return app


def _engine_metrics(state: ServerState, name: str, engine: AsyncEngine) -> None:
    """One model served alone: its metrics, once it has loaded (a data-parallel one's numbers by replica)."""
    replicas = getattr(engine, "replica_snapshots", None)  # data parallel: per-replica engine numbers
    by_replica = replicas or (lambda: {"": engine.snapshot()})
    fleet = getattr(engine, "replica_states", None)  # and whether each serves, and its restarts
    state.metrics = PrometheusMetrics([name], lambda: {(name, r): s for r, s in by_replica().items()},
                                      replicas is not None, fleet)  # fmt: skip


def _by_model(snapshots: dict[str, EngineSnapshot]) -> dict[tuple[str, str], EngineSnapshot]:
    return {(name, ""): s for name, s in snapshots.items()}
