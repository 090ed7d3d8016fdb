"""The non-OpenAI endpoints: /health, /metrics, /stats, /v1/models, /tokenize, /detokenize and /generate
(tokenmill's own streaming endpoint that reports per-request timing and memory).

Must not import torch.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.request_stream import EngineDeadError, RequestFailedError
from tokenmill.metrics import peak_rss_mb, rss_mb
from tokenmill.server.errors import APIError, bad_value, error_body
from tokenmill.server.protocol import DetokenizeRequest, GenerateRequest, TokenizeRequest
from tokenmill.server.state import ServerState, get_state, ready_engine
from tokenmill.server.streaming import sse

router = APIRouter()
State = Annotated[ServerState, Depends(get_state)]
Engine = Annotated[AsyncEngine, Depends(ready_engine)]


@router.get("/health")
async def health(state: State) -> Response:
    """One model served alone: 200 once it is loaded and its engine runs; with data-parallel replicas, 200 with
    `{"status": "degraded"}` while fewer serve than were asked for, and 503 while none does (all restarting).
    Several models: 200 while the server is up (a model's own state is in /v1/models)."""
    models = state.models
    if not models.keep_loaded:
        return Response(status_code=200)
    engine = models.engine(models.names[0])
    if engine is None or not engine.is_healthy:
        return JSONResponse({"status": "loading" if engine is None else "engine not running"}, status_code=503)
    fleet = getattr(engine, "replica_states", None)
    if fleet is None:
        return Response(status_code=200)
    states = fleet().values()
    serving = sum(s.serving for s in states)
    if serving == len(states):
        return Response(status_code=200)
    body = {"status": "degraded" if serving else "no replica serving", "replicas_serving": serving,
            "replicas": len(states)}  # fmt: skip
    return JSONResponse(body, status_code=200 if serving else 503)


@router.get("/metrics")
async def metrics(state: State) -> Response:
    if state.metrics is None:
        raise APIError(503, "the model is still loading")
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/stats")
async def stats(state: State) -> dict[str, Any]:
    """One model served alone: its engine's numbers (503 while it loads). Several: each model's state, and the
    numbers of those loaded."""
    models = state.models
    if models.keep_loaded:
        async with state.lease(None) as engine:
            return _stats(engine)
    by_model = {}
    for name in models.names:
        loaded = models.engine(name)
        by_model[name] = {"status": models.status(name), **(_stats(loaded) if loaded is not None else {})}
    return {"models": by_model}


def _stats(engine: AsyncEngine) -> dict[str, Any]:
    s = engine.snapshot()
    replicas = getattr(engine, "replicas", None)  # data parallel: each replica's process and state
    return {
        **({"replicas": replicas()} if replicas is not None else {}),
        "running": s.running,
        "waiting": s.waiting,
        "kv_blocks_total": s.kv_blocks_total,
        "kv_blocks_used": s.kv_blocks_total - s.kv_blocks_free,
        "kv_blocks_free": s.kv_blocks_free,
        "kv_cache_usage": s.kv_usage,
        "prefix_cache_queries": s.prefix_cache_queries,
        "prefix_cache_hits": s.prefix_cache_hits,
        "prefix_cache_hit_rate": s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
        "prefix_cache_hits_by_tier": s.prefix_cache_hits_by_tier,
        "prefix_cache_tier_bytes": s.prefix_cache_tier_bytes,
        "avg_batch_size": s.mean_batch_size,
        "max_batch_size": s.max_batch_size,
        "num_steps": s.num_steps,
        "completed_requests": s.num_completed,
        "aborted_requests": s.num_aborted,
        "failed_requests": s.num_failed,
        "preemptions": s.num_preemptions,
        "prompt_tokens": s.prompt_tokens,
        "generation_tokens": s.generation_tokens,
    }


def _card(state: ServerState, name: str) -> dict[str, Any]:
    """OpenAI's model object, with the model's state beside it (`status`: loaded, loading or unloaded, as
    llama.cpp's router and Ollama show it), its max_model_len once known, and its last failed load's error."""
    return {"id": name, "object": "model", "created": state.created, "owned_by": "tokenmill",
            **state.models.card(name)}  # fmt: skip


def _adapter_cards(state: ServerState) -> list[dict[str, Any]]:
    """A card per LoRA adapter served, its `parent` its base model (as vLLM lists them)."""
    cards = []
    for base in state.models.names:
        engine = state.models.engine(base)
        for name, path in getattr(engine, "lora_adapters", list)():  # (none unloaded, nor data-parallel replicas)
            cards.append({**_card(state, base), "id": name, "root": path, "parent": base})
    return cards


@router.get("/v1/models")
async def models(state: State) -> dict[str, Any]:
    """Every served model with its `status` (nothing is loaded for this), then each LoRA adapter with its `parent`."""
    return {"object": "list", "data": [*(_card(state, name) for name in state.models.names), *_adapter_cards(state)]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, state: State) -> dict[str, Any]:
    """`client.models.retrieve(id)`: a served model's or a LoRA adapter's card, or 404 for any other id."""
    card = next((c for c in _adapter_cards(state) if c["id"] == model_id), None)
    return card or _card(state, state.model_name(model_id))


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: State, engine: Engine) -> dict[str, Any]:
    state.check_model(body.model)
    tok = engine.tokenizer
    if body.messages is not None:
        try:
            tokens = await run_in_threadpool(tok.apply_chat_template, [m.as_template_dict() for m in body.messages],
                                             body.add_generation_prompt)  # fmt: skip
        except ValueError as e:
            raise bad_value(e) from None
    elif body.prompt is not None:
        tokens = await run_in_threadpool(tok.encode, body.prompt, body.add_special_tokens)
    else:
        raise APIError(400, "give either prompt or messages", param="prompt")
    return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: State, engine: Engine) -> dict[str, Any]:
    state.check_model(body.model)
    vocab = engine.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of range: allowed [0, {vocab - 1}]", param="tokens")
    return {"prompt": await run_in_threadpool(engine.tokenizer.decode, body.tokens, False)}


@router.post("/generate")
async def generate(body: GenerateRequest, state: State, engine: Engine) -> StreamingResponse:
    state.admit(engine, 1)
    rss_start = rss_mb()
    start = time.perf_counter()
    prompt_ids = await run_in_threadpool(engine.tokenizer.encode, body.prompt)
    tokenization_ms = (time.perf_counter() - start) * 1000
    try:
        params = replace(engine.default_sampling_params(), max_tokens=body.max_tokens)
        if body.temperature is not None:
            params = replace(params, temperature=body.temperature)
        stream = engine.add_request(prompt_ids, params, arrival_time=start, tokenization_ms=tokenization_ms)
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
                    yield sse({"text": out.new_text[0]})
        except (RequestFailedError, EngineDeadError) as e:
            yield sse(error_body(500, f"generation failed: {e}"), event="error")
            return
        finally:
            stream.close()
        if final is None or final.metrics is None:
            return
        m, end, rss_end = final.metrics, time.perf_counter(), rss_mb()
        if state.metrics is not None:
            state.metrics.observe_finished(m, [c.finish_reason for c in final.outputs], state.name_of(engine))
        if state.tracer is not None:
            state.tracer.finished(final, state.name_of(engine))
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
            "peak_rss_mb": max(peak_rss_mb(), rss_start, rss_end),
            "rss_end_mb": rss_end,
            # speculative decoding: drafts verified and kept for this request (0 and 0 when off)
            "spec_draft_tokens": m.num_draft_tokens,
            "spec_accepted_tokens": m.num_accepted_tokens,
        }
        yield sse(done, event="done")

    return StreamingResponse(events(), media_type="text/event-stream")
