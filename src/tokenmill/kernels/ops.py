"""The compiled kernels behind a typed, checked call: tensors in, tensors out.

The C++ side takes raw pointers (it compiles in seconds without torch's tensor headers), so every check of
shape, dtype, layout and device happens here, before a pointer crosses.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from tokenmill.kernels.formats import BLOCK, check_packed
from tokenmill.kernels.stack_ops import NativeStack, StackShape

if TYPE_CHECKING:
    from tokenmill.sampling_params import SamplingParams


QUANTIZED_KV = (torch.int8, torch.float8_e4m3fn)  # the KV caches that come with row scales (kv_quant.h)


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dtype not in (torch.float32, torch.bfloat16) or logits.dim() != 2 or logits.device.type != "cpu":
        raise ValueError("logits must be a float32 or bfloat16 CPU tensor [B, V]")


def kernel_sinks(sinks: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """Attention sinks as the kernels read them: [heads] float32, contiguous (None: none)."""
    if sinks is None:
        return None
    if sinks.numel() != heads:
        raise ValueError(f"attention sinks: {sinks.numel()} values for {heads} heads")
    return sinks.detach().float().contiguous()


class Kernels:
    """One compiled variant (`level`: one of isa.LEVELS). The fused ops take tensors of `device_type` in `dtypes`
    (the GPU's Triton kernels, kernels/cuda, have the same calls)."""

    device_type = "cpu"
    dtypes = (torch.bfloat16, torch.float32)

    def __init__(self, module: ModuleType, level: str, layout: str) -> None:
        """`layout`: what fixes the packed weights' layout (build.layout_key), which keys their cache."""
        self.module, self.level, self.lanes, self.layout = module, level, int(module.lanes), layout

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, format_id: int, n: int, k: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, K'] (bfloat16 or float32, K' <= k) @ packed^T (+ bias, float32 [n]) -> [M, n] in x's dtype."""
        if x.dim() != 2 or x.shape[1] > k or x.dtype not in (torch.bfloat16, torch.float32) or x.device.type != "cpu":
            raise ValueError(f"x must be a [M, <= {k}] bfloat16/float32 CPU tensor, got {tuple(x.shape)} {x.dtype}")
        check_packed(packed, format_id, n, k)
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
            raise ValueError(f"bias must be a contiguous float32 [{n}] tensor")
        x = x.contiguous()
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        self.module.linear(
            x.data_ptr(), x.dtype == torch.bfloat16, x.shape[0], x.shape[1], packed.data_ptr(), format_id, n, k,
            0 if bias is None else bias.data_ptr(), out.data_ptr(), 0,
        )  # fmt: skip
        return out

    def set_amx(self, mode: int) -> int:
        """AMX tiles for the linears: -1 where the CPU has them (the default), 0 never, 1 from one row (tests). The
        setting is this compiled variant's, for the whole process. Returns the old one."""
        return int(self.module.set_amx(mode))

    def unpack(self, packed: torch.Tensor, format_id: int, n: int, k: int) -> torch.Tensor:
        """The packed weight as float32 [n, k] (k the packed, padded width)."""
        check_packed(packed, format_id, n, k)
        out = torch.empty(n, k, dtype=torch.float32)
        self.module.unpack(packed.data_ptr(), format_id, n, k, out.data_ptr())
        return out

    def unpack_rows(self, packed: torch.Tensor, format_id: int, n: int, k: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64 [T], each in [0, n)) of a packed weight (bf16 or quantized) as float32 [T, k]: an
        embedding looked up in its panels."""
        check_packed(packed, format_id, n, k)
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise IndexError(f"index out of range: the embedding has {n} rows")
        out = torch.empty(ids.numel(), k, dtype=torch.float32)
        self.module.unpack_rows(packed.data_ptr(), format_id, k, ids.data_ptr(), ids.numel(), out.data_ptr())
        return out

    def quantize_rows(self, x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 x [M, K] (K a multiple of `group`: 32, or 256 as for the K-quants) -> (int8 q [M, K], float32
        d [M, K/32]), as the quantized linears quantize their input (formats.quantize_activations is the
        reference)."""
        if group not in (BLOCK, 256):
            raise ValueError(f"group must be {BLOCK} or 256, got {group}")
        if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] % group:
            raise ValueError(f"x must be float32 [M, K] with K a multiple of {group}, got {tuple(x.shape)} {x.dtype}")
        x = x.contiguous()
        q = torch.empty(x.shape, dtype=torch.int8)
        d = torch.empty(x.shape[0], x.shape[1] // BLOCK, dtype=torch.float32)
        self.module.quantize_rows(x.data_ptr(), x.shape[0], x.shape[1], d.data_ptr(), q.data_ptr(), group)
        return q, d

    def decode_stack(
        self, dtype: torch.dtype, shape: StackShape, eps: float, cache: torch.Tensor, final_norm: torch.Tensor,
        num_layers: int, threads: int, scales: torch.Tensor | None = None,
    ) -> NativeStack:  # fmt: skip
        """A native decode stack over the KV pool `cache` [L, 2, slots, Hkv, Dh] (a quantized pool with its bf16
        `scales` [L, 2, slots, Hkv]), behind checked calls."""
        return NativeStack(self.module, dtype, shape, eps, cache, final_norm, num_layers, threads, scales)

    # -- the fused decode ops (fused.h). Callers pass contiguous CPU tensors of one dtype (bf16 or float32). ----
    def rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """[rows, D]: residual += x (in place, when given), then rmsnorm(residual or x) * weight."""
        out = torch.empty_like(x)
        d = x.shape[-1]
        self.module.rmsnorm(
            x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(),
            x.dtype == torch.bfloat16, eps, out.data_ptr(), x.numel() // d, d,
        )  # fmt: skip
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
        """Rotate-half RoPE in place on x [T, >= heads * Dh] (rows may be wider: a slice of a fused qkv)."""
        self.module.rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.dtype == torch.bfloat16, x.shape[0], heads,
                         head_dim, x.stride(0))  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, 2I] (gate, then up) -> silu(gate) * up [rows, I], into `out` when given."""
        rows, width = gate_up.shape
        if out is None:
            out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        elif out.shape != (rows, width // 2) or out.dtype != gate_up.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {gate_up.dtype} [{rows}, {width // 2}], got {tuple(out.shape)}")
        self.module.silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.dtype == torch.bfloat16, rows, width // 2)
        return out

    def clamped_swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """[rows, 2I] (gate, then up) -> gpt-oss's (clamp(up) + 1) * g * sigmoid(alpha g), g = gate clamped above at
        `limit` [rows, I], each op rounded as torch's (ops/fused.h)."""
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self.module.clamped_swiglu(gate_up.data_ptr(), out.data_ptr(), gate_up.dtype == torch.bfloat16, rows,
                                   width // 2, alpha, limit)  # fmt: skip
        return out

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """logits [B, V] float32: where bitmask [B, W] int32 has token t's bit clear, -inf (in place)."""
        if logits.dtype != torch.float32 or not logits.is_contiguous() or logits.device.type != "cpu":
            raise ValueError("logits must be a contiguous float32 CPU tensor")
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
            raise ValueError(
                f"bitmask must be int32 [{logits.shape[0]}, W], got {tuple(bitmask.shape)} {bitmask.dtype}"
            )
        bitmask = bitmask.contiguous()
        self.module.apply_bitmask(logits.data_ptr(), bitmask.data_ptr(), *logits.shape, bitmask.shape[1])

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] float32 -> [B] int64: each row's argmax, as torch.argmax (first maximum; first NaN)."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.device.type != "cpu":
            raise ValueError("logits must be a float32 CPU tensor [B, V]")
        logits = logits.contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self.module.argmax_rows(logits.data_ptr(), *logits.shape, out.data_ptr())
        return out

    def draw(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        u: Sequence[float],
        filtered: torch.Tensor | None = None,
    ) -> list[int]:
        """logits [B, V] float32 or bfloat16 -> each row's token: a drawing row's after its temperature, top-k, top-p
        and min-p, at its uniform number u [B] in [0, 1) (sampling/sampler.py's rules); a greedy row's argmax. A
        drawing row never draws a NaN, and where some logits are +inf (a penalty's overflow) draws among those alone
        (the torch path's softmax makes such rows NaN). `filtered` [B, V] float32 (tests): each drawing row's values
        after the filters, over the temperature, -inf where dropped."""
        _check_logits(logits)
        if filtered is not None and (filtered.shape != logits.shape or filtered.dtype != torch.float32
                                     or not filtered.is_contiguous()):  # fmt: skip
            raise ValueError(f"filtered must be a contiguous float32 {tuple(logits.shape)} tensor")
        logits, out = logits.contiguous(), 0 if filtered is None else filtered.data_ptr()
        return self.module.draw_lists(
            logits.data_ptr(), logits.dtype == torch.bfloat16, *logits.shape, [p.temperature for p in params],
            [max(p.top_k, 0) for p in params], [p.top_p for p in params], [p.min_p for p in params], list(u), out,
        )  # fmt: skip

    def logprobs(
        self, logits: torch.Tensor, rows: Sequence[int], token_ids: Sequence[int], num_top: Sequence[int]
    ) -> list[dict[int, float]]:
        """Rows `rows` of logits [B, V] (float32 or bfloat16): each one's {token: logprob} at token_ids[r] and at its
        num_top[r] most likely tokens, as sampling.topk_logprobs over torch's log_softmax, within 1e-4; where tokens
        tie at the last place, this takes the lower ids, and torch.topk any of them."""
        _check_logits(logits)
        logits = logits.contiguous()
        out = []
        for token, (chosen, top) in zip(token_ids, self.module.logprobs_lists(
                logits.data_ptr(), logits.dtype == torch.bfloat16, *logits.shape, list(rows), list(token_ids),
                list(num_top))):  # fmt: skip
            row = {token: chosen}
            row.update(top)
            out.append(row)
        return out

    def prefill_attention(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        tables: torch.Tensor,
        seqs: torch.Tensor,
        block_size: int,
        window: int | None,
        out: torch.Tensor,
        sinks: torch.Tensor | None = None,
        scales: torch.Tensor | None = None,
    ) -> None:
        """Prompts' new tokens (prefills and chunks) over a layer's paged cache [2, slots, Hkv, Dh], which already
        holds their keys and values: q [T, H, Dh] (token rows may be strided, heads Dh apart); tables [S, M]
        (int64) block ids; seqs [S, 3] (int64): each sequence's first row in q, new tokens, context length (new
        ones included). Writes those rows of out [T, H, Dh] (contiguous); with a window, each token sees only the
        last `window` positions; with sinks [H], each head's sink logit joins its softmax's denominator. Dh must be
        a multiple of 16. A quantized cache comes with its bf16 scales [2, slots, Hkv] (`_kv_scales`)."""
        h, dh = q.shape[1:]
        same = q.dtype == cache.dtype if scales is None else cache.dtype in QUANTIZED_KV
        if q.stride(2) != 1 or q.stride(1) != dh or not out.is_contiguous() or dh % 16 or not same:
            raise ValueError("prefill_attention needs heads Dh apart, Dh % 16 == 0, a contiguous out, one dtype")
        sink = kernel_sinks(sinks, h)
        self.module.prefill_attention(
            q.data_ptr(), q.stride(0), cache.data_ptr(), q.dtype == torch.bfloat16, cache.shape[1], tables.data_ptr(),
            tables.shape[1], block_size, seqs.data_ptr(), seqs.shape[0], h, cache.shape[2], dh, dh**-0.5, window or 0,
            out.data_ptr(), 0 if sink is None else sink.data_ptr(), *_kv_scales(cache, scales),
        )  # fmt: skip

    def kv_write(
        self, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
        scales: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """k, v [T, Hkv, Dh] (rows may be strided: slices of a fused qkv) -> a layer's cache [2, S, Hkv, Dh] at
        `slots` [T] (int64); a quantized cache's rows (int8 or float8_e4m3fn) are quantized, their bf16 scales
        written to `scales` [2, S, Hkv] (attention/kv_quant.h)."""
        width = k.shape[1] * k.shape[2]
        self.module.kv_write(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k.dtype == torch.bfloat16,
                             cache.data_ptr(), cache.shape[1], slots.data_ptr(), k.shape[0], width,
                             *_kv_scales(cache, scales), k.shape[2])  # fmt: skip

    def lora_add(
        self, x: torch.Tensor, out: torch.Tensor, slots: torch.Tensor, a_ptrs: torch.Tensor, bt_ptrs: torch.Tensor,
        ranks: torch.Tensor, scales: torch.Tensor, tables_bf16: bool = False,
    ) -> None:  # fmt: skip
        """out [T, N] += each row's adapter update scale * B (A x[t]) (ops/lora.h), in place: x [T, K] (rows may be
        strided), slots [T] int64 each row's slot in the tables (-1: none); a_ptrs, bt_ptrs, ranks [S] int64 and
        scales [S] float32: each slot's A [r, K] and B^T in panels [ceil(N / 16), r, 16] (LoraProjection's tables;
        float32, or bfloat16 with `tables_bf16`), rank and scale."""
        t, k = x.shape
        if out.shape[0] != t or slots.shape != (t,) or x.dtype != out.dtype or not out.is_contiguous():
            raise ValueError("lora_add needs out [T, N] contiguous in x's dtype and one slot per row")
        # (a slot past the tables: ValueError from the kernel, before it writes a row)
        self.module.lora_add(x.data_ptr(), x.stride(0), x.dtype == torch.bfloat16, out.data_ptr(), t, out.shape[1],
                             k, slots.data_ptr(), a_ptrs.data_ptr(), bt_ptrs.data_ptr(), ranks.data_ptr(),
                             scales.data_ptr(), len(ranks), tables_bf16)  # fmt: skip

    def decode_attention(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        block_size: int,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [B, H, Dh], one new token per sequence, over a layer's paged cache [2, slots, Hkv, Dh] through block
        tables [B, M] (int64) and context lengths [B] (int64) -> [B, H, Dh]; with a window, over the last
        `window` positions only; with sinks [H], each head's sink logit joins its softmax's denominator. A quantized
        cache comes with its bf16 scales [2, slots, Hkv]."""
        b, h, dh = q.shape
        out = torch.empty_like(q)
        sink = kernel_sinks(sinks, h)
        self.module.decode_attention(
            q.data_ptr(), cache.data_ptr(), q.dtype == torch.bfloat16, cache.shape[1], tables.data_ptr(),
            tables.shape[1], lens.data_ptr(), b, h, cache.shape[2], dh, block_size, dh**-0.5, window or 0,
            out.data_ptr(), 0 if sink is None else sink.data_ptr(), *_kv_scales(cache, scales),
        )  # fmt: skip
        return out


def _kv_scales(cache: torch.Tensor, scales: torch.Tensor | None) -> tuple[int, bool]:
    """The kernels' `kv_scales, fp8` arguments: a quantized cache's bf16 scales [2, slots, Hkv] (contiguous), and
    whether its rows are float8 e4m3 (else int8); (0, False) for a cache in the activations' dtype."""
    quantized = cache.dtype in QUANTIZED_KV
    if scales is None:
        if quantized:
            raise ValueError(f"a {cache.dtype} KV cache needs its scales")
        return 0, False
    if not quantized or scales.dtype != torch.bfloat16 or not scales.is_contiguous():
        raise ValueError("KV scales are a contiguous bfloat16 [2, slots, Hkv] beside an int8 or float8_e4m3fn cache")
    if tuple(scales.shape) != tuple(cache.shape[:3]):
        raise ValueError(f"KV scales of shape {tuple(scales.shape)} do not match the cache's {tuple(cache.shape[:3])}")
    return int(scales.data_ptr()), cache.dtype == torch.float8_e4m3fn
