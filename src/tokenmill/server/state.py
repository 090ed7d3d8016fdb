"""The server's state, and the FastAPI dependencies every route uses to reach it.

`ServerState` is owned by the app (`build_app` makes one and stores it on `app.state`); routes get it, an
authorized caller and a ready engine through `Depends`. It reads the engine only through the `AsyncEngine`
facade: the published snapshot for numbers, `validate`/`add_requests` for work.

Must not import torch.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field

from fastapi import Request

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.metrics import PrometheusMetrics
from tokenmill.server.errors import APIError


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_waiting_requests: int | None = None


@dataclass
class ServerState:
    config: ServerConfig
    engine: AsyncEngine | None = None  # set once, by the loader thread, when the model is ready
    load_error: BaseException | None = None
    metrics: PrometheusMetrics | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def ready_engine(self) -> AsyncEngine:
        if self.engine is None:
            raise APIError(503, "the model is still loading; retry shortly", headers={"Retry-After": "5"})
        if not self.engine.is_healthy:
            raise APIError(503, "the engine has stopped; the server must be restarted")
        return self.engine

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def admit(self, engine: AsyncEngine, num_sequences: int) -> None:
        """Refuse overload cleanly instead of queueing without bound."""
        limit = self.config.max_waiting_requests
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


def authorize(request: Request) -> None:
    key = get_state(request).config.api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')")


def ready_engine(request: Request) -> AsyncEngine:
    return get_state(request).ready_engine()
