"""LoRA adapters beside the base weights: y = base(x) + scale * (x @ A^T) @ B^T for each row's adapter.

The base linear stays whatever the loader made it (bf16, int8, int4, GGUF blocks: `KernelLinear`, or torch's); the
low-rank update is added after it, never merged, so one batch can mix rows of several adapters and of the base model.
Each adapted projection holds, per loaded adapter (by its id), A [n*r, D_in] and B [D_out, n*r]: a fused projection
(q|k|v, gate|up) stacks the A of each adapted shard, and its B is block-diagonal over those shards, so one pair of
matmuls gives every shard's update (the zero blocks add exact zeros). Shards an adapter leaves alone get none.

A step's rows are grouped by adapter once (`LoraBatch`, the runner's), and every adapted projection of the step runs
one pair of matmuls per adapter present over that adapter's rows; rows of the base model add nothing. The runner is
the only writer of the shared `LoraState`: it sets the step's groups before the forward and clears them after.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.models.layers import Attention, DecoderLayer, GatedMLP

# peft's module name -> (our projection, the shard of it; -1: the whole fused projection, as Phi-3's checkpoints
# name theirs) in a Llama-shaped decoder layer
TARGETS: dict[str, tuple[str, int]] = {
    "qkv_proj": ("qkv_proj", -1),
    "gate_up_proj": ("gate_up_proj", -1),
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


@dataclass(frozen=True)
class ProjectionShape:
    """What an adapter's matrices must fit: the projection's input size and each shard's output size."""

    in_features: int
    shards: tuple[int, ...]


@dataclass
class AdapterWeights:
    """One adapter for one projection of one layer: A [n*r, D_in], B [D_out, n*r] (block-diagonal over the shards it
    adapts), and the scale (lora_alpha / r, or / sqrt(r) with rsLoRA)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass
class Adapter:
    """A loaded adapter, ready to install: its weights by (layer, projection), its largest rank, its files' digest."""

    name: str
    path: str
    rank: int
    digest: int  # 128 bits of the files' hash: the prefix cache's salt for its requests
    weights: dict[tuple[int, str], AdapterWeights] = field(default_factory=dict)


@dataclass
class LoraBatch:
    """A step's rows grouped by adapter: (adapter id, its rows: a slice, or [N] int64 row indices)."""

    groups: list[tuple[int, slice | torch.Tensor]]


@dataclass
class LoraState:
    """Shared by one model's adapted projections; the runner sets `batch` for the step's forward (None: no row
    takes an adapter)."""

    batch: LoraBatch | None = None


class LoraProjection:
    """The adapters of one projection (not an nn.Module: its tensors are no checkpoint's parameters)."""

    def __init__(self, state: LoraState, shape: ProjectionShape) -> None:
        self.state, self.shape = state, shape
        self.adapters: dict[int, AdapterWeights] = {}  # adapter id -> its matrices here

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:  # x [T, D_in], out [T, D_out] (in place)
        batch = self.state.batch
        if batch is None or not self.adapters:
            return out
        for adapter_id, rows in batch.groups:
            w = self.adapters.get(adapter_id)
            if w is None:  # this adapter leaves the projection alone
                continue
            if isinstance(rows, slice):
                out[rows] += ((x[rows] @ w.a.T) @ w.b.T) * w.scale  # [N, D_out]
            else:
                out.index_add_(0, rows, ((x[rows] @ w.a.T) @ w.b.T) * w.scale)
        return out


def decoder_layers(model: nn.Module) -> list[DecoderLayer]:
    """The Llama-shaped decoder layers adapters may target (their `self_attn` and dense `mlp`); none for a family of
    another shape (GPT-2, Gemma 3, gpt-oss)."""
    decoder = getattr(model, "model", None)
    layers = list(getattr(decoder, "layers", None) or [])
    if not all(isinstance(x, DecoderLayer) and type(x.self_attn) is Attention for x in layers):
        return []
    return layers


class ModelLoras:
    """Every adapted projection of one model, and the adapters installed in them (by id)."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype  # where and in what the adapters' matrices are kept
        self.state = LoraState()
        self.projections: dict[tuple[int, str], LoraProjection] = {}
        for i, layer in enumerate(decoder_layers(model)):
            attn, mlp = layer.self_attn, layer.mlp
            assert isinstance(attn, Attention)
            q, kv = attn.q_size, attn.kv_size
            attn.lora = {"qkv_proj": self._make(i, "qkv_proj", attn.qkv_proj.in_features, (q, kv, kv)),
                         "o_proj": self._make(i, "o_proj", q, (attn.o_proj.out_features,))}  # fmt: skip
            if type(mlp) is GatedMLP:
                inter, hidden = mlp.intermediate_size, mlp.down_proj.out_features
                mlp.lora = {"gate_up_proj": self._make(i, "gate_up_proj", hidden, (inter, inter)),
                            "down_proj": self._make(i, "down_proj", inter, (hidden,))}  # fmt: skip

    def _make(self, layer: int, name: str, in_features: int, shards: tuple[int, ...]) -> LoraProjection:
        proj = self.projections[layer, name] = LoraProjection(self.state, ProjectionShape(in_features, shards))
        return proj

    def shapes(self) -> dict[tuple[int, str], ProjectionShape]:
        """What an adapter may target: (layer, projection) -> its shape."""
        return {k: p.shape for k, p in self.projections.items()}

    def install(self, adapter_id: int, adapter: Adapter) -> None:
        """Each of the adapter's matrices beside its projection, on the model's device and in its dtype."""
        device, dtype = self.device, self.dtype
        for key, w in adapter.weights.items():
            moved = AdapterWeights(w.a.to(device, dtype).contiguous(), w.b.to(device, dtype).contiguous(), w.scale)
            self.projections[key].adapters[adapter_id] = moved

    def remove(self, adapter_id: int) -> None:
        for proj in self.projections.values():
            proj.adapters.pop(adapter_id, None)
