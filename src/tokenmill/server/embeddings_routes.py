"""`POST /v1/embeddings`: OpenAI's request and response (as the `openai` SDK's `embeddings.create` and LangChain's
`OpenAIEmbeddings` send and read them). Each input becomes one pooling request.

Must not import torch.
"""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Any, cast

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.pooling_params import PoolingParams
from tokenmill.server.errors import APIError
from tokenmill.server.pooling_calls import check_count, pooling_of, run_pooling
from tokenmill.server.pooling_protocol import EmbeddingRequest
from tokenmill.server.state import ServerState, get_state, ready_engine
from tokenmill.tokenizer import Tokenizer

router = APIRouter()
State = Annotated[ServerState, Depends(get_state)]
Engine = Annotated[AsyncEngine, Depends(ready_engine)]


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, raw: Request, state: State, engine: Engine) -> dict[str, Any]:
    state.check_model(body.model, adapters=False)
    pooling_of(engine, "embed")
    inputs = body.input
    one = isinstance(inputs, str) or (bool(inputs) and isinstance(inputs[0], int))  # a text, or one prompt's ids
    check_count(state, 1 if one else len(inputs), "input")
    try:
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
    except ValueError as e:
        raise APIError(400, str(e), param="dimensions") from None
    prompts = await run_in_threadpool(_prompts, inputs, engine.tokenizer, body.add_special_tokens)
    call = await run_pooling(state, engine, raw, "embd-", prompts, params, body.priority)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(call.vectors)]  # fmt: skip
    return {"object": "list", "data": data, "model": state.name_of(engine), "usage": call.usage()}


def _prompts(
    inputs: str | list[str] | list[int] | list[list[int]], tok: Tokenizer, add_special_tokens: bool
) -> list[list[int]]:
    """Each input's token ids; an empty input is a 400 naming it (OpenAI refuses those too)."""
    one = isinstance(inputs, str) or isinstance(inputs[0], int)  # a text, or one prompt's token ids
    items = cast("list[str | list[int]]", [inputs] if one else inputs)
    prompts = []
    for i, item in enumerate(items):
        if not item:
            raise APIError(400, f"input[{i}] is empty: every input needs at least one character or token",
                           param="input")  # fmt: skip
        prompts.append(tok.encode(item, add_special_tokens) if isinstance(item, str) else list(item))
    return prompts


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as JSON floats, or (base64) its little-endian float32 bytes in base64, as OpenAI sends them."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
