"""Mixture-of-experts MLPs (Qwen3-MoE, Mixtral): a router picks each token's top-k experts, and only those run.

Shapes: T = tokens in the flattened batch, D = hidden size, E = experts, k = experts per token (`MoEConfig.top_k`).

Each expert is a `GatedMLP` of the experts' width, so its two linears are ordinary ones: the loader packs them from a
checkpoint's per-expert tensors (or a GGUF's [E, I, D] blocks, split by expert where they lie), `--quantization`
quantizes them, and the CPU kernels multiply them, like any dense model's. The router's [E, D] weight is no
`nn.Linear`, so it is never quantized (llama.cpp keeps `ffn_gate_inp` in F32 too): a coarser router would pick
other experts, which no later rounding undoes.

A step groups the batch's (token, expert) pairs by expert and runs each chosen expert once over its rows: the
bytes read are the chosen experts' alone, never a dense pass over all E.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ConfigError
from tokenmill.model_config import ModelConfig, MoEConfig
from tokenmill.models.layers import CausalLM, GatedMLP
from tokenmill.models.linear import KernelLinear, Linear


class Router(nn.Module):
    """The router: a token's score for each expert, in the model's dtype (as transformers computes it)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))  # [E, D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, E]
        return F.linear(x, self.weight)


MAX_TOP_K = 64  # experts per token the CPU kernels take (linear/experts.h); more run on torch's ops


class SparseMoE(nn.Module):
    """The MoE MLP of one layer: `gate` (the router, named as in the checkpoints) and `experts`."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.gate = Router(cfg.hidden_size, moe.num_experts)
        self.experts = nn.ModuleList(GatedMLP(cfg, moe.intermediate_size) for _ in range(moe.num_experts))
        self._experts_call: _ExpertsCall | tuple[()] | None = None  # (None: not looked at yet)
        self._gpu: tuple[Any, torch.Tensor, torch.Tensor] | None = None  # (ops, w1, w2): `fuse_on_gpu`

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, D] -> weights [T, k], ids [T, k]
        """Each token's chosen experts and their weights: the softmax over all experts in float32, its top k,
        renormalised over those k where the config says so (transformers' routers). On the CPU kernels, their
        router (ops/route.h), which the decode stack also runs: both paths pick the same experts to the bit."""
        ops = self.router_ops(x)
        if ops is not None:
            return self._kernel_route(ops, x)
        if self.moe.softmax_after_top_k:  # gpt-oss: the top k logits, then their softmax in the model's dtype
            top, ids = torch.topk(self.gate(x), self.moe.top_k, dim=-1)  # [T, k] each
            return torch.softmax(top, dim=-1, dtype=top.dtype), ids
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, ids = torch.topk(probs, self.moe.top_k, dim=-1)  # [T, k] each
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.moe.weights_in_float32 else weights.to(x.dtype)), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        weights, ids = self.route(x)
        if self._kernels_take(x):
            return self._routed(x, weights, ids)
        if self._gpu is not None and x.device == self._gpu[1].device:
            return self._grouped(x, weights, ids)
        k = self.moe.top_k
        flat = ids.flatten()  # [T*k]: token t's j-th choice at t*k + j
        order = flat.argsort(stable=True)  # [T*k], the pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()  # [E] pairs per expert
        tokens = order // k  # [T*k] each pair's token, in that order
        ys = self._each(x.index_select(0, tokens), counts)  # [T*k, D]: each expert's rows side by side
        scaled = (ys * weights.flatten()[order][:, None]).to(x.dtype)  # [T*k, D]
        # each token's outputs summed in expert order, as transformers adds them
        return torch.zeros_like(x).index_add_(0, tokens, scaled)

    def router_ops(self, x: torch.Tensor) -> Any | None:
        """The CPU kernels the router runs on for rows like `x` (the experts' own), or None: torch's ops."""
        first = self.experts[0].gate_up_proj
        weight, bias = self.gate.weight, self.router_bias
        if not isinstance(first, KernelLinear) or first.ops is None or not 1 <= self.moe.top_k <= MAX_TOP_K:
            return None
        if x.device.type != "cpu" or weight.dtype != x.dtype or x.dtype not in (torch.bfloat16, torch.float32):
            return None
        if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
            return None
        return first.ops if weight.is_contiguous() else None

    @property
    def router_bias(self) -> torch.Tensor | None:
        """The router's bias [E] (gpt-oss's), or None."""
        bias = getattr(self.gate, "bias", None)
        return bias if isinstance(bias, torch.Tensor) else None

    def _kernel_route(self, ops: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.contiguous()
        tokens, k = x.shape[0], self.moe.top_k
        ids = torch.empty(tokens, k, dtype=torch.int64)  # [T, k]
        weights = torch.empty(tokens, k)  # [T, k] float32, rounded to x's dtype unless the family keeps float32
        ops.module.moe_route(x.data_ptr(), x.dtype == torch.bfloat16, tokens, x.shape[1], self.gate.weight.data_ptr(),
                             self.moe.num_experts, k, self.moe.norm_topk_prob, self.moe.weights_in_float32,
                             ids.data_ptr(), weights.data_ptr(), _ptr(self.router_bias),
                             self.moe.softmax_after_top_k)  # fmt: skip
        return (weights if self.moe.weights_in_float32 else weights.to(x.dtype)), ids

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # -> [T, D]
        """Grouping, every chosen expert and the weighted sum in one kernel call (linear/experts.h: `moe_routed`),
        with the numbers of the per-expert path below."""
        call = self._experts_call
        assert call
        x, ids = x.contiguous(), ids.contiguous()
        w = weights.float().contiguous()  # [T, k] (already rounded to x's dtype where the family rounds them)
        out = torch.empty_like(x)  # [T, D]
        clamped = self.moe.clamped_swiglu or (0.0, 0.0)
        call.ops.module.moe_routed(x.data_ptr(), x.dtype == torch.bfloat16, x.shape[0], x.shape[1], ids.data_ptr(),
                                   w.data_ptr(), self.moe.top_k, self.moe.num_experts, call.gate_up.data_ptr(),
                                   call.gate_up_format, call.gate_up_k, call.down.data_ptr(), call.down_format,
                                   self.moe.intermediate_size, call.down_k, out.data_ptr(), _ptr(call.gate_up_bias),
                                   _ptr(call.down_bias), self.moe.clamped_swiglu is not None, *clamped)  # fmt: skip
        return out

    def fuse_on_gpu(self, ops: Any) -> bool:
        """Stack the experts' weights for the GPU's grouped GEMMs (kernels/cuda/moe.py: no host sync, so CUDA
        graphs record the layer), each expert's linears then views of the stacks (no second copy). False, and the
        per-expert path stays, where an expert is quantized or biased, or its activation is not SiLU's SwiGLU."""
        experts = [e for e in self.experts if isinstance(e, GatedMLP)]
        linears = [m for e in experts for m in (e.gate_up_proj, e.down_proj) if type(m) is Linear and m.bias is None]
        if len(linears) != 2 * len(self.experts) or self.moe.clamped_swiglu is not None or experts[0].act != "silu":
            return False
        gate_up, down = linears[0::2], linears[1::2]
        w1 = torch.stack([m.weight.detach() for m in gate_up])  # [E, 2I, D]
        w2 = torch.stack([m.weight.detach() for m in down])  # [E, D, I]
        for modules, stack in ((gate_up, w1), (down, w2)):
            for m, w in zip(modules, stack, strict=True):
                m.weight = nn.Parameter(w, requires_grad=False)
        self._gpu = (ops, w1, w2)
        return True

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # -> [T, D]
        ops, w1, w2 = self._gpu  # type: ignore[misc]
        tokens, k = ids.shape
        out = ops.fused_moe(x.contiguous(), ids, weights, w1, w2).to(x.dtype).view(tokens, k, -1)  # [T, k, D]
        # each token's outputs added in its experts' order, as the per-expert path adds them
        out = out.gather(1, ids.argsort(dim=1)[:, :, None].expand_as(out))
        total = torch.zeros_like(x)
        for j in range(k):
            total = total + out[:, j]
        return total

    def _each(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:  # [R, D] -> [R, D]
        """Each chosen expert's module over its rows."""
        ys = torch.empty_like(rows)
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                ys[start : start + n] = expert(rows[start : start + n])
                start += n
        return ys

    def _kernels_take(self, x: torch.Tensor) -> bool:
        """Whether the CPU kernels run every expert in one call (linear/experts.h): each expert's linears packed
        alike (biases on all or none), bound to the kernels, without per-row invariance; rows of the model's dtype.
        Checked once (the weights and their placement are fixed once loaded), and their pointers kept."""
        return bool(experts_call(self)) and x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu"


class _ExpertsCall(NamedTuple):
    """What the one-call expert kernel needs: the experts' packed weights (int64 [E] data pointers each) and formats,
    and their float32 biases' pointers (int64 [E], or None: no biases)."""

    ops: Any
    gate_up: torch.Tensor
    gate_up_format: int
    gate_up_k: int
    down: torch.Tensor
    down_format: int
    down_k: int
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def experts_call(moe: SparseMoE) -> _ExpertsCall | tuple[()]:
    """`moe`'s experts as the one-call kernels take them (the decode stack's too), or ()."""
    if moe._experts_call is None:
        moe._experts_call = _experts_call(moe.experts) if moe.moe.top_k <= MAX_TOP_K else ()
    return moe._experts_call


def _experts_call(experts: nn.ModuleList) -> _ExpertsCall | tuple[()]:
    """The experts' weights for linear/experts.h, or () where a module is not a plain kernel linear (another device,
    a mixed format, biases on some only, per-row invariance, no kernels): then each expert runs as a module."""
    projections: list[list[KernelLinear]] = []
    for name in ("gate_up_proj", "down_proj"):
        linears = [getattr(e, name) for e in experts]
        first = linears[0]
        if not isinstance(first, KernelLinear) or first.ops is None:
            return ()
        same = (first.format_id, first.padded_in, first.out_features, first.ops, first.bias is None)
        if any(not isinstance(m, KernelLinear) or (m.format_id, m.padded_in, m.out_features, m.ops, m.bias is None)
               != same or m.row_group or m.row_invariant for m in linears):  # fmt: skip
            return ()
        projections.append(linears)
    (gu, *_), (dn, *_) = projections
    gate_up, down = (torch.tensor([m.data.data_ptr() for m in linears], dtype=torch.int64) for linears in projections)
    biases = [None if p[0].bias is None else torch.tensor([_ptr(m.bias) for m in p], dtype=torch.int64)
              for p in projections]  # fmt: skip
    return _ExpertsCall(gu.ops, gate_up, gu.format_id, gu.padded_in, down, dn.format_id, dn.padded_in, *biases)


class MoECausalLM(CausalLM):
    """A Llama-shaped decoder whose sparse layers (`MoEConfig.sparse_layers`) hold a `SparseMoE` as their MLP.

    The per-expert path reads each step's routing on the host, so a MoE model runs under CUDA graphs only where its
    experts take the GPU's grouped GEMMs (`bind_gpu_ops`). On the CPU kernels its decode steps run in the decode
    stack (stack/moe.h), with these modules' bits."""

    graph_capturable = False

    def bind_gpu_ops(self, ops: Any) -> None:
        sparse = [m for m in self.modules() if isinstance(m, SparseMoE)]
        fused = [m.fuse_on_gpu(ops) for m in sparse]
        self.graph_capturable = bool(fused) and all(fused)

    def release_scratch(self) -> None:
        """The MLPs' buffers, and the one-call expert kernel's (linear/experts.h: MoEScratch, this thread's)."""
        super().release_scratch()
        for m in self.modules():
            if isinstance(m, SparseMoE) and (call := experts_call(m)):
                call.ops.module.moe_release_scratch()
                return

    def build_decoder(self, cfg: ModelConfig) -> None:
        super().build_decoder(cfg)
        if cfg.moe is None:
            raise ConfigError(f"{cfg.architecture}: a mixture-of-experts family needs the config's MoE fields")
        for sparse, layer in zip(cfg.moe.sparse_layers, self.model.layers, strict=True):
            if sparse:
                layer.mlp = SparseMoE(cfg, cfg.moe)
