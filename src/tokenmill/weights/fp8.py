"""FP8 checkpoints: `quantization_config.quant_method: fp8`, transformers' fine-grained FP8, as Qwen3-*-FP8 and
DeepSeek-V3 ship them. Each quantized linear's `weight` is float8 (e4m3) [N, K], beside a `weight_scale_inv` of
scales, one per block of `weight_block_size` ([128, 128]): the weight is each FP8 value times its block's scale.
The grid is [ceil(N / bn), ceil(K / bk)] (edge blocks partial); without a block size, one scale for the tensor or a
grid that divides it. Scales come as float32 (DeepSeek-V3's), bfloat16 or UE8M0 exponents (uint8 or
float8_e8m0fnu: 2^(e - 127)).

tokenmill loads them dequantized, each weight as it streams in (`dequantized`): float32 products, the same ones as
transformers' own dequantizing load (`Fp8Dequantize`), then the model's dtype. On the CPU the dense weights then
take the kernels' format as any folder's do (bf16 panels, or `--quantization int8|int4|q4_k...`), so an FP8 model
runs in the memory of its bf16 or quantized form. On a GPU with FP8 tensor cores an FP8 checkpoint runs in fp8
unless `--quantization` says otherwise (`quantization_for`): its weights re-quantized with a scale per row
(models/gpu_linear.py), not in their own blocks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.models.family import FP8_METHOD
from tokenmill.models.gpu_linear import fp8_unavailable

SCALE = "_scale_inv"  # `x.weight` -> `x.weight_scale_inv`
# activation scales of a static scheme: a dequantized weight computes in the model's dtype and needs none
IGNORED = (".activation_scale", ".input_scale")
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
             if hasattr(torch, n))  # fmt: skip
_E8M0 = getattr(torch, "float8_e8m0fnu", None)

Named = tuple[str, torch.Tensor, str]  # (tensor name, tensor, the file it came from)


def quantized(hf_config: dict[str, Any]) -> bool:
    """Whether config.json declares an FP8 checkpoint."""
    quant = hf_config.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == FP8_METHOD


def quantization_for(quantization: str, hf_config: dict[str, Any], device: torch.device) -> str:
    """The quantization a model's linears take: an FP8 checkpoint's is fp8 where `device` multiplies float8 and
    none was asked for (as vLLM runs such checkpoints); else `quantization` as given."""
    if quantization == "none" and quantized(hf_config) and fp8_unavailable(device) is None:
        return "fp8"
    return quantization


def expansion_bytes(files: Iterable[Path], itemsize: int) -> int:
    """How many more bytes than the files' the FP8 tensors in `files` take dequantized to `itemsize` bytes a value:
    read from the safetensors headers alone (8 bytes of length, then JSON), never the weights."""
    extra = 0
    for path in files:
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, info in header.items():
            if name != "__metadata__" and str(info.get("dtype", "")).startswith("F8_E"):
                extra += math.prod(info["shape"]) * (itemsize - 1)
    return extra


def block_size(hf_config: dict[str, Any]) -> tuple[int, int] | None:
    """[bn, bk] of the scales' blocks (config.json's `weight_block_size`), or None where the config gives none."""
    block = hf_config.get("quantization_config", {}).get("weight_block_size")
    if block is None:
        return None
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(f"config.json: quantization_config weight_block_size {block!r} is not two positive "
                             f"integers (e.g. [128, 128])")  # fmt: skip
    return int(block[0]), int(block[1])


class Deferred:
    """An FP8 weight with its scales, dequantized when the loader reads it (`value`): a weight an earlier start's
    packed copy stands in for (weights/packed_cache.py) is never dequantized, so a warm start reads no FP8 page."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, name: str,
                 where: str) -> None:  # fmt: skip
        n, k = _matrix(weight, name, where)
        _blocks(n, k, _scales(scale), block, name, where)  # a bad grid fails at once, cached or not
        self.weight, self.scale, self.block, self.name, self.where = weight, scale, block, name, where

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def value(self) -> torch.Tensor:  # [N, K] float32
        return dequantize(self.weight, self.scale, self.block, self.name, self.where)


def dequantized(tensors: Iterable[Named], block: tuple[int, int] | None, defer: bool = False
                ) -> Iterator[tuple[str, torch.Tensor | Deferred, str]]:  # fmt: skip
    """`tensors` with every FP8 weight and its scales replaced by the weight, dequantized (float32), or with `defer`
    a `Deferred` the loader dequantizes where it needs the values. A weight waits for its scales (or they for it)
    wherever the files put them; one left without its partner fails the load."""
    weights: dict[str, tuple[torch.Tensor, str]] = {}
    scales: dict[str, tuple[torch.Tensor, str]] = {}
    for name, tensor, where in tensors:
        if name.endswith(IGNORED):
            continue
        if name.endswith(SCALE):
            base = name.removesuffix(SCALE)
            if base in weights:
                weight, where = weights.pop(base)
                yield base, _pair(weight, tensor, block, base, where, defer), where
            else:
                scales[base] = (tensor, where)
        elif tensor.dtype in _FP8:
            if name in scales:
                yield name, _pair(tensor, scales.pop(name)[0], block, name, where, defer), where
            else:
                weights[name] = (tensor, where)
        else:
            yield name, tensor, where
    for name, (_, where) in weights.items():
        raise ModelLoadError(f"FP8 tensor {name!r} in {where} has no {name + SCALE!r} in the checkpoint")
    for name, (_, where) in scales.items():
        raise ModelLoadError(f"{name + SCALE!r} in {where} scales no FP8 tensor {name!r} in the checkpoint")


def _pair(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, name: str, where: str,
          defer: bool) -> torch.Tensor | Deferred:  # fmt: skip
    deferred = Deferred(weight, scale, block, name, where)
    return deferred if defer else deferred.value()


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, name: str, where: str
               ) -> torch.Tensor:  # fmt: skip
    """weight [N, K] (float8) x its block scales -> float32 [N, K]: each value times its block's scale."""
    n, k = _matrix(weight, name, where)
    s = _scales(scale)
    bn, bk = _blocks(n, k, s, block, name, where)
    out = weight.to(torch.float32)  # [N, K]
    if s.numel() == 1:
        return out.mul_(s.reshape(()))
    full, rem = divmod(k, bk)
    for i in range(s.shape[0]):  # a row of blocks at a time: the scales never expand to the weight's size
        rows = out[i * bn : (i + 1) * bn]
        rows[:, : full * bk].unflatten(1, (full, bk)).mul_(s[i, :full, None])
        if rem:
            rows[:, full * bk :].mul_(s[i, full])
    return out


def _matrix(weight: torch.Tensor, name: str, where: str) -> tuple[int, int]:  # [N, K]
    if weight.dim() != 2:
        raise ModelLoadError(f"FP8 tensor {name!r} in {where} has shape {list(weight.shape)}; tokenmill reads 2-D "
                             f"FP8 weights [out, in]")  # fmt: skip
    return int(weight.shape[0]), int(weight.shape[1])


def _scales(scale: torch.Tensor) -> torch.Tensor:  # float32, as many as given
    if scale.dtype == torch.uint8 or (_E8M0 is not None and scale.dtype == _E8M0):
        return (scale.view(torch.uint8).to(torch.float32) - 127.0).exp2()  # UE8M0: a power of two per block
    return scale.to(torch.float32)


def _blocks(n: int, k: int, s: torch.Tensor, block: tuple[int, int] | None, name: str, where: str
            ) -> tuple[int, int]:  # fmt: skip
    """The [bn, bk] that `s` scales a [n, k] weight in (checked against the grid it must have)."""
    if s.numel() == 1:
        return n, k
    if s.dim() == 2 and block is None and n % s.shape[0] == 0 and k % s.shape[1] == 0:
        return n // s.shape[0], k // s.shape[1]
    if block is not None and tuple(s.shape) == (math.ceil(n / block[0]), math.ceil(k / block[1])):
        return block
    grid = "one scale, or a grid that divides it" if block is None else \
        f"[{math.ceil(n / block[0])}, {math.ceil(k / block[1])}] (blocks of {block[0]} x {block[1]})"  # fmt: skip
    raise ModelLoadError(f"{name + SCALE!r} in {where} has shape {list(s.shape)}; FP8 tensor {name!r} "
                         f"{list((n, k))} needs {grid}")  # fmt: skip
