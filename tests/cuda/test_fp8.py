"""`--quantization fp8` on a GPU with FP8 tensor cores (compute capability 8.9+): the engine's linears become
`Fp8Linear` (models/gpu_linear.py), the LM head stays bf16, decode steps replayed from CUDA graphs give the tokens
eager steps give, and the demo model keeps the bars tests/unit/test_fp8_linear.py holds on the CPU.

Skipped without such a GPU. scripts/test_cuda.sh runs it.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_fp8_linear import VAL_TEXT
from tokenmill import LLM, SamplingParams
from tokenmill.models.gpu_linear import MIN_CAPABILITY, Fp8Linear
from tokenmill.quality import compare, score

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < MIN_CAPABILITY,
    reason="needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+); none here",
)


def test_fp8_serves_from_cuda_graphs_as_it_does_eagerly() -> None:
    graphs = LLM(dtype="bfloat16", device="cuda", quantization="fp8")
    eager = LLM(dtype="bfloat16", device="cuda", quantization="fp8", enforce_eager=True)
    model = graphs.loaded.model
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert fp8 and all(m.weight.device.type == "cuda" for m in fp8)
    assert not isinstance(model.lm_head, Fp8Linear)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    prompts = ["ROMEO:\nBut soft, what light", "KING HENRY:\nOnce more unto the breach", "Now is the winter"]
    ours = [o.outputs[0].token_ids for o in graphs.generate(prompts, params)]
    assert ours == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]


def test_fp8_keeps_the_demo_models_predictions_on_the_gpu() -> None:
    reference = LLM(dtype="bfloat16", device="cuda").loaded
    fp8 = LLM(dtype="bfloat16", device="cuda", quantization="fp8").loaded
    q = compare(score(reference, VAL_TEXT), score(fp8, VAL_TEXT))
    assert q["top1_agreement"] >= 0.97, q  # the CPU's run of the same values: 0.978
    assert abs(q["perplexity_change"]) <= 0.01, q
