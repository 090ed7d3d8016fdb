"""On a CUDA GPU: where the engine puts its tensors, how it sizes the KV pool, and how closely its bfloat16 greedy
output follows transformers' bfloat16 on the same GPU.

Skipped without a GPU. scripts/test_cuda.sh runs this file together with the parity and engine suites under
`--device cuda` (float32 to 1e-4 and greedy identical there, as on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.parity.test_models import CONFIGS, PROMPT, SPREAD
from tokenmill import LLM, SamplingParams
from tokenmill.attention import PagedKVCache
from tokenmill.kernels import CudaKernels
from tokenmill.kernels.cuda import unavailable as gpu_kernels_unavailable

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False here)"
)

NEW_TOKENS = 32
BF16_AGREEMENT: dict[str, tuple[int, int]] = {}  # config -> (ours vs HF bf16, HF bf16 vs HF fp32): agreeing prefix


def _prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_weights_cache_and_sampling_live_on_the_gpu(make_checkpoint: Callable[..., Path]) -> None:
    llm = LLM(str(make_checkpoint("llama", **SPREAD)), dtype="bfloat16", device="cuda")
    assert {p.device.type for p in llm.loaded.model.parameters()} == {"cuda"}
    kv = llm.engine.kv
    assert isinstance(llm.engine.runner.kv, PagedKVCache) and llm.engine.runner.kv.cache.device.type == "cuda"
    # the CPU kernels stay off; the GPU's Triton kernels are bound where Triton is installed
    assert isinstance(llm.loaded.ops, CudaKernels) == (gpu_kernels_unavailable() is None)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=1, ignore_eos=True)
    outs = llm.generate([PROMPT, PROMPT[:9]], params)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert kv is not None and kv.num_free_blocks == kv.num_blocks


def test_the_kv_pool_fits_in_free_gpu_memory(make_checkpoint: Callable[..., Path]) -> None:
    """Without --num-kv-blocks the paged pool is planned from what the GPU has free, and never overflows it."""
    free_before, _ = torch.cuda.mem_get_info()
    llm = LLM(str(make_checkpoint("llama", **SPREAD)), dtype="float32", device="cuda")
    runner_kv = llm.engine.runner.kv
    assert isinstance(runner_kv, PagedKVCache)
    pool_bytes = runner_kv.cache.numel() * runner_kv.cache.element_size()
    assert 0 < pool_bytes < free_before


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bfloat16_greedy_follows_transformers_on_the_gpu(make_checkpoint: Callable[..., Path], name: str) -> None:
    """Our bf16 greedy tokens against transformers' bf16 on the same GPU. Two bf16 programs round differently, so
    a near-tie may flip and the outputs part there; the bar is transformers' own: our bf16 keeps at least as long
    a prefix of its bf16 output as its bf16 keeps of its float32 output, less 8 tokens."""
    from transformers import AutoModelForCausalLM

    arch, overrides = CONFIGS[name]
    folder = make_checkpoint(arch, **SPREAD, **overrides)
    llm = LLM(str(folder), dtype="bfloat16", device="cuda")
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
    refs = []
    for dtype in (torch.bfloat16, torch.float32):
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to("cuda").eval()
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False)  # fmt: skip
        refs.append(out[0, len(ids) :].tolist())
    BF16_AGREEMENT[name] = (_prefix(ours, refs[0]), _prefix(refs[0], refs[1]))
    print(f"bf16 greedy on {torch.cuda.get_device_name()}: {name}: ours vs HF bf16 {BF16_AGREEMENT[name][0]}"
          f"/{NEW_TOKENS}, HF bf16 vs HF fp32 {BF16_AGREEMENT[name][1]}/{NEW_TOKENS}")  # fmt: skip
    assert BF16_AGREEMENT[name][0] >= min(BF16_AGREEMENT[name][1], NEW_TOKENS) - 8
