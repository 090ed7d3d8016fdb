"""`--quantization fp8` on a GPU with FP8 tensor cores (compute capability 8.9+): the engine's linears become
`Fp8Linear` (models/gpu_linear.py), the LM head stays bf16, decode steps replayed from CUDA graphs give the tokens
eager steps give, and the demo model keeps the bars tests/unit/test_fp8_linear.py holds on the CPU.

Skipped without such a GPU. scripts/test_cuda.sh runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.parity.test_fp8_checkpoint import SPREAD, write_fp8
from tests.unit.test_fp8_linear import VAL_TEXT
from tokenmill import LLM, SamplingParams
from tokenmill.attention import causal
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


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_fp8_serves_a_float16_or_float32_model(dtype: str) -> None:
    """Row-wise scaled FP8 products are written in bf16 on every FP8 GPU (torch refuses float32 out but on Hopper's
    cuBLAS 12.9+): a model in another dtype takes them cast, decodes from its CUDA graphs, and keeps the bf16
    bars on the demo model's held-out text."""
    llm = LLM(dtype=dtype, device="cuda", quantization="fp8")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert len(llm.generate(["ROMEO:\nBut soft, what light"], params)[0].outputs[0].token_ids) == 24
    reference = LLM(dtype=dtype, device="cuda").loaded
    q = compare(score(reference, VAL_TEXT), score(llm.loaded, VAL_TEXT))
    assert q["top1_agreement"] >= 0.97, q
    assert abs(q["perplexity_change"]) <= 0.01, q


def test_fp8_keeps_the_demo_models_predictions_on_the_gpu() -> None:
    reference = LLM(dtype="bfloat16", device="cuda").loaded
    fp8 = LLM(dtype="bfloat16", device="cuda", quantization="fp8").loaded
    q = compare(score(reference, VAL_TEXT), score(fp8, VAL_TEXT))
    assert q["top1_agreement"] >= 0.97, q  # the CPU's run of the same values: 0.978
    assert abs(q["perplexity_change"]) <= 0.01, q


def test_an_fp8_checkpoint_runs_in_fp8_on_the_gpu(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """An FP8 checkpoint with no --quantization runs in fp8 here (weights/fp8.py `quantization_for`): its linears
    `Fp8Linear`, its prompt logits those of the CPU's dequantized load, up to fp8's rounding of the activations."""
    folder = write_fp8(make_checkpoint("qwen3", **SPREAD), tmp_path / "fp8", (32, 32))
    gpu = LLM(str(folder), dtype="bfloat16", device="cuda")
    assert any(isinstance(m, Fp8Linear) for m in gpu.loaded.model.modules())
    cpu = LLM(str(folder), dtype="float32", device="cpu")  # (the default device is the GPU here)
    ids = list(range(7, 40))
    logits = []
    with torch.inference_mode():
        for llm, device in ((gpu, "cuda"), (cpu, "cpu")):
            model = llm.loaded.model
            hidden = model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), *causal(len(ids)))
            logits.append(model.compute_logits(hidden).float().cpu().flatten())
    assert torch.corrcoef(torch.stack(logits))[0, 1].item() > 0.99
