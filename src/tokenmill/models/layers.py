"""Layers shared by the decoder-only families: RMSNorm, attention (rotary embeddings: models/rope.py), gated MLP,
the stack.

Shapes: T = tokens in the flattened batch, D = hidden size, H / Hkv = query / key-value heads,
Dh = head dim. Projections are fused (q|k|v and gate|up) to halve the matmul calls per layer; the weight
loader splits Hugging Face's separate tensors into the fused ones (see `STACKED_PARAMS`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention import KVBackend
from tokenmill.kernels import CudaKernels, FusedOps, Kernels
from tokenmill.model_config import ModelConfig
from tokenmill.models.linear import KernelLinear, Linear
from tokenmill.models.rope import RotaryEmbedding, apply_rotary

# fused parameter -> (HF sub-module name, shard index) in the order they are concatenated
STACKED_PARAMS: dict[str, tuple[tuple[str, int], ...]] = {
    "qkv_proj": (("q_proj", 0), ("k_proj", 1), ("v_proj", 2)),
    "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
}


def _fused(ops: FusedOps | None, x: torch.Tensor) -> FusedOps | None:
    """The fused ops, when bound (`bind_kernels`) and x is a contiguous tensor of theirs (the CPU's kernels: CPU
    bf16/float32; the GPU's Triton kernels: CUDA bf16/fp16/float32)."""
    if ops is not None and x.device.type == ops.device_type and x.dtype in ops.dtypes and x.is_contiguous():
        return ops
    return None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops: FusedOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if (ops := _fused(self.ops, x)) is not None:
            return ops.rmsnorm(x, None, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(x + residual), x + residual), in one pass when fused (the residual is updated in place)."""
        if (ops := _fused(self.ops, x)) is not None and residual.is_contiguous():
            return ops.rmsnorm(x, residual, self.weight, self.eps), residual
        residual = x + residual
        return self(residual), residual


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.ops: FusedOps | None = None
        self.sinks: torch.Tensor | None = None  # [H]: each head's sink logit in the softmax (gpt-oss's subclass)
        self.lora: dict[str, Any] | None = None  # "qkv_proj" / "o_proj" -> its LoRA adapters (models/lora.py)

    def forward(
        self,
        x: torch.Tensor,  # [T, D]
        cos: torch.Tensor,  # [T, Dh]
        sin: torch.Tensor,  # [T, Dh]
        kv: KVBackend,
        meta: Any,  # what `kv.prepare` built for this batch
    ) -> torch.Tensor:  # [T, D]
        qkv = self.qkv_proj(x)  # [T, q + 2 kv]
        if self.lora is not None:
            qkv = self.lora["qkv_proj"].add(x, qkv)
        written = self._rope_and_write(qkv, cos, sin, kv, meta)
        ops = _fused(self.ops, qkv) if self.q_norm is None and not written else None
        if ops is not None:  # RoPE in place on the q and k heads, side by side at the start of each qkv row
            ops.rope_(qkv, cos, sin, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, Dh]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, Dh]
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, Dh]
        if not written:
            if ops is None:
                if self.q_norm is not None and self.k_norm is not None:
                    q, k = self.q_norm(q), self.k_norm(k)
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            kv.write(self.layer_idx, k, v, meta)
        o = kv.attend(self.layer_idx, q, k, v, meta, self.sinks).reshape(-1, self.q_size)  # [T, H * Dh]
        out = self.o_proj(o)  # [T, D]
        return out if self.lora is None else self.lora["o_proj"].add(o, out)

    def _rope_and_write(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVBackend, meta: Any
    ) -> bool:
        """The GPU kernels' one launch for the q/k norms (Qwen3's plain RMSNorm; none elsewhere), RoPE and the KV
        write, where the kernels are bound and the pool is theirs (`PagedKVCache.rope_and_write`)."""
        if not isinstance(self.ops, CudaKernels) or _fused(self.ops, qkv) is None or (paged := kv.paged) is None:
            return False
        norms = None
        if self.q_norm is not None or self.k_norm is not None:
            q_norm, k_norm = self.q_norm, self.k_norm
            if type(q_norm) is not RMSNorm or type(k_norm) is not RMSNorm or q_norm.eps != k_norm.eps:
                return False
            norms = (q_norm.weight, k_norm.weight, q_norm.eps)
        return paged.rope_and_write(self.layer_idx, qkv, cos, sin, self.num_heads, self.head_dim, meta, norms)


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """config.json's `hidden_act` (one of model_config.ACTIVATIONS) applied to x."""
    if name == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="none" if name == "gelu" else "tanh")


class Scratch:
    """Buffers that every layer of one model reuses for its intermediates (the layers run one at a time): the
    MLP's [T, 2I] and [T, I] tensors, 60 MB for Qwen2.5-0.5B at a 2048-token prefill. Allocated afresh in every
    layer, such tensors fault in new zeroed pages each time (glibc maps and unmaps them): a 40 MB tensor took
    8.0 ms to allocate and fill against 2.1 ms to refill (Xeon, 2 threads). That model's int4 MLP at 2048 rows:
    133 -> 122 ms a layer; a 16 x 128-token prefill step, alternated in one process: 3.51 -> 3.46 s (AVX-VNNI
    proxy). Each buffer grows to the most rows seen and stays."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:  # [rows, cols]
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < rows * cols or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(rows * cols, dtype=dtype)
        return buf[: rows * cols].view(rows, cols)

    def clear(self) -> None:
        """Let the buffers go (the engine, when it goes idle: 60-90 MB a 0.5B model otherwise holds while nothing
        runs); the next step allocates them again."""
        self._buffers.clear()


# A long prefill's MLP intermediates: Qwen2.5-0.5B's 2048-token chunk held 60 MB of them, and its peak RSS 94 MB
# over the layer's start (blocks of 512 rows cost the layer the same time: Zen 3, Q4_K_M; docs/benchmarks.md)
MLP_BLOCK_BYTES = 16 << 20


class GatedMLP(nn.Module):
    """`intermediate_size`: an expert's width (models/moe.py), where it is not the model's."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.intermediate_size, self.act = intermediate_size or cfg.intermediate_size, cfg.hidden_act
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(self.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.ops: FusedOps | None = None
        self.scratch: Scratch | None = None  # shared by the model's MLPs (bind_kernels)
        self.lora: dict[str, Any] | None = None  # "gate_up_proj" / "down_proj" -> its LoRA adapters (models/lora.py)
        # rows a call takes at a time: a [T, 2I] + [T, I] pair of at most MLP_BLOCK_BYTES in bf16
        self.block_rows = max(64, MLP_BLOCK_BYTES // (3 * self.intermediate_size * 2) // 64 * 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        """A long prefill's rows go through in blocks, so that its intermediates stay small (the rows are
        independent, and the kernels give each row the same result in any block)."""
        rows, step = x.shape[0], self.block_rows
        if rows <= step:
            return self._rows(x)
        first = self._rows(x[:step])  # [step, D]
        out = first.new_empty(rows, first.shape[1])  # [T, D]
        out[:step] = first
        for start in range(step, rows, step):
            out[start : start + step] = self._rows(x[start : start + step])
        return out

    def _rows(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        rows, scratch, proj = x.shape[0], self.scratch, self.gate_up_proj
        if scratch is not None and isinstance(proj, KernelLinear):
            gate_up = proj(x, out=scratch.get("gate_up", rows, 2 * self.intermediate_size, x.dtype))  # [T, 2I]
        else:
            gate_up = proj(x)
        if self.lora is not None:
            gate_up = self.lora["gate_up_proj"].add(x, gate_up)
        if self.act == "silu" and (ops := _fused(self.ops, gate_up)) is not None:
            act = None if scratch is None else scratch.get("act", rows, self.intermediate_size, x.dtype)  # [T, I]
            h = ops.silu_mul(gate_up, out=act)  # [T, I]
        elif self.act != "silu" and isinstance(ops := _fused(self.ops, gate_up), CudaKernels):  # GeGLU on the GPU
            h = ops.gelu_mul(gate_up, tanh=self.act != "gelu")  # [T, I]
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [T, I] each
            h = activation(self.act, gate) * up
        out = self.down_proj(h)  # [T, D]
        return out if self.lora is None else self.lora["down_proj"].add(h, out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = GatedMLP(cfg)  # (a MoE family's sparse layers: models/moe.py)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVBackend,
        meta: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, D] the block's output, [T, D] the residual stream before it)
        """The residual add is carried into the next norm (vLLM's shape): x + residual is the layer's input."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h, residual = self.post_attention_layernorm.add_and_norm(self.self_attn(h, cos, sin, kv, meta), residual)
        return self.mlp(h), residual  # fmt: skip


def embedding(rows: int, dim: int) -> nn.Embedding:
    """An nn.Embedding left uninitialised (the checkpoint fills it): its normal_ init on the meta device, where
    models are built, imports torch._dynamo, 1.4-2 s of every start (Xeon)."""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


class DecoderModel(nn.Module):
    """Embeddings -> decoder layers -> final norm. Named like HF's `model.*` so weights map one to one."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVBackend, meta: Any) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, D]
        cos, sin = self.rotary(positions, x.dtype)  # [T, Dh] each
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, kv, meta)
        return self.norm.add_and_norm(x, residual)[0] if residual is not None else self.norm(x)


class CausalLM(nn.Module):
    """A decoder-only language model: `forward` gives final hidden states, `compute_logits` the vocabulary scores.

    A family subclasses this and, where its checkpoint differs, adjusts the config or the modules. A family
    with a decoder of another shape (GPT-2) overrides `build_decoder` and `embeddings`, and names the
    checkpoint's quirks for the loader in the class attributes below.
    """

    # checkpoint tensors (name suffixes) stored [in, out] (GPT-2's Conv1D), and ones the loader skips
    hf_transposed: tuple[str, ...] = ()
    hf_ignored: tuple[str, ...] = ("rotary_emb.inv_freq",)
    # checkpoint name prefixes renamed to ours (a multimodal checkpoint's text model), and prefixes skipped
    hf_renames: tuple[tuple[str, str], ...] = ()
    hf_skipped_prefixes: tuple[str, ...] = ()
    # checkpoint name parts renamed to ours wherever they stand (Mixtral's `block_sparse_moe`, `w1`): "a" -> "b"
    # turns ".a." into ".b."
    hf_part_renames: tuple[tuple[str, str], ...] = ()
    # whether a decode step may run as a recorded CUDA graph (a MoE's per-expert path reads its routing on the host:
    # not, unless its experts run in the GPU's grouped GEMMs)
    graph_capturable: bool = True

    @classmethod
    def hf_tensors(cls, tensors: Iterable[Any]) -> Iterable[Any]:
        """A checkpoint's (name, tensor, where) in another layout than the modules' rewritten to theirs (gpt-oss's
        stacked, interleaved and MXFP4 experts), before the renames above apply."""
        return tensors

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.build_decoder(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embeddings().weight

    def build_decoder(self, cfg: ModelConfig) -> None:
        """Set the decoder as an attribute, named as in the checkpoint (`model.*`)."""
        self.model = DecoderModel(cfg)

    def decoder(self) -> nn.Module:
        return self.model

    def embeddings(self) -> nn.Embedding:
        """The token embedding (a tied LM head shares its weight)."""
        return self.model.embed_tokens

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv: KVBackend,  # where keys and values live (attention/)
        meta: Any,  # what `kv.prepare` built for this batch
    ) -> torch.Tensor:  # [T, D]
        return self.decoder()(input_ids, positions, kv, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] float32
        return self.lm_head(hidden).float()

    def bind_gpu_ops(self, ops: Any) -> None:
        """After `bind_kernels` with the GPU's Triton kernels: what a family runs in them beyond the layers' own
        (a MoE's experts: models/moe.py). Nothing here."""

    def release_scratch(self) -> None:
        """Let go of the buffers the MLPs share while steps run (Scratch.clear)."""
        for m in self.modules():
            if isinstance(m, GatedMLP) and m.scratch is not None:
                m.scratch.clear()


def bind_kernels(model: nn.Module, ops: FusedOps | None) -> int:
    """Give the norms, attention and MLPs the fused ops (or None: pure torch). Returns how many modules."""
    modules = [m for m in model.modules() if isinstance(m, RMSNorm | Attention | GatedMLP)]
    scratch = Scratch() if isinstance(ops, Kernels) else None  # host buffers, for the CPU kernels' outputs
    for m in modules:
        m.ops = ops
        if isinstance(m, GatedMLP):
            m.scratch = scratch
    return len(modules)
