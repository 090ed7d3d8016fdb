"""Starting one HTTP call's engine requests, shared by every generating endpoint (OpenAI's completions and chat,
Anthropic's messages): the per-request caps, admission by load, the grammar compiled off the event loop, then
every prompt added at once.

Must not import torch.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from starlette.concurrency import run_in_threadpool

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.errors import LoraError
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import APIError, bad_value
from tokenmill.server.logs import request_id_var
from tokenmill.server.state import ServerState
from tokenmill.server.streaming import Call

log = logging.getLogger("tokenmill.server")


async def start_call(
    state: ServerState, engine: AsyncEngine, kind: str, id_prefix: str, prompts: list[list[int]],
    params: SamplingParams, priority: int, grammar_field: str | None = None, model: str | None = None,
) -> Call:  # fmt: skip
    """Check the load, compile the grammar (off the event loop, within its time limit), then start every prompt
    (all validated before any starts) on the model or LoRA adapter the body's `model` names. The call's id is
    `id_prefix` and a random hex."""
    lora = state.adapter_for(model)
    state.admit(engine, len(prompts) * params.n)
    call_id = id_prefix + uuid.uuid4().hex
    request_id_var.set(call_id)  # the log lines written while serving it name it (logs.py)
    grammar = await _compile(state, engine, params, grammar_field)
    try:
        streams = engine.add_requests(prompts, params, [f"{call_id}-{i}" for i in range(len(prompts))], priority,
                                      grammar, lora)  # fmt: skip
    except LoraError as e:  # (unloaded since the check above)
        raise APIError(e.status, str(e), param="model") from None
    except ValueError as e:
        raise bad_value(e) from None
    log.debug("started %d prompt(s), n=%d", len(prompts), params.n)
    base = state.name_of(engine)
    return Call(kind, call_id, lora or base, prompts, streams, params.n, int(time.time()), state.metrics,
                state.tracer, base_model=base)  # fmt: skip


async def _compile(state: ServerState, engine: AsyncEngine, params: SamplingParams, field: str | None) -> Any:
    if params.structured_outputs is None:
        return None
    limit = state.config.grammar_compile_timeout
    try:
        return await asyncio.wait_for(run_in_threadpool(engine.compile_grammar, params), limit)
    except ValueError as e:
        raise APIError(400, str(e), param=field) from None
    except TimeoutError:
        raise APIError(400, f"the grammar took longer than {limit:g} s to compile (--grammar-compile-timeout); "
                       "simplify it", param=field) from None  # fmt: skip


def check_sizes(state: ServerState, n: int, num_prompts: int) -> None:
    """The per-request caps, checked before any tokenizing: a request may not ask for unbounded work."""
    cfg = state.config
    if n > cfg.max_n:
        raise APIError(400, f"n={n} is invalid: allowed an integer in [1, {cfg.max_n}] (--max-n)", param="n")
    if num_prompts > cfg.max_prompts:
        raise APIError(400, f"prompt holds {num_prompts} prompts: allowed at most {cfg.max_prompts} (--max-prompts)",
                       param="prompt")  # fmt: skip
