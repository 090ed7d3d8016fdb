"""What a request may ask for: checked before it is queued, from facts fixed when the engine was built."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from tokenmill.errors import LoraError
from tokenmill.pooling_params import ModelTask, PoolingParams
from tokenmill.sampling_params import SamplingParams


class BlockPool(Protocol):
    """What the checks read of a KV manager (or of the facts a server's front end holds of it)."""

    @property
    def num_blocks(self) -> int: ...

    def num_blocks_needed(self, num_tokens: int) -> int: ...


def check_generates(task: ModelTask) -> None:
    """ValueError unless the model is served to generate text."""
    if not task.generate:
        raise ValueError(f"this model is served for {', '.join(task.names)}: it does not generate text; "
                         "serve it with --task generate")  # fmt: skip


def check_adapter(lora: str | None, loaded: Iterable[str] | None) -> None:
    """A request may name `lora`: LoraError 404 naming the loaded adapters otherwise. `loaded`: their names, None
    where the engine serves no adapters."""
    if lora is None:
        return
    if loaded is None:
        raise LoraError(f"no LoRA adapter named {lora!r}: this engine serves none (start it with --lora-modules "
                        "or --enable-lora)", status=404)  # fmt: skip
    names = list(loaded)
    if lora not in names:
        raise LoraError(f"no LoRA adapter named {lora!r} is loaded; loaded: {', '.join(names) or 'none'}", status=404)


def output_budget(
    prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int, kv: BlockPool
) -> int:
    """The request's output budget (max_tokens, capped by the context); ValueError for one that can never run."""
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise ValueError("the prompt is empty: at least one token is needed")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is out of range: allowed [0, {vocab_size - 1}]")
    bad = next((t for t in params.logit_bias or {} if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"logit_bias names token id {bad}, out of range: allowed [0, {vocab_size - 1}]")
    bad = next((t for t in params.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"stop_token_ids={params.stop_token_ids} is invalid: allowed ids in [0, {vocab_size - 1}]")
    thinking = params.thinking
    bad = next((t for t in (*thinking.start_token_ids, *thinking.end_token_ids) if not 0 <= t < vocab_size), None) \
        if thinking is not None else None  # fmt: skip
    if bad is not None:
        raise ValueError(f"thinking names token id {bad}, out of range: allowed [0, {vocab_size - 1}]")
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - num_prompt
    if max_tokens < 1 or num_prompt + max_tokens > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt + max(max_tokens, 1)} tokens ({num_prompt} in the messages, {max(max_tokens, 1)} in the "
            "completion). Please reduce the length of the prompt or the completion."
        )
    needed = kv.num_blocks_needed(num_prompt + max_tokens)
    if needed > kv.num_blocks:
        raise ValueError(
            f"this request needs {needed} KV blocks ({num_prompt} prompt + {max_tokens} completion tokens) "
            f"but the whole pool has {kv.num_blocks}; lower max_tokens or raise num_kv_blocks / "
            "kv_cache_memory_gb"
        )
    return max_tokens


def check_pooling(
    prompt_token_ids: list[int], params: PoolingParams, task: ModelTask, hidden_size: int, vocab_size: int,
    max_model_len: int, kv: BlockPool,
) -> None:  # fmt: skip
    """ValueError for a pooling request this model cannot serve or that can never run: it needs a prompt of at least
    one token that fits the context and the KV pool (it computes no output)."""
    pooling = task.pooling
    if pooling is None or pooling.task != params.task:
        flag = "embed" if params.task == "embed" else "score"
        raise ValueError(f"this model is served for {', '.join(task.names)}, not {params.task}: serve it with "
                         f"--task {flag}")  # fmt: skip
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise ValueError("the input is empty: at least one token is needed")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"input token id {bad} is out of range: allowed [0, {vocab_size - 1}]")
    if num_prompt > max_model_len:
        raise ValueError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                         f"{num_prompt} tokens in the input. Please reduce the length of the input.")  # fmt: skip
    dims, allowed = params.dimensions, pooling.matryoshka_dimensions
    if dims is not None and (dims > hidden_size or (allowed and dims not in allowed)):
        choices = ", ".join(map(str, allowed)) if allowed else f"an integer in [1, {hidden_size}]"
        raise ValueError(f"dimensions={dims} is invalid: allowed {choices}")
    needed = kv.num_blocks_needed(num_prompt)
    if needed > kv.num_blocks:
        raise ValueError(f"this input needs {needed} KV blocks ({num_prompt} tokens) but the whole pool has "
                         f"{kv.num_blocks}; shorten it or raise num_kv_blocks / kv_cache_memory_gb")  # fmt: skip
