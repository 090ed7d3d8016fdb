"""tokenmill's GPU kernels, in Triton: the fused small ops of a decoder layer (pointwise.py), paged decode and
prefill attention (attention.py, prefill.py), the weight-only int8 product (int8.py) and MoE's grouped GEMMs (moe.py).

`CudaKernels` has the fused ops' calls of the CPU kernels (`kernels.Kernels`: rmsnorm, rope_, silu_mul, kv_write,
decode_attention, prefill_attention), so the layers and the paged KV cache call either the same way, and two of
its own: `gelu_mul` (GeGLU) and `rope_kv_write_` (a layer's q and k norms, RoPE and KV write in one launch);
`device_type` and `dtypes` say which tensors each takes. A GPU model binds them unless `--no-gpu-kernels`, or
Triton is missing (`unavailable()` says so, and torch's ops run). Nothing here imports Triton until a GPU model asks
for the kernels: a CPU install has no Triton. Tests run the kernels on the CPU under Triton's interpreter
(TRITON_INTERPRET=1).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from tokenmill import reaper

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def unavailable(device: torch.device | None = None) -> str | None:
    """Why the GPU kernels cannot run here (on `device`, where given), or None when they can."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (`pip install triton`; CUDA builds of torch bring it)"
    if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (7, 0):
        return f"{torch.cuda.get_device_name(device)} is older than Triton's oldest GPU (compute capability 7.0)"
    return None


class CudaKernels:
    """The Triton kernels behind checked calls (shapes and layouts here; the kernels trust them)."""

    dtypes = DTYPES

    def __init__(self, device_type: str = "cuda") -> None:
        """`device_type` "cpu" only under Triton's interpreter (TRITON_INTERPRET=1, set before this is made): the
        tests run whole models through these kernels that way."""
        from tokenmill.kernels.cuda import attention, fp8, int8, moe, pointwise, prefill

        reaper.before_spawn()  # Triton's compiler jobs (ptxas)
        self.device_type = device_type
        self._attention, self._int8, self._moe, self._pointwise = attention, int8, moe, pointwise
        self._prefill, self._fp8 = prefill, fp8

    def rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """[rows, D] contiguous: residual += x (in place, when given), then rmsnorm(residual or x) * weight."""
        d = x.shape[-1]
        x2 = x.reshape(-1, d)
        out = torch.empty_like(x2)
        self._pointwise.launch_rmsnorm(x2, None if residual is None else residual.view(-1, d), weight, eps, out)
        return out.view(x.shape)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
        """Rotate-half RoPE in place on x [T, >= heads * Dh] (rows may be wider: a fused qkv); cos, sin [T, Dh]."""
        tables_ok = cos.is_contiguous() and sin.is_contiguous() and cos.shape == (x.shape[0], head_dim)
        if x.stride(-1) != 1 or not tables_ok:
            raise ValueError(f"rope_ needs unit-stride rows and contiguous cos/sin [{x.shape[0]}, {head_dim}]")
        self._pointwise.launch_rope(x, cos, sin, heads, head_dim)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, 2I] contiguous (gate, then up) -> silu(gate) * up [rows, I], into `out` when given."""
        rows, width = gate_up.shape
        if out is None:
            out = torch.empty(rows, width // 2, dtype=gate_up.dtype, device=gate_up.device)
        self._pointwise.launch_silu_mul(gate_up, out)
        return out

    def gelu_mul(self, gate_up: torch.Tensor, tanh: bool, out: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, 2I] contiguous (gate, then up) -> gelu(gate) * up [rows, I] (torch's approximate="tanh" where
        `tanh`, else the exact erf form), into `out` when given."""
        rows, width = gate_up.shape
        if out is None:
            out = torch.empty(rows, width // 2, dtype=gate_up.dtype, device=gate_up.device)
        self._pointwise.launch_gelu_mul(gate_up, out, tanh)
        return out

    def rope_kv_write_(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int,
        cache: torch.Tensor, slots: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> None:  # fmt: skip
        """One launch for what `rope_` and `kv_write` do, in a fused qkv [T, (H + 2 Hkv) * Dh] (q heads, k heads,
        v heads): where `norms` (q_norm's weight [Dh], k_norm's [Dh], eps), each q and k head is first RMS-normed
        by its weight (Qwen3); the q and k heads are rotated in place (cos, sin [T, Dh]), and each token's k and v
        heads go to the layer's cache [2, S, Hkv, Dh] at `slots` [T] (int64)."""
        kv_heads = cache.shape[2]
        if not (qkv.is_contiguous() and cache.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("rope_kv_write_ needs a contiguous qkv, cache and cos/sin")
        if qkv.shape[1] != (heads + 2 * kv_heads) * head_dim or cos.shape != (qkv.shape[0], head_dim):
            raise ValueError(
                f"rope_kv_write_: qkv {tuple(qkv.shape)} is not {heads} + 2 x {kv_heads} heads of "
                f"{head_dim}, or cos {tuple(cos.shape)} not [{qkv.shape[0]}, {head_dim}]"
            )
        self._pointwise.launch_rope_kv_write(qkv, cos, sin, heads, kv_heads, head_dim, cache, slots, norms)

    def kv_write(self, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v [T, Hkv, Dh] (rows may be strided: slices of a fused qkv) -> a layer's cache [2, S, Hkv, Dh] at
        `slots` [T] (int64)."""
        packed = all(t.stride(1) == t.shape[2] and t.stride(2) == 1 for t in (k, v))
        if not packed or not cache.is_contiguous():
            raise ValueError("kv_write needs each row's heads packed (unit stride, Dh apart) and a contiguous cache")
        self._pointwise.launch_kv_write(k, v, cache, slots)

    def decode_attention(
        self, q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, block_size: int,
        window: int | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """As `Kernels.decode_attention`: q [B, H, Dh] against the paged cache [2, slots, Hkv, Dh] -> [B, H, Dh];
        `sinks` [H]: each query head's sink logit (gpt-oss)."""
        q = q.contiguous()
        out = torch.empty_like(q)
        sinks = None if sinks is None else sinks.float().contiguous()
        self._attention.launch_decode(q, cache, tables, lens, block_size, window or 0, out, q.shape[-1] ** -0.5,
                                      sinks)  # fmt: skip
        return out

    def prefill_attention(
        self, q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, seqs: torch.Tensor, block_size: int,
        window: int | None, out: torch.Tensor, sinks: torch.Tensor | None = None, *, max_rows: int,
    ) -> None:  # fmt: skip
        """As `Kernels.prefill_attention` (the cache unquantized): the prompts' new rows of q [T, H, Dh] over the
        paged cache [2, slots, Hkv, Dh], which holds their keys and values already, through tables [S, M] and seqs
        [S, 3] (first row, new tokens, context length; int64, on the device) -> those rows of out [T, H, Dh]
        (contiguous). `max_rows`: the most new tokens of a sequence, known on the host (the grid's extent)."""
        dh = q.shape[2]
        if q.stride(2) != 1 or q.stride(1) != dh or not out.is_contiguous() or q.dtype != cache.dtype:
            raise ValueError("prefill_attention needs heads Dh apart, a contiguous out and one dtype")
        sinks = None if sinks is None else sinks.float().contiguous()
        self._prefill.launch_prefill(q, cache, tables, seqs, block_size, window or 0, out, sinks, max_rows)

    def q8_linear(
        self, x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
    ) -> torch.Tensor:
        """x [M, K'] (K' <= K) @ (q [N, K] int8 * d [N, K/32] float32 per 32-block)^T (+ bias float32 [N]) ->
        out [M, N] in x's dtype."""
        self._int8.launch_q8_linear(x.contiguous(), q, d, bias, out)
        return out

    def fp8_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (float8 e4m3 [M, K], float32 scales [M, 1]): `gpu_linear.quantize_rows` in one launch."""
        x = x.contiguous()
        q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
        self._fp8.launch_fp8_rows(x, q, scale)
        return q, scale

    def fused_moe(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
                  ) -> torch.Tensor:  # fmt: skip
        """A mixture of experts' SwiGLU MLP over each token's chosen experts (kernels/cuda/moe.py): x [T, D], ids and
        weights [T, k], w1 [E, 2I, D] (gate rows, then up), w2 [E, D, I] -> [T * k, D] float32, row t * k + j token
        t's j-th expert's output times its weight."""
        tokens, top_k = ids.shape
        slots, block_expert, blocks = self._moe.align(ids, w1.shape[0])
        gate_up = torch.empty(tokens * top_k, w1.shape[1], dtype=x.dtype, device=x.device)  # [P, 2I]
        self._moe.grouped_gemm(x, w1, gate_up, slots, block_expert, blocks, top_k, True, None)
        act = self.silu_mul(gate_up)  # [P, I]
        out = torch.empty(tokens * top_k, w2.shape[1], dtype=torch.float32, device=x.device)  # [P, D]
        flat = weights.float().flatten().contiguous()  # [P]
        self._moe.grouped_gemm(act, w2, out, slots, block_expert, blocks, top_k, False, flat)
        return out


@functools.cache
def cuda_kernels() -> CudaKernels:
    return CudaKernels()


__all__ = ["CudaKernels", "cuda_kernels", "unavailable"]
