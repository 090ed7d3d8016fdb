"""Linear layers: how the model's weight matrices are stored and multiplied.

The model is built with `Linear`: an `nn.Linear` whose one-row product on the CPU is `torch.mv`. After loading,
`prepare_linears` swaps every `nn.Linear` (the LM head included) for the module its settings call for:

- `KernelLinear` (CPU, the default): the weight packed once into one of tokenmill's formats and multiplied by
  tokenmill's own kernels (`kernels/`), converted or dequantized in registers:
  - `bf16` and `f32` for a bfloat16 or float32 model with `--quantization none`;
  - `q8_0` for `--quantization int8` and `q4_0` for `--quantization int4`: ggml's block formats (32 weights,
    one fp16 scale), so a GGUF's blocks and ours hold the same numbers. As in llama.cpp, the activations are
    quantized per row to Q8_0 blocks and multiplied in 8-bit integers.
  Every row count runs in the kernel (dense formats: register tiles for a few rows, a cache-blocked GEMM for
  many; quantized ones: integer tiles; on AMX, AMX tiles from a few rows), except that where oneDNN's native
  bf16 GEMM beats the kernel (AVX-512 BF16 with a kernel variant built without vdpbf16ps, or AMX the kernel cannot use)
  a bf16 prefill of more than `KERNEL_MAX_ROWS` rows through a bf16 weight unpacks it and takes oneDNN's.
  Without a compiled kernel (no compiler here) the same module computes the same product in torch
  (`formats.reference_linear`).
- `CudaBlockLinear` (GPU, int8 / int4): the same block values, multiplied weight-only (W8A16) by a Triton kernel
  that reads the int8 values in place (kernels/cuda/int8.py). Without the GPU kernels (`--no-gpu-kernels`, no
  Triton) a GPU's `KernelLinear` dequantizes the whole weight for each product instead.
- `Fp8Linear` (GPU with FP8 tensor cores, `--quantization fp8`): float8 weights and activations, row scales,
  torch's `_scaled_mm` (models/gpu_linear.py).
- `PackedLinear` (`--pack-weights`, CPU, quantization none): the weight reordered into oneDNN's blocked layout.
- A float16 model, a non-CPU device or `--no-cpu-kernels` keeps `Linear` (torch's own GEMV/GEMM).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import QUANTIZATION_MODES
from tokenmill.kernels import CudaKernels, Kernels, formats
from tokenmill.kernels.isa import cpu_flags
from tokenmill.kernels.placement import ALIGN, place_buffers
from tokenmill.model_config import MoEConfig
from tokenmill.models import quant_mix
from tokenmill.models.gpu_linear import CudaBlockLinear, Fp8Linear, fp8_unavailable
from tokenmill.models.packed_embedding import PackedEmbedding, share_tied_table

# Rows above which a bf16 product goes to oneDNN where it has a native bf16 GEMM. Elsewhere the kernel's blocked
# GEMM beats unpacking to float32 for torch's sgemm at every size (Zen 3 AVX2: 1.1-1.6x, docs/archive/).
KERNEL_MAX_ROWS = 64
FORMAT_OF_QUANTIZATION = {"int8": "q8_0", "int4": "q4_0", **{f: f for f in formats.kformats.QUANTIZABLE}}


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if x.dim() == 2 and x.shape[0] == 1 and x.device.type == "cpu":
            y = torch.mv(self.weight, x[0])  # [N]
            return (y if self.bias is None else y + self.bias)[None]
        return F.linear(x, self.weight, self.bias)


@functools.cache
def _native_bf16_gemm() -> bool:
    """oneDNN has a native bf16 GEMM here (AVX-512 BF16 / AMX): prefill in bf16 is then faster than fp32."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def _onednn_prefill(ops: Kernels | None) -> bool:
    """A many-row bf16 product is faster through oneDNN than through `ops`: oneDNN has a native bf16 GEMM, and
    the kernels neither vdpbf16ps nor, where the CPU has AMX, AMX tiles of their own. (Zen 4, AVX-512 BF16, no
    AMX: the kernel's pair tiles beat unpacking for oneDNN 2.8x at 128 rows and 1.5x at 512; Xeon with AMX: the
    kernel's AMX tiles beat it 6x at 128 rows and 2x at 512.)"""
    if not _native_bf16_gemm():
        return False
    if ops is None or not ops.module.bf16_dot_native():
        return True
    return "amx_bf16" in cpu_flags() and not ops.module.amx_native()


class KernelLinear(nn.Module):
    data: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, packed: formats.PackedWeight, bias: torch.Tensor | None, ops: Kernels | None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.format = packed.in_features, packed.out_features, packed.format
        self.padded_in, self.format_id, self.ops = packed.padded_in, packed.format_id, ops
        self.row_invariant = False  # `make_row_invariant`: each row's result whatever the rows beside it
        self.row_group = 0  # k per activation scale where a SegmentedLinear asks for more than the format's (0: its)
        self.register_buffer("data", packed.data)  # uint8 panels (kernels/formats.py)
        self.register_buffer("bias", None if bias is None else bias.detach().float())  # [N] float32

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, ops: Kernels | None) -> KernelLinear:
        """`linear`'s weight packed (converted or quantized) into `fmt` (a K-quant may fall back:
        formats.format_for)."""
        return cls(formats.pack(linear.weight.detach(), fmt), linear.bias, ops)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.format}, {'kernel' if self.ops else 'pure torch'}"

    def packed(self) -> formats.PackedWeight:
        return formats.PackedWeight(self.data, self.format, self.out_features, self.in_features, self.padded_in)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:  # [..., K] -> [..., N]
        """`out`: where the kernels may write the [rows, N] result (contiguous, x's dtype), instead of a new tensor;
        the other paths return a new one."""
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        if self.row_invariant and rows % 2 and self.format in ("bf16", "f32"):
            # the dense kernels sum a lone row (the one-row path, or a tile's one-row tail) in another order than
            # tiles of 2 or more rows, which agree with each other: an odd row count gets a copy of its last row
            y = self(torch.cat([x2, x2[-1:]]))[:rows]
            return y.view(*x.shape[:-1], self.out_features)
        bf16 = self.format == "bf16" and x2.dtype == torch.bfloat16
        onednn = bf16 and rows > KERNEL_MAX_ROWS and _onednn_prefill(self.ops) and not self.row_invariant
        if self.ops is not None and not onednn and x2.dtype in (torch.bfloat16, torch.float32):
            # NOTE: the weight and bias were checked against the format when packed; this is the decode hot path
            x2 = x2.contiguous()
            shape = (rows, self.out_features)
            if out is None or out.shape != shape or out.dtype != x2.dtype or not out.is_contiguous():
                out = torch.empty(shape, dtype=x2.dtype)
            y = out
            bias = 0 if self.bias is None else self.bias.data_ptr()
            self.ops.module.linear(x2.data_ptr(), x2.dtype == torch.bfloat16, rows, self.in_features,
                                   self.data.data_ptr(), self.format_id, self.out_features, self.padded_in, bias,
                                   y.data_ptr(), self.row_group)  # fmt: skip
        else:
            y = self._dense(x2)
        return y.view(*x.shape[:-1], self.out_features)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N], the weight unpacked for this call
        if self.format in formats.QUANTIZED:
            if x.device.type != "cpu":  # a GPU's weight-only product: the weight dequantized, x as it is (W8A16)
                bias = None if self.bias is None else self.bias.to(x.dtype)
                return F.linear(x, formats.unpack(self.packed()).to(x.dtype), bias)
            # the kernel's product, in torch
            return formats.reference_linear(x, self.packed(), self.bias, self.row_group).to(x.dtype)
        if self.ops is not None:
            w = self.ops.unpack(self.data, self.format_id, self.out_features, self.padded_in)[:, : self.in_features]
        else:
            w = formats.unpack(self.packed())
        if x.dtype == torch.bfloat16 and _native_bf16_gemm():
            return F.linear(x, w.to(torch.bfloat16), None if self.bias is None else self.bias.to(torch.bfloat16))
        return F.linear(x.float(), w, self.bias).to(x.dtype)


class SegmentedLinear(nn.Module):
    """A fused projection whose shards arrived in different block formats (a Q4_K_M GGUF's attn_q and attn_k in
    Q4_K beside an attn_v in Q6_K): each shard keeps its own format as a `KernelLinear`, and their outputs are
    concatenated. No shard is converted, so nothing is lost and none takes more memory than its file. The rows are
    quantized alike for every shard, as the decode stack readies them once for all (linear/segments.h): one scale
    per superblock where a shard is a K-quant."""

    def __init__(self, parts: list[KernelLinear]) -> None:
        super().__init__()
        group = max(formats.row_group(p.format) for p in parts)
        for p in parts:
            p.row_group = group if group > formats.row_group(p.format) else 0
        self.parts = nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, " + " + ".join(p.format for p in self.parts)  # type: ignore[misc]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        return torch.cat([part(x) for part in self.parts], dim=-1)


class PackedLinear(nn.Module):
    packed: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()  # [N, K]
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1))  # oneDNN layout
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


@functools.cache
def packing_unsupported(dtype: torch.dtype) -> str | None:
    """Why oneDNN cannot pack `dtype` weights on this CPU, or None when it can.

    oneDNN's bf16 reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; on an AVX2-only CPU it raises. We ask
    it once with a tiny matrix rather than guess from CPU flags, so the answer is oneDNN's own.
    """
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN (mkldnn)"
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


def _mixed(linear: nn.Linear, shards: list[tuple[int, str]], ops: Kernels | None) -> KernelLinear | SegmentedLinear:
    """`linear` packed as `shards` (rows, format) say (quant_mix): one KernelLinear, or one per shard."""
    if len(shards) == 1:
        return KernelLinear.from_linear(linear, shards[0][1], ops)
    parts, start = [], 0
    for rows, fmt in shards:
        shard = nn.Linear(linear.in_features, rows, bias=linear.bias is not None, device="meta")
        shard.weight = nn.Parameter(linear.weight.detach()[start : start + rows], requires_grad=False)
        if linear.bias is not None:
            shard.bias = nn.Parameter(linear.bias.detach()[start : start + rows], requires_grad=False)
        parts.append(KernelLinear.from_linear(shard, fmt, ops))
        start += rows
    return SegmentedLinear(parts)


def _kind(quantization: str, device: torch.device, dtype: torch.dtype, pack: bool, cpu_kernels: bool) -> str:
    """What every linear of this model becomes: a kernel format, 'mix' (quant_mix picks per linear), 'packed'
    (oneDNN) or 'plain'."""
    if device.type != "cpu" and (quantization in quant_mix.MIXES or quantization in formats.kformats.KSPECS):
        raise ValueError(f"--quantization {quantization} runs on the CPU kernels only; on a GPU use int8 or int4")
    if quantization == "fp8":
        if (reason := fp8_unavailable(device)) is not None:
            raise ValueError(f"--quantization {reason}")
        return "fp8"
    if quantization in quant_mix.MIXES:
        return "mix"
    if quantization in FORMAT_OF_QUANTIZATION:
        return FORMAT_OF_QUANTIZATION[quantization]
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return "plain"
    if pack:
        reason = packing_unsupported(dtype)
        if reason is not None:
            dtype_name = str(dtype).removeprefix("torch.")
            raise ValueError(f"--pack-weights cannot pack {dtype_name} weights on this CPU ({reason}); "
                             "drop --pack-weights, or use --dtype float32")  # fmt: skip
        return "packed"
    if not cpu_kernels:
        return "plain"
    return "bf16" if dtype == torch.bfloat16 else "f32"


def linear_format(
    quantization: str, device: torch.device, dtype: torch.dtype, pack: bool, cpu_kernels: bool
) -> str | None:
    """The kernel format every dense linear of a model becomes in `prepare_linears` (a KernelLinear on the CPU), or
    None where they become something else (oneDNN's packing, torch's own modules, a GPU's): the loader packs each
    weight in it as soon as the weight is complete (weights/loader.py)."""
    if device.type != "cpu" or quantization not in QUANTIZATION_MODES:
        return None
    kind = _kind(quantization, device, dtype, pack, cpu_kernels)
    return kind if kind in formats.FORMATS else None


def prepare_linears(
    model: nn.Module, quantization: str, device: torch.device, pack_weights: bool = False, cpu_kernels: bool = True,
    gpu_ops: CudaKernels | None = None,
) -> dict[str, int]:  # fmt: skip
    """Replace every nn.Linear under `model` in place; returns how many linears got each kind.

    Linears that arrived packed (a GGUF's Q8_0/Q4_0 blocks, as `KernelLinear`) keep their format and get the
    kernels bound. On a GPU with `gpu_ops` (the Triton kernels), quantized linears become `CudaBlockLinear`."""
    from tokenmill import kernels

    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization={quantization!r} is not supported; allowed: {', '.join(QUANTIZATION_MODES)}")
    use_kernels = device.type == "cpu" and cpu_kernels
    counts: dict[str, int] = {}
    n_layers = quant_mix.layer_count(model) if quantization in quant_mix.MIXES else 0
    # NOTE: hold on to parents only, so each replaced dense weight is freed as soon as its module is swapped
    for where, parent in [(n, m) for n, m in model.named_modules() if not isinstance(m, nn.Linear)]:
        for name, child in list(parent.named_children()):
            if isinstance(child, KernelLinear) and gpu_ops is not None and child.format in ("q8_0", "q4_0"):
                setattr(parent, name, CudaBlockLinear.from_kernel_linear(child, gpu_ops))
                kind = child.format
            elif isinstance(child, KernelLinear):
                child.ops, kind = kernels.active() if use_kernels else None, child.format
            elif isinstance(child, PackedEmbedding):  # (kept in its blocks for the kernels, or dense without them)
                if not use_kernels:
                    setattr(parent, name, child.dense())
                continue
            elif not isinstance(child, nn.Linear):
                continue
            else:
                kind = _kind(quantization, device, child.weight.dtype, pack_weights, cpu_kernels)
                if kind == "plain":
                    continue
                new: nn.Module
                if kind == "mix":
                    shards = quant_mix.formats_for(quantization, f"{where}.{name}".lstrip("."), parent, n_layers)
                    new = _mixed(child, shards, kernels.active() if use_kernels else None)
                    setattr(parent, name, new)
                    for fmt in [p.format for p in new.parts] if isinstance(new, SegmentedLinear) else [new.format]:
                        counts[str(fmt)] = counts.get(str(fmt), 0) + 1
                    continue
                if kind == "fp8" and f"{where}.{name}".lstrip(".") == "lm_head":
                    continue  # (the head stays in the model's dtype, as vLLM's fp8)
                if kind == "fp8":
                    new = Fp8Linear.from_linear(child, gpu_ops)
                elif kind == "packed":
                    new = PackedLinear(child)
                elif gpu_ops is not None and kind in ("q8_0", "q4_0"):
                    new = CudaBlockLinear.from_linear(child, kind, gpu_ops)
                else:
                    new = KernelLinear.from_linear(child, kind, kernels.active() if use_kernels else None)
                    kind = new.format  # a K-quant's fallback where the rows are not whole superblocks
                setattr(parent, name, new)
            counts[kind] = counts.get(kind, 0) + 1
    if use_kernels:
        share_tied_table(model, kernels.active())
    return counts


def make_row_invariant(model: nn.Module, ops: Kernels) -> int:
    """Every kernel linear of `model` computes each row as it would alone, in any batch (`--batch-invariant`); returns
    how many. AMX tiles sum bf16 pairs in another order than the vector tiles, so they go off, for the whole process
    (the switch is the compiled module's). The quantized formats' rows are exact integer sums, the same either way."""
    ops.set_amx(0)
    linears = [m for m in model.modules() if isinstance(m, KernelLinear)]
    for m in linears:
        m.row_invariant = True
    return len(linears)


def weight_bytes(model: nn.Module, active: bool = True) -> int:
    """Bytes of weights a one-row decode step reads: every module's own parameters and buffers, once each, except
    the token embedding (a step reads one row of it; a tied LM head still counts it, through `lm_head`), and of a
    mixture-of-experts MLP's experts only the share a token chooses, top_k of num_experts (its active parameters).
    `active=False`: every expert, as the model holds them in memory."""
    seen: set[int] = set()

    def own(module: nn.Module) -> int:
        total = 0
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total

    total = 0
    for module in model.modules():
        moe = getattr(module, "moe", None) if active else None
        if isinstance(moe, MoEConfig) and isinstance(experts := getattr(module, "experts", None), nn.ModuleList):
            every = sum(own(m) for m in experts.modules())
            total += every * moe.top_k // moe.num_experts
        elif not isinstance(module, (nn.Embedding, PackedEmbedding)):
            total += own(module)
    return total


def _holders(owners: list[KernelLinear | PackedEmbedding]) -> dict[int, list[KernelLinear | PackedEmbedding]]:
    """{data_ptr: the modules holding that packed buffer} (no reference to a buffer itself kept)."""
    holders: dict[int, list[KernelLinear | PackedEmbedding]] = {}
    for module in owners:
        holders.setdefault(module.data.data_ptr(), []).append(module)
    return holders


def place_weights(model: nn.Module) -> int:
    """Move every kernel linear's packed weight (its `data` buffer) into one huge-page region, in module order
    (kernels/placement.py says why); returns the bytes moved (0 where nothing moved). Each weight's modules take
    its copy as soon as it is made, so the old buffer is freed before the next is copied: the packed weights are
    never held twice."""
    linears = [m for m in model.modules() if isinstance(m, KernelLinear) and m.data.device.type == "cpu"]
    # (a packed embedding shares a tied LM head's panels: it follows them, or the old buffer would stay alive)
    holders = _holders([*linears, *(m for m in model.modules() if isinstance(m, PackedEmbedding))])

    def swap(ptr: int, copy: torch.Tensor) -> None:
        for module in holders.pop(ptr, []):
            module.data = copy

    buffers = [m.data for m in linears]
    del linears
    placed = place_buffers(buffers, swap)
    return sum(-(-t.numel() // ALIGN) * ALIGN for t in placed.values())
