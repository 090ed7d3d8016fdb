"""`POST /v1/rerank` (also `/rerank`, `/v2/rerank`: the Cohere/Jina shape that vLLM and llama-server serve) and
`POST /v1/score` (also `/score`: vLLM's). Each (query, document) pair is one pooling request: the model's scorer
reads the prompt engine/scoring.py makes of it. An embedding model scores too, as vLLM's bi-encoders do: the cosine
of the two texts' embeddings.

Must not import torch.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.scoring import score_pairs, score_prompt
from tokenmill.pooling_params import PoolingParams
from tokenmill.server.errors import APIError
from tokenmill.server.pooling_calls import PooledCall, check_count, pooling_of, run_pooling
from tokenmill.server.pooling_protocol import RerankRequest, ScoreRequest
from tokenmill.server.state import ServerState, get_state, ready_engine

router = APIRouter()
State = Annotated[ServerState, Depends(get_state)]
Engine = Annotated[AsyncEngine, Depends(ready_engine)]


@router.post("/v1/rerank")
@router.post("/v2/rerank")
@router.post("/rerank")
async def rerank(body: RerankRequest, raw: Request, state: State, engine: Engine) -> dict[str, Any]:
    state.check_model(body.model, adapters=False)
    docs = [d if isinstance(d, str) else d.text for d in body.documents]
    check_count(state, len(docs), "documents")
    if body.top_n is not None and body.top_n < 0:
        raise APIError(400, f"top_n={body.top_n} is invalid: allowed an integer >= 0 (0: every document, as vLLM)",
                       param="top_n")  # fmt: skip
    pairs = [(body.query, d) for d in docs]
    scores, call = await _scores(state, engine, raw, "rerank-", pairs, body.instruction, body.priority)
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[: body.top_n or None]
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": docs[i]}} if body.return_documents
                                                               else {})} for i in order]  # fmt: skip
    return {"id": call.id, "model": state.name_of(engine), "usage": call.usage(), "results": results}


@router.post("/v1/score")
@router.post("/score")
async def score(body: ScoreRequest, raw: Request, state: State, engine: Engine) -> dict[str, Any]:
    state.check_model(body.model, adapters=False)
    try:
        pairs = score_pairs(body.text_1, body.text_2)
    except ValueError as e:
        raise APIError(400, str(e), param="text_2") from None
    check_count(state, len(pairs), "text_2")
    scores, call = await _scores(state, engine, raw, "score-", pairs, body.instruction, body.priority)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    usage = {**call.usage(), "completion_tokens": 0}
    return {"id": call.id, "object": "list", "created": call.created, "model": state.name_of(engine),
            "data": data, "usage": usage}  # fmt: skip


async def _scores(
    state: ServerState, engine: AsyncEngine, raw: Request, id_prefix: str, pairs: list[tuple[str, str]],
    instruction: str | None, priority: int,
) -> tuple[list[float], PooledCall]:  # fmt: skip
    """One score per (query, document) pair: the scorer's, or an embedding model's cosine of the two."""
    served = engine.task.pooling
    tok = engine.tokenizer
    if served is not None and served.task == "embed":
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        prompts = await run_in_threadpool(lambda: [tok.encode(t) for t in texts])
        call = await run_pooling(state, engine, raw, id_prefix, prompts, PoolingParams(), priority)
        vectors = dict(zip(texts, call.vectors, strict=True))  # unit vectors: their dot product is the cosine
        return [sum(a * b for a, b in zip(vectors[q], vectors[d], strict=True)) for q, d in pairs], call
    pooling = pooling_of(engine, "score")
    prompts = await run_in_threadpool(lambda: [score_prompt(tok, pooling, q, d, instruction) for q, d in pairs])
    call = await run_pooling(state, engine, raw, id_prefix, prompts, PoolingParams(task="score"), priority)
    return [v[0] for v in call.vectors], call
