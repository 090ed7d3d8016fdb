"""The FastAPI app: lifecycle (the model loads in the background; /health says 503 until it is ready),
auth, admission control, and the non-OpenAI endpoints. The OpenAI routes live in `openai_routes.py`.

Must not import torch: it talks to the engine only through the `AsyncEngine` object it is handed.
"""

from __future__ import annotations

import hmac
import json
import logging
import resource
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import psutil
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.metrics import EngineSnapshot, PrometheusMetrics
from tokenmill.server.errors import APIError, bad_value, install_error_handlers
from tokenmill.server.protocol import DetokenizeRequest, GenerateRequest, TokenizeRequest

if TYPE_CHECKING:
    from tokenmill.engine.async_engine import AsyncEngine

log = logging.getLogger("tokenmill.server")


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_waiting_requests: int | None = None


@dataclass
class ServerState:
    config: ServerConfig
    engine: AsyncEngine | None = None
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

    def admit(self, num_sequences: int) -> None:
        """Refuse overload cleanly instead of queueing without bound."""
        limit = self.config.max_waiting_requests
        engine = self.ready_engine()
        if limit is not None and engine.num_pending + num_sequences > limit:
            raise APIError(
                503, f"server overloaded: {engine.num_pending} requests already waiting (limit {limit}); retry later",
                headers={"Retry-After": "1"},
            )  # fmt: skip

    def snapshot(self) -> EngineSnapshot:
        engine = self.engine
        if engine is None:
            return EngineSnapshot(0, 0, 0, 0, 0, 0, 0)
        core = engine.core
        kv = core.kv
        return EngineSnapshot(
            running=len(core.scheduler.running),
            waiting=engine.num_pending,
            kv_blocks_total=kv.num_blocks if kv else 0,
            kv_blocks_free=kv.num_free_blocks if kv else 0,
            prefix_cache_queries=kv.prefix_cache_queries if kv else 0,
            prefix_cache_hits=kv.prefix_cache_hits if kv else 0,
            num_preemptions=core.scheduler.num_preemptions,
        )


def _rss_mb() -> float:
    return float(psutil.Process().memory_info().rss / 2**20)


def _sse(data: Any, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


def build_app(load_engine: Callable[[], AsyncEngine], config: ServerConfig) -> FastAPI:
    """`load_engine` runs in a background thread at startup; until it returns, /health answers 503."""
    state = ServerState(config)

    def load() -> None:
        try:
            engine = load_engine()
            state.metrics = PrometheusMetrics(config.served_model_name, state.snapshot)
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

    app = FastAPI(title="tokenmill", lifespan=lifespan)
    app.state.tokenmill = state
    install_error_handlers(app)

    def authorize(request: Request) -> None:
        key = config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        expected = f"Bearer {key}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')")

    app.state.authorize = authorize

    @app.get("/health")
    async def health() -> Response:
        if state.engine is not None and state.engine.is_healthy:
            return Response(status_code=200)
        reason = "loading" if state.engine is None and state.load_error is None else "engine not running"
        return JSONResponse({"status": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            raise APIError(503, "the model is still loading")
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats", dependencies=[Depends(authorize)])
    async def stats() -> dict[str, Any]:
        engine = state.ready_engine()
        s, es = state.snapshot(), engine.core.stats
        return {
            "running": s.running,
            "waiting": s.waiting,
            "kv_blocks_total": s.kv_blocks_total,
            "kv_blocks_used": s.kv_blocks_total - s.kv_blocks_free,
            "kv_blocks_free": s.kv_blocks_free,
            "kv_cache_usage": s.kv_usage,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "prefix_cache_hit_rate": s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
            "avg_batch_size": es.mean_batch_size,
            "max_batch_size": es.max_batch_size,
            "num_steps": es.num_steps,
            "completed_requests": es.num_completed,
            "aborted_requests": es.num_aborted,
            "preemptions": s.num_preemptions,
        }

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        engine = state.ready_engine()
        max_len = engine.core.max_model_len
        card = {"id": config.served_model_name, "object": "model", "created": state.created,
                "owned_by": "tokenmill", "max_model_len": max_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.post("/tokenize", dependencies=[Depends(authorize)])
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        engine = state.ready_engine()
        state.check_model(body.model)
        tok = engine.tokenizer
        assert tok is not None
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            try:
                tokens = tok.apply_chat_template(messages)
            except ValueError as e:
                raise bad_value(e) from None
        elif body.prompt is not None:
            tokens = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "give either prompt or messages", param="prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.core.max_model_len}

    @app.post("/detokenize", dependencies=[Depends(authorize)])
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        engine = state.ready_engine()
        state.check_model(body.model)
        vocab = engine.core.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of range: allowed [0, {vocab - 1}]", param="tokens")
        assert engine.tokenizer is not None
        return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/generate", dependencies=[Depends(authorize)])
    async def generate(body: GenerateRequest) -> StreamingResponse:
        engine = state.ready_engine()
        state.admit(1)
        assert engine.loaded is not None
        rss_start = _rss_mb()
        start = time.perf_counter()
        try:
            params = replace(engine.loaded.default_sampling_params(), max_tokens=body.max_tokens)
            if body.temperature is not None:
                params = replace(params, temperature=body.temperature)
            stream = engine.add_request(body.prompt, params, arrival_time=start)
        except ValueError as e:
            raise bad_value(e) from None

        async def events() -> AsyncIterator[str]:
            final = None
            first_sent: float | None = None
            try:
                async for out in stream:
                    final = out
                    if out.new_text[0]:
                        first_sent = first_sent or time.perf_counter()
                        yield _sse({"text": out.new_text[0]})
            finally:
                stream.close()
            if final is None or final.metrics is None:
                return
            m, end, rss_end = final.metrics, time.perf_counter(), _rss_mb()
            if state.metrics is not None:
                state.metrics.observe_finished(m, [c.finish_reason for c in final.outputs])
            done = {
                "prompt_tokens": m.num_prompt_tokens,
                "completion_tokens": m.num_generated_tokens,
                "finish_reason": final.outputs[0].finish_reason,
                "tokenization_ms": m.tokenization_ms,
                "ttft_ms": m.ttft_ms,
                "prefill_ms": m.prefill_ms,
                "stream_time_ms": (end - (first_sent or end)) * 1000,
                "total_time_ms": (end - start) * 1000,
                "decode_tokens_per_sec": m.decode_tokens_per_sec or 0.0,
                "rss_start_mb": rss_start,
                "peak_rss_mb": max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, rss_start, rss_end),
                "rss_end_mb": rss_end,
            }
            yield _sse(done, event="done")

        return StreamingResponse(events(), media_type="text/event-stream")

    from tokenmill.server.openai_routes import add_openai_routes

    add_openai_routes(app, state)
    return app
