"""LoRA adapters beside the base weights: y = base(x) + scale * (x @ A^T) @ B^T for each row's adapter.

The base linear stays whatever the loader made it (bf16, int8, int4, GGUF blocks: `KernelLinear`, or torch's); the
low-rank update is added after it, never merged, so one batch can mix rows of several adapters and of the base model.
Each adapted projection holds, per loaded adapter (by its id), A [n*r, D_in] and B [D_out, n*r]: a fused projection
(q|k|v, gate|up) stacks the A of each adapted shard, and its B is block-diagonal over those shards, so one pair of
matmuls gives every shard's update (the zero blocks add exact zeros). Shards an adapter leaves alone get none.

A step's rows are grouped by adapter once (`LoraBatch`, the runner's). On the CPU kernels each adapted projection
adds every row's update in one call (kernels/csrc/ops/lora.h, over float32 copies of the matrices, each installed
adapter in a slot of the projection's pointer tables); elsewhere it runs one pair of matmuls per adapter present over
that adapter's rows. Rows of the base model add nothing. The runner is the only writer of the shared `LoraState`: it
sets the step's groups before the forward and clears them after.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    slots: torch.Tensor | None = None  # [T] int64: each row's adapter slot for the CPU kernel (-1: the base model)


@dataclass
class LoraState:
    """Shared by one model's adapted projections; the runner sets `batch` for the step's forward (None: no row
    takes an adapter)."""

    batch: LoraBatch | None = None


class LoraProjection:
    """The adapters of one projection (not an nn.Module: its tensors are no checkpoint's parameters)."""

    def __init__(self, state: LoraState, shape: ProjectionShape, ops: Any = None,
                 dtype: torch.dtype = torch.float32) -> None:  # fmt: skip
        self.state, self.shape, self.ops = state, shape, ops  # ops: the CPU kernels, or None
        # the kernel's matrices: bfloat16 for a bfloat16 model (half the bytes a step reads; torch's matmuls would
        # take the adapter in the model's dtype too), else float32
        self.table_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        self.adapters: dict[int, AdapterWeights] = {}  # adapter id -> its matrices here
        # the kernel's tables by slot: A [r, D_in] and B^T in panels [ceil(D_out / 16), r, 16] (ops/lora.h; kept
        # alive here), their pointers,
        # ranks (0: the slot's adapter leaves this projection alone) and scales
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.a_ptrs, self.bt_ptrs, self.ranks = (torch.zeros(0, dtype=torch.int64) for _ in range(3))
        self.scales = torch.zeros(0)

    def set_slot(self, slot: int, w: AdapterWeights | None) -> None:
        """Slot `slot` of the kernel's tables: adapter weights `w`, or nothing (rank 0)."""
        if slot >= len(self.ranks):
            grow = slot + 1 - len(self.ranks)
            self.a_ptrs, self.bt_ptrs, self.ranks = (torch.cat([t, torch.zeros(grow, dtype=torch.int64)])
                                                     for t in (self.a_ptrs, self.bt_ptrs, self.ranks))  # fmt: skip
            self.scales = torch.cat([self.scales, torch.zeros(grow)])
        if w is None:
            self._kept.pop(slot, None)
            self.ranks[slot] = 0
            return
        a, b = w.a.to(self.table_dtype).contiguous(), w.b.to(self.table_dtype)  # [r, D_in], [D_out, r]
        n, r = b.shape
        panels = torch.zeros(-(-n // 16) * 16, r, dtype=self.table_dtype)  # [D_out rounded up, r]
        panels[:n] = b
        bt = panels.view(-1, 16, r).transpose(1, 2).contiguous()  # [ceil(D_out / 16), r, 16]
        self._kept[slot] = (a, bt)
        self.a_ptrs[slot], self.bt_ptrs[slot], self.ranks[slot] = a.data_ptr(), bt.data_ptr(), a.shape[0]
        self.scales[slot] = w.scale

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:  # x [T, D_in], out [T, D_out] (in place)
        batch = self.state.batch
        if batch is None or not self.adapters:
            return out
        if self.ops is not None and batch.slots is not None and _kernel_takes(x, out):
            self.ops.lora_add(x, out, batch.slots, self.a_ptrs, self.bt_ptrs, self.ranks, self.scales,
                              self.table_dtype == torch.bfloat16)  # fmt: skip
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


def _kernel_takes(x: torch.Tensor, out: torch.Tensor) -> bool:
    return (x.dtype == out.dtype and x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu"
            and x.dim() == 2 and x.stride(1) == 1 and out.is_contiguous())  # fmt: skip


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

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, ops: Any = None) -> None:
        self.device, self.dtype = device, dtype  # where and in what the adapters' matrices are kept
        self.ops = ops if device.type == "cpu" else None  # the CPU kernels (ops/lora.h), or None: torch's matmuls
        self.slots: dict[int, int] = {}  # adapter id -> its slot in the kernel's tables
        self.version = 0  # moves with every install and removal (the decode stack registers the tables again)
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
        proj = LoraProjection(self.state, ProjectionShape(in_features, shards), self.ops, self.dtype)
        self.projections[layer, name] = proj
        return proj

    def shapes(self) -> dict[tuple[int, str], ProjectionShape]:
        """What an adapter may target: (layer, projection) -> its shape."""
        return {k: p.shape for k, p in self.projections.items()}

    def install(self, adapter_id: int, adapter: Adapter) -> None:
        """Each of the adapter's matrices beside its projection, on the model's device and in its dtype."""
        device, dtype = self.device, self.dtype
        slot = self.slots[adapter_id] = min(set(range(len(self.slots) + 1)) - set(self.slots.values()))
        for key, w in adapter.weights.items():
            moved = AdapterWeights(w.a.to(device, dtype).contiguous(), w.b.to(device, dtype).contiguous(), w.scale)
            self.projections[key].adapters[adapter_id] = moved
        if self.ops is not None:  # every projection's slot: the adapter's float32 matrices there, or rank 0
            for key, proj in self.projections.items():
                proj.set_slot(slot, adapter.weights.get(key))
        self.version += 1

    def remove(self, adapter_id: int) -> None:
        slot = self.slots.pop(adapter_id, None)
        for proj in self.projections.values():
            proj.adapters.pop(adapter_id, None)
            if slot is not None and self.ops is not None:
                proj.set_slot(slot, None)
        self.version += 1

    @property
    def tables_bf16(self) -> bool:
        """The kernel's matrices are bfloat16 (LoraProjection.table_dtype), else float32."""
        return self.dtype == torch.bfloat16

    def tables(self) -> dict[tuple[int, str], tuple[torch.Tensor, ...]]:
        """Each projection's kernel tables by (layer, projection name): A and B^T pointers, ranks, scales; empty
        where no adapter targets it (its rows add nothing, as `LoraProjection.add` leaves them)."""
        empty = (*(torch.zeros(0, dtype=torch.int64) for _ in range(3)), torch.zeros(0))
        return {k: (p.a_ptrs, p.bt_ptrs, p.ranks, p.scales) if p.adapters else empty
                for k, p in self.projections.items()}  # fmt: skip

    def slot_of(self, adapter_id: int) -> int:
        return self.slots[adapter_id]
