"""LoRA adapters at run time, with vLLM's endpoints and bodies: `POST /v1/load_lora_adapter` {"lora_name",
"lora_path"} and `POST /v1/unload_lora_adapter` {"lora_name"}. The engine reads and checks the folder off its loop and
installs or removes the adapter between steps (engine/lora_registry.py); an adapter that unfinished requests use is
refused (409), never pulled from under them. Requests then name an adapter as their `model` (state.adapter_for).
Adapters are served with one MODEL only: a server of several models refuses LoRA's flags, and these routes (400).

Must not import torch.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.errors import LoraError
from tokenmill.server.errors import APIError
from tokenmill.server.state import ServerState, get_state

router = APIRouter()
State = Annotated[ServerState, Depends(get_state)]


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; ignored (adapters are found by name)


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraAdapterRequest, state: State) -> str:
    if body.lora_name == state.config.served_model_name:
        raise APIError(400, f"lora_name {body.lora_name!r} is the served model's own name; pick another",
                       param="lora_name")  # fmt: skip
    try:
        async with _lease(state) as engine:
            await _engine_call(engine, "load_lora")(body.lora_name, body.lora_path)
    except LoraError as e:
        raise APIError(e.status, str(e), param="lora_path" if e.status == 400 else "lora_name") from None
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, state: State) -> str:
    try:
        async with _lease(state) as engine:
            await _engine_call(engine, "unload_lora")(body.lora_name)
    except LoraError as e:
        raise APIError(e.status, str(e), param="lora_name") from None
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


def _lease(state: ServerState) -> AbstractAsyncContextManager[AsyncEngine]:
    """The one model's engine: adapters are served with one MODEL only (several models refuse LoRA's flags)."""
    if not state.models.keep_loaded:
        raise APIError(400, "this server serves several models, which serve no LoRA adapters; LoRA adapters are "
                       "served with one MODEL")  # fmt: skip
    return state.lease(None)


def _engine_call(engine: AsyncEngine, name: str) -> Callable[..., Awaitable[None]]:
    call: Callable[..., Awaitable[None]] | None = getattr(engine, name, None)
    if call is None:  # (data-parallel replicas, which serve no adapters)
        raise APIError(400, "this server serves no LoRA adapters: start it with --enable-lora or --lora-modules")
    return call
