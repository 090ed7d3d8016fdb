"""The FastAPI app: lifecycle (the model loads in a background thread; /health says 503 until it is ready),
the request guard (guard.py), error handlers, and the routers (`routes.py`: health, metrics, stats, models,
tokenize, /generate; `openai_routes.py`: completions and chat; `anthropic_routes.py`: Anthropic's messages;
`responses_routes.py`: OpenAI's Responses API; `embeddings_routes.py` and `score_routes.py`: embeddings, rerank and
score; `lora_routes.py`: loading and unloading LoRA adapters; `web_ui.py`: the web page at /).

Must not import torch: it talks to the engine only through the `AsyncEngine` it is handed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.metrics import PrometheusMetrics
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
from tokenmill.server.state import ServerConfig, ServerState

log = logging.getLogger("tokenmill.server")


def build_app(load_engine: Callable[[], AsyncEngine], config: ServerConfig, tracer: Any = None) -> FastAPI:
    """`load_engine` runs in a background thread at startup; until it returns, /health answers 503. `tracer`: a
    `tracing.RequestTracer` that records every finished request, or None."""
    state = ServerState(config, tracer=tracer)

    def load() -> None:
        try:
            engine = load_engine()
            replicas = getattr(engine, "replica_snapshots", None)  # data parallel: per-replica engine numbers
            fleet = getattr(engine, "replica_states", None)  # and whether each serves, and its restarts
            state.metrics = PrometheusMetrics(config.served_model_name, engine.snapshot, replicas, fleet)
            state.engine = engine
        except BaseException as e:
            log.exception("loading the model failed")
            state.load_error = e

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loader = threading.Thread(target=load, name="tokenmill-load", daemon=True)
        loader.start()
        yield
        if state.engine is not None:
            state.engine.shutdown()
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
