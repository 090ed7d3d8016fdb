"""FP8 checkpoints (`quant_method: fp8`, weights/fp8.py) against transformers' own load of the same files.

The FP8 folders are written here from tiny random checkpoints, as Qwen3-*-FP8 are made: every linear weight of the
decoder layers in float8 e4m3, with a float32 `weight_scale_inv` per block (the block's absmax / 448), the
embeddings, norms and head left as they were.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests import target
from tokenmill import LLM, SamplingParams
from tokenmill.attention import causal
from tokenmill.errors import ModelLoadError
from tokenmill.models.gpu_linear import fp8_unavailable
from tokenmill.weights.fp8 import dequantize, quantization_for

SPREAD = dict(initializer_range=0.1)
FP8 = torch.float8_e4m3fn


def _expand(scale: torch.Tensor, n: int, k: int, bn: int, bk: int) -> torch.Tensor:  # [N, K]: each value's scale
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def quantize_fp8(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (float8 e4m3 [N, K], float32 scales [ceil(N / bn), ceil(K / bk)]): absmax / 448 a block."""
    n, k = w.shape
    pad = torch.zeros(math.ceil(n / bn) * bn, math.ceil(k / bk) * bk)
    pad[:n, :k] = w.float()
    blocks = pad.unflatten(0, (-1, bn)).unflatten(2, (-1, bk)).abs().amax(dim=(1, 3))  # [N / bn, K / bk]
    scale = (blocks / 448.0).clamp(min=1e-12)
    return (w.float() / _expand(scale, n, k, bn, bk)).clamp(-448, 448).to(FP8), scale


def write_fp8(folder: Path, out: Path, block: tuple[int, int], scale_dtype: torch.dtype = torch.float32) -> Path:
    """A copy of checkpoint `folder` with its decoder layers' linear weights in FP8 blocks of `block`."""
    shutil.copytree(folder, out)
    tensors = load_file(str(folder / "model.safetensors"))
    for name in [n for n, t in tensors.items() if ".layers." in n and n.endswith("proj.weight") and t.dim() == 2]:
        tensors[name], scale = quantize_fp8(tensors[name], *block)
        tensors[name + "_scale_inv"] = scale.to(scale_dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": list(block)}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return out


def _logits(llm: LLM, ids: list[int]) -> torch.Tensor:  # [T, V] float32
    with torch.inference_mode():
        hidden = llm.loaded.model(target.ids_tensor(ids), target.positions(0, len(ids)), *causal(len(ids)))
        return llm.loaded.model.compute_logits(hidden).float().cpu()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_an_fp8_checkpoint_matches_transformers_loading_it(
    make_checkpoint: Callable[..., Path], tmp_path: Path, arch: str
) -> None:
    """float32 logits to 1e-4 and 16 greedy tokens identical, against transformers' own load of the FP8 folder
    (on the CPU it dequantizes, as tokenmill does)."""
    from transformers import AutoModelForCausalLM

    folder = write_fp8(make_checkpoint(arch, **SPREAD), tmp_path / "fp8", (32, 32))
    assert load_file(str(folder / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"].dtype == FP8
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert hf.model.layers[0].mlp.down_proj.weight.dtype == torch.float32  # transformers dequantized it
    llm = LLM(str(folder), dtype="float32", device=target.DEVICE)
    ids = list(range(7, 40))
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()
    assert (_logits(llm, ids) - expected).abs().max().item() < 1e-4
    ours = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert ours[0].outputs[0].token_ids == theirs[0, len(ids) :].tolist()


def test_quantizing_an_fp8_checkpoint_packs_its_dequantized_weights(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """`--quantization int8` over an FP8 folder packs the weights the FP8 blocks hold: the same tokens as the
    same weights written dequantized (float32) and quantized alike."""
    target.cpu_only()
    fp8 = write_fp8(make_checkpoint("qwen3", **SPREAD), tmp_path / "fp8", (16, 32))
    plain = tmp_path / "plain"
    shutil.copytree(fp8, plain)
    tensors = load_file(str(fp8 / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("_scale_inv")]:
        scale, weight = tensors.pop(name), tensors[name.removesuffix("_scale_inv")]
        tensors[name.removesuffix("_scale_inv")] = weight.float() * _expand(scale, *weight.shape, 16, 32)
    save_file(tensors, str(plain / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (9, 23)]
    runs = [LLM(str(f), dtype="bfloat16", quantization="int8").generate(prompts, params) for f in (fp8, plain)]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]


@pytest.mark.parametrize("scales", ["float32", "bfloat16", "e8m0"])
@pytest.mark.parametrize(("shape", "block"), [((50, 70), (16, 32)), ((64, 96), (32, 32)), ((7, 300), None)])
def test_dequantize_scales_each_block_as_its_grid_says(
    shape: tuple[int, int], block: tuple[int, int] | None, scales: str
) -> None:
    """Partial edge blocks (a grid of ceil(N / bn) x ceil(K / bk)), a grid the config gives no block for (it must
    divide the weight), one scale for the tensor, and scales as float32, bfloat16 or UE8M0 exponents."""
    g = torch.Generator().manual_seed(1)
    n, k = shape
    w = (torch.randn(n, k, generator=g) * 100).to(FP8)
    bn, bk = block or (n, k)
    grid = (math.ceil(n / bn), math.ceil(k / bk))
    exps = torch.randint(120, 134, grid, generator=g, dtype=torch.uint8)
    scale = {"float32": torch.rand(grid, generator=g) + 0.5, "bfloat16": torch.rand(grid, generator=g).bfloat16(),
             "e8m0": exps}[scales]  # fmt: skip
    as_float = (exps.float() - 127).exp2() if scales == "e8m0" else scale.float()
    expected = w.float() * _expand(as_float, n, k, bn, bk)
    assert torch.equal(dequantize(w, scale, block, "w", "f"), expected)
    if block is None and grid == (1, 1):  # the same without a block size: one scale, or a grid dividing the weight
        assert torch.equal(dequantize(w, scale.reshape(()), None, "w", "f"), expected)
    if shape == (64, 96):
        assert torch.equal(dequantize(w, scale, None, "w", "f"), expected)  # [2, 3] divides [64, 96]


def test_bad_fp8_checkpoints_fail_in_one_line(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """A weight without its scales, scales without their weight, or a grid of the wrong shape: one line naming the
    tensor and its file, at load."""
    folder = write_fp8(make_checkpoint("qwen3", **SPREAD), tmp_path / "fp8", (32, 32))
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.weight"
    grid = rf"'{name}_scale_inv' in .* has shape \[3, 2\]; .* needs \[2, 16\] \(blocks of 32 x 32\)"
    cases = {
        "no-scale": ({k: v for k, v in tensors.items() if k != name + "_scale_inv"},
                     f"FP8 tensor '{name}' in .* has no '{name}_scale_inv'"),
        "no-weight": ({**tensors, "model.extra.weight_scale_inv": torch.ones(1)},
                      "'model.extra.weight_scale_inv' in .* scales no FP8 tensor 'model.extra.weight'"),
        "bad-grid": ({**tensors, name + "_scale_inv": torch.ones(3, 2)}, grid),
    }  # fmt: skip
    for label, (content, message) in cases.items():
        bad = tmp_path / label
        shutil.copytree(folder, bad)
        save_file(content, str(bad / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match=message) as e:
            LLM(str(bad), dtype="float32")
        assert "\n" not in str(e.value)


def test_an_fp8_checkpoint_takes_fp8_only_where_the_device_multiplies_float8() -> None:
    """On the CPU an FP8 checkpoint runs dequantized (or as --quantization says); a GPU with FP8 tensor cores runs
    it in fp8 (tests/cuda/test_fp8.py)."""
    fp8, cpu = {"quantization_config": {"quant_method": "fp8"}}, torch.device("cpu")
    assert quantization_for("none", fp8, cpu) == "none"
    assert quantization_for("int8", fp8, cpu) == "int8"
    assert quantization_for("none", {}, cpu) == "none"
    if torch.cuda.is_available() and fp8_unavailable(torch.device("cuda")) is None:
        assert quantization_for("none", fp8, torch.device("cuda")) == "fp8"
        assert quantization_for("int4", fp8, torch.device("cuda")) == "int4"


def test_a_second_load_takes_the_packed_weights_and_dequantizes_nothing(
    make_checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU packs an FP8 folder's weights once (weights/packed_cache.py); a later load maps them and dequantizes
    no FP8 weight (weights/fp8.py `Deferred`), with the same logits."""
    target.cpu_only()
    from tokenmill.weights import fp8

    folder = write_fp8(make_checkpoint("qwen3", **SPREAD), tmp_path / "fp8", (32, 32))
    real, dequantized = fp8.dequantize, []
    monkeypatch.setattr(
        fp8, "dequantize", lambda w, s, b, name, where: dequantized.append(name) or real(w, s, b, name, where)
    )
    first = LLM(str(folder), dtype="bfloat16")
    assert len(dequantized) == 14  # 2 layers x q, k, v, o, gate, up, down
    second = LLM(str(folder), dtype="bfloat16")
    assert len(dequantized) == 14
    ids = list(range(7, 40))
    assert torch.equal(_logits(first, ids), _logits(second, ids))


def test_an_fp8_folder_that_fits_only_as_fp8_fails_in_one_line_before_loading(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """An FP8 tensor of half the machine's memory and a GiB (a sparse file: nothing that large is written or read):
    its file fits, its bf16 weights do not, so the load stops in one line before reading a weight; with
    `--quantization int8` (about a byte a weight) the same check lets it through to the next stage."""
    import struct

    from tests.unit.test_cli import assert_one_line_error, run_cli
    from tokenmill.memory import machine_bytes

    have = machine_bytes()
    if have is None:
        pytest.skip("this platform tells no memory size (sysconf), so there is no limit to exceed")
    folder = write_fp8(make_checkpoint("qwen3", **SPREAD), tmp_path / "fp8", (32, 32))
    rows = (have // 2 + 2**30) // 4096 + 1
    header = json.dumps({"spare.weight": {"dtype": "F8_E4M3", "shape": [rows, 4096], "data_offsets": [0, rows * 4096]}})
    header += " " * (-len(header) % 8)
    with open(folder / "spare.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode())
        f.truncate(8 + len(header) + rows * 4096)
    result = run_cli("generate", str(folder), "--prompt", "x", "--dtype", "bfloat16")
    assert_one_line_error(result, "more than this machine's", "FP8 weights dequantized to 2 bytes a value")
    from tokenmill.assembly.model import _check_fits

    _check_fits(folder, None, 1, 1)  # (at a byte a weight it fits: no error)
