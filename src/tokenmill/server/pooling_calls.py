"""One HTTP call's pooling requests (embeddings, rerank, score): the task and size checks, admission by load, every
prompt added at once (all validated before any starts), and their pooled vectors collected in order.

Must not import torch.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from fastapi import Request

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.pooling_params import PoolingConfig, PoolingParams, PoolingTask
from tokenmill.server.errors import APIError, bad_value
from tokenmill.server.state import ServerState
from tokenmill.server.streaming import Call, run_to_end

_HOW_TO_SERVE = {
    "embed": "serve an embedding model, or this one with --task embed (--task generate,embed: both)",
    "score": "serve a reranker with --task score (a *ForSequenceClassification, or a causal yes/no reranker such as "
    "Qwen3-Reranker)",
}


@dataclass
class PooledCall:
    id: str
    created: int
    vectors: list[list[float]]  # one per prompt, in order
    num_prompt_tokens: int

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.num_prompt_tokens, "total_tokens": self.num_prompt_tokens}


def pooling_of(engine: AsyncEngine, task: PoolingTask, field: str = "model") -> PoolingConfig:
    """The model's pooling, where it is served for `task`; else a 400 saying how to serve it."""
    pooling = engine.task.pooling
    if pooling is None or pooling.task != task:
        hint = _HOW_TO_SERVE[task]
        raise APIError(400, f"this model is served for {', '.join(engine.task.names)}, not {task}: {hint}",
                       param=field)  # fmt: skip
    return pooling


def check_count(state: ServerState, count: int, field: str) -> None:
    """A call may not ask for unbounded work: at least one input, at most --max-pooling-inputs."""
    limit = state.config.max_pooling_inputs
    if count < 1:
        raise APIError(400, f"{field} must not be empty", param=field)
    if count > limit:
        raise APIError(400, f"{field} holds {count} inputs: allowed at most {limit} (--max-pooling-inputs)",
                       param=field)  # fmt: skip


async def run_pooling(
    state: ServerState, engine: AsyncEngine, raw: Request, id_prefix: str, prompts: list[list[int]],
    params: PoolingParams, priority: int,
) -> PooledCall:  # fmt: skip
    """Pool every prompt (one engine request each) and wait for all; the client going away aborts them."""
    state.admit(engine, len(prompts))
    call_id = id_prefix + uuid.uuid4().hex
    try:
        streams = engine.add_pooling_requests(prompts, params, [f"{call_id}-{i}" for i in range(len(prompts))],
                                              priority)  # fmt: skip
    except ValueError as e:
        raise bad_value(e) from None
    call = Call(id_prefix.rstrip("-"), call_id, state.name_of(engine), prompts, streams, 1, int(time.time()),
                state.metrics)  # fmt: skip
    finals = await run_to_end(call, raw)
    vectors = []
    for i in range(len(prompts)):
        pooled = finals[i].pooled
        if pooled is None:  # aborted: the server is shutting down
            raise APIError(503, "the request was aborted before it finished; retry", headers={"Retry-After": "1"})
        vectors.append(pooled.data)
    return PooledCall(call_id, call.created, vectors, sum(len(p) for p in prompts))
