"""Fill a model built on the meta device straight from a checkpoint's tensors (a safetensors folder or a GGUF).

Hugging Face names map one to one onto ours except the fused projections: `q_proj|k_proj|v_proj` land in
slices of `qkv_proj`, `gate_proj|up_proj` in slices of `gate_up_proj` (a checkpoint that stores them fused, as
Phi-3's, fills them whole). A family's `hf_transposed` tensors are stored [in, out] in HF files and turned
around. Every parameter must be filled exactly once and every checkpoint tensor must land somewhere, so a
mismatched checkpoint fails loudly.

A tensor can also arrive as ggml blocks (`RawBlocks`: a GGUF's Q8_0/Q4_0, K-quants, Q5_0/Q5_1/Q4_1,
IQ4_NL/IQ4_XS). On the CPU its linear becomes a `KernelLinear` of that format from the blocks as they are; a fused
projection stays in blocks when all of its shards are blocks (or when it arrives whole: a phi3 GGUF's `attn_qkv`,
`ffn_up`): one `KernelLinear` where they share a format, else a `SegmentedLinear` of one per shard. Anywhere else
(another device, an embedding, blocks beside dense shards) it is dequantized.

With a `packer` (the CPU kernels' format every dense linear becomes: models/linear.py, `linear_format`), a linear's
weight is packed as soon as it is complete: straight from the file's mapped pages, or from the one fused weight
being gathered, which is then let go. So a safetensors folder takes at most its file's pages plus one packed copy
of the weights (and one weight in flight), never a dense copy of them all before packing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.kernels.formats import PackedWeight, format_for
from tokenmill.kernels.kformats import MXFP4ScaleError
from tokenmill.kernels.raw_blocks import RawBlocks, dequantize_raw, pack_raw
from tokenmill.model_config import ModelConfig
from tokenmill.models import CausalLM
from tokenmill.models.layers import STACKED_PARAMS
from tokenmill.models.linear import KernelLinear, SegmentedLinear
from tokenmill.models.packed_embedding import PackedEmbedding
from tokenmill.models.rope import RotaryEmbedding
from tokenmill.weights.fp8 import Deferred
from tokenmill.weights.packed_cache import PackedCache

SMALL = 1 << 20  # elements: a tensor this small is copied out of the file as it loads (_Fill.dense)

Value = torch.Tensor | RawBlocks | Deferred
Tensors = Iterable[tuple[str, Value, str]]  # (HF tensor name, value, where it came from)
Packer = Callable[[torch.Tensor], PackedWeight]  # a dense [N, K] weight -> its packed form


def _shard_rows(cfg: ModelConfig, fused: str, rows: int) -> list[int]:
    """The rows of each shard of a fused parameter of `rows` rows: q, k, v; or gate and up, half each (a dense
    MLP's or an expert's)."""
    if fused == "qkv_proj":
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [q, kv, kv]
    return [rows // 2] * 2


def _map_name(name: str) -> tuple[str, str | None, int]:
    """HF tensor name -> (our parameter name, fused module or None, shard index)."""
    for fused, shards in STACKED_PARAMS.items():
        for hf_part, idx in shards:
            if f".{hf_part}." in name:
                return name.replace(f".{hf_part}.", f".{fused}."), fused, idx
    return name, None, 0


def _set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    module._parameters[attr] = nn.Parameter(value, requires_grad=False)


def _whole(name: str) -> str | None:
    """The fused module a parameter name belongs to (qkv_proj, gate_up_proj), or None."""
    return next((f for f in STACKED_PARAMS if f".{f}." in name), None)


@dataclass
class _Fill:
    """What has landed so far: which shards of each parameter, and the weights still in blocks."""

    model: CausalLM
    dtype: torch.dtype
    device: torch.device
    ops: Any | None = None  # the compiled kernels, which repack blocks in one pass (else torch does)
    cache: PackedCache | None = None  # weights packed by an earlier start, mapped (weights/packed_cache.py)
    packer: Packer | None = None  # dense linear weights packed as each is complete (else prepare_linears does)
    pack_format: str | None = None  # the packer's format: a dense weight is taken from `cache` where packed in it
    filled: dict[str, set[int]] = field(default_factory=dict)
    blocks: dict[str, dict[int, RawBlocks]] = field(default_factory=dict)  # a weight's shards so far
    # whole weights, packed as soon as complete: one format, or one per shard (in shard order)
    packed: dict[str, PackedWeight | list[PackedWeight]] = field(default_factory=dict)

    def dense(self, name: str, shard: int, value: torch.Tensor | Deferred, whole: bool) -> None:
        if isinstance(value, Deferred):  # (an FP8 weight: dequantized only where its values are read)
            if self._cached_whole(name) and name not in self.blocks:
                if whole:
                    _set_param(self.model, name, torch.empty(value.shape, dtype=self.dtype, device="meta"))
                return
            value = value.value()
        value = value.to(device=self.device, dtype=self.dtype).contiguous()
        if name in self.blocks:  # earlier shards came in blocks: this one is dense, so all of it is
            held = self.blocks.pop(name)
            self._allocate(name)
            for idx, w in held.items():
                self._copy(name, self._offset(name, idx), w.dequantize())
        if whole:
            # a small tensor (a norm, a bias) copied out of the file's map: nothing then holds the map once the
            # weights are packed, so its pages (mapped 2 MB at a time where the page cache has huge pages) leave
            _set_param(self.model, name, value.clone() if value.numel() <= SMALL else value)
            return
        if self._cached_whole(name):  # a fused weight the cache holds packed: its shards' values are never read
            return
        if name not in self.filled:  # the first shard seen allocates the fused tensor
            self._allocate(name)
        self._copy(name, self._offset(name, shard), value)

    def block(self, name: str, shard: int, value: RawBlocks, whole: bool) -> None:
        """`whole`: the weight in one piece (not a shard of a fused one; or fused in the file, as Phi-3's)."""
        if name in self.filled and name not in self.blocks:  # dense shards came first: dequantize into them
            self._copy(name, self._offset(name, shard), value.dequantize().to(self.dtype))
            return
        held = self.blocks.setdefault(name, {})
        held[shard] = value
        fused = _whole(name)
        if whole or fused is None or set(held) == {idx for _, idx in STACKED_PARAMS[fused]}:  # complete: pack it now
            del self.blocks[name]
            parts = [held[i] for i in sorted(held)]
            module = name.removesuffix(".weight")
            if len({p.format for p in parts}) == 1:
                rows = sum(p.shape[0] for p in parts)
                cached = self.cached(module, parts[0].format, rows, parts[0].k)
                try:
                    self.packed[name] = cached or pack_raw(RawBlocks.cat(parts), self.ops)
                except MXFP4ScaleError:  # a scale the panels cannot hold: the weight dense, exactly (bf16 values)
                    self._allocate(name)
                    for i, part in zip(sorted(held), parts, strict=True):
                        self._copy(name, self._offset(name, i), part.dequantize().to(self.dtype))
            else:  # shards of several formats: each keeps its own
                self.packed[name] = [self.pack(f"{module}.parts.{i}", p) for i, p in enumerate(parts)]

    def settle(self, name: str) -> None:
        """Pack parameter `name` now where the packer takes it: a linear's dense weight, complete (every shard of a
        fused one in). Its values are read once, from the file's pages or the fused weight's gathering tensor, which
        is let go (the parameter back on the meta device): only the packed copy stays."""
        if self.packer is None or name in self.blocks or name in self.packed or not name.endswith(".weight"):
            return
        module = self.model.get_submodule(name.rpartition(".")[0])
        fused = _whole(name)
        if not isinstance(module, nn.Linear) or (module.weight.device.type == "meta" and not self._cached_whole(name)):
            return
        if fused and self.filled.get(name, set()) != {idx for _, idx in STACKED_PARAMS[fused]}:
            return
        rows, k = module.weight.shape
        cached = self.cached(name.removesuffix(".weight"), format_for(self.pack_format, k), rows, k) if (
            self.pack_format) else None  # fmt: skip
        self.packed[name] = cached or self.packer(module.weight.detach())  # [N, K] -> panels
        _set_param(self.model, name, torch.empty(module.weight.shape, dtype=self.dtype, device="meta"))

    def _cached_whole(self, name: str) -> bool:
        """The cache holds linear weight `name` packed in the packer's format (looked at, not taken)."""
        if self.cache is None or self.pack_format is None or not name.endswith(".weight"):
            return False
        module = self.model.get_submodule(name.rpartition(".")[0])
        if not isinstance(module, nn.Linear):
            return False
        rows, k = module.weight.shape
        return self.cache.holds(name.removesuffix(".weight"), format_for(self.pack_format, k), rows, k)

    def cached(self, module: str, fmt: str, rows: int, k: int) -> PackedWeight | None:
        return self.cache.take(module, fmt, rows, k) if self.cache is not None else None

    def pack(self, module: str, blocks: RawBlocks) -> PackedWeight:
        """Module `module`'s weight from the blocks: as an earlier start packed it, where cached, else packed now."""
        return self.cached(module, blocks.format, *blocks.shape) or pack_raw(blocks, self.ops)

    def _allocate(self, name: str) -> None:
        shape = self.model.get_parameter(name).shape
        _set_param(self.model, name, torch.empty(shape, dtype=self.dtype, device=self.device))

    def _copy(self, name: str, offset: int, value: torch.Tensor) -> None:
        param = self.model.get_parameter(name)
        param.data[offset : offset + value.shape[0]].copy_(value)

    def _offset(self, name: str, shard: int) -> int:
        fused = _whole(name)
        rows = self.model.get_parameter(name).shape[0]
        return sum(_shard_rows(self.model.config, fused, rows)[:shard]) if fused else 0


def load_weights(
    model: CausalLM,
    tensors: Tensors,
    source: str,
    dtype: torch.dtype,
    device: torch.device,
    hf_layout: bool = True,
    config_source: str = "config.json",
    cache: PackedCache | None = None,
    packer: Packer | None = None,
    pack_format: str | None = None,
) -> CausalLM:
    """Fill `model` (built on the meta device) from `tensors`, HF-named. `hf_layout`: the family's
    `hf_transposed` tensors are stored [in, out] (a GGUF stores every weight [out, in] already). `cache`: weights in
    blocks are taken from it where an earlier start packed them. `packer`: dense linear weights packed as each is
    complete (the module docstring says why); `pack_format`, its format, takes them from `cache` where an earlier
    start packed them (a BF16 or F32 GGUF's)."""
    cfg = model.config
    params = dict(model.named_parameters())  # tied lm_head is deduplicated away here
    fill = _Fill(model, dtype, device, _repacker(device), cache, packer, pack_format)
    tied_head: PackedWeight | None = None
    embedding = _embedding_name(model)
    for hf_name, tensor, where in model.hf_tensors(tensors) if hf_layout else tensors:
        renamed = _model_name(model, hf_name)
        if renamed is None:
            continue
        hf_name = renamed
        if isinstance(tensor, Deferred) and hf_layout and hf_name.endswith(model.hf_transposed):
            tensor = tensor.value()
        if hf_layout and hf_name.endswith(model.hf_transposed) and isinstance(tensor, torch.Tensor):
            tensor = tensor.t()  # [in, out] -> [out, in]
        name, fused, shard, expected = _target(params, cfg, hf_name, where, config_source)
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(
                f"tensor {hf_name!r} in {where} has shape {list(tensor.shape)}, "
                f"but {config_source} implies {list(expected)}"
            )
        whole = _whole(name)
        shards = {idx for _, idx in STACKED_PARAMS[whole]} if whole and fused is None else {shard}
        if isinstance(tensor, RawBlocks):
            head = _place_blocks(model, fill, name, shard, fused is None, tensor, name == embedding)
            tied_head = head if cfg.tie_word_embeddings and name == embedding else tied_head
        else:
            fill.dense(name, shard, tensor, whole=fused is None)
        fill.filled.setdefault(name, set()).update(shards)
        fill.settle(name)

    _check_complete(params, fill.filled, source)
    for name, packed in fill.packed.items():
        _swap_in_packed(model, name, packed)
    if cfg.tie_word_embeddings:
        if tied_head is not None:
            model.lm_head = KernelLinear(tied_head, None, None)  # type: ignore[assignment]
        elif (kept := _cached_head(fill, model)) is not None:
            model.lm_head = kept  # type: ignore[assignment]
        else:
            model.lm_head.weight = model.embeddings().weight
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.materialize(device)
    return model.eval()


def _place_blocks(
    model: CausalLM, fill: _Fill, name: str, shard: int, whole: bool, blocks: RawBlocks, is_embedding: bool
) -> PackedWeight | None:
    """A weight that arrived in ggml blocks. On the CPU a linear keeps them (packed once complete), and so does the
    token embedding where the kernels unpack its rows as they are looked up (a PackedEmbedding, whose panels a
    tied LM head shares: returned). Anything else is dequantized."""
    cpu = fill.device.type == "cpu"
    if cpu and isinstance(model.get_submodule(name.rpartition(".")[0]), nn.Linear):
        fill.block(name, shard, blocks, whole=whole)
        return None
    if cpu and is_embedding:
        packed = fill.pack(name.removesuffix(".weight"), blocks)
        if fill.ops is not None and fill.dtype in (torch.bfloat16, torch.float32):
            parent, _, child = name.rpartition(".")[0].rpartition(".")
            setattr(model.get_submodule(parent), child, PackedEmbedding(packed, fill.dtype, fill.ops))
        else:  # no kernels to unpack rows: the table dense, a tied head still in blocks
            fill.dense(name, shard, dequantize_raw(blocks, fill.ops, packed), whole=True)
        return packed
    fill.dense(name, shard, dequantize_raw(blocks, fill.ops), whole=whole)
    return None


def _cached_head(fill: _Fill, model: CausalLM) -> KernelLinear | None:
    """A tied LM head over a dense embedding, as an earlier start packed it (prepare_linears packs it otherwise)."""
    if fill.pack_format is None or fill.cache is None:
        return None
    rows, k = model.embeddings().weight.shape
    cached = fill.cached("lm_head", format_for(fill.pack_format, k), rows, k)
    return None if cached is None else KernelLinear(cached, None, None)


def _repacker(device: torch.device) -> Any | None:
    """The compiled kernels for repacking a GGUF's blocks, where they load here (None: torch packs them)."""
    if device.type != "cpu":
        return None
    from tokenmill import kernels

    return kernels.active()


def _model_name(model: CausalLM, hf_name: str) -> str | None:
    """A checkpoint tensor's name as the model knows it (the family's renames applied), or None for one it skips:
    its skipped prefixes and ignored suffixes, and a tied model's lm_head.weight."""
    if model.hf_skipped_prefixes and hf_name.startswith(model.hf_skipped_prefixes):
        return None
    hf_name = next((new + hf_name[len(old) :] for old, new in model.hf_renames if hf_name.startswith(old)), hf_name)
    for old, new in model.hf_part_renames:
        hf_name = hf_name.replace(f".{old}.", f".{new}.")
    if hf_name.endswith(model.hf_ignored) or (model.config.tie_word_embeddings and hf_name == "lm_head.weight"):
        return None
    return hf_name


def _target(
    params: dict[str, nn.Parameter],
    cfg: ModelConfig,
    hf_name: str,
    where: str,
    config_source: str,
) -> tuple[str, str | None, int, tuple[int, ...]]:
    """The parameter tensor `hf_name` fills (_map_name's name, fused module and shard) and the shape the config
    gives it (a fused parameter's shard: its share of the first dimension); ModelLoadError when the model has no
    such weight."""
    name, fused, shard = _map_name(hf_name)
    if name not in params:
        raise ModelLoadError(
            f"unexpected tensor {hf_name!r} in {where}: {cfg.architecture} has no such weight "
            f"(is {config_source} from a different model?)"
        )
    shape = tuple(params[name].shape)
    return name, fused, shard, shape if fused is None else (_shard_rows(cfg, fused, shape[0])[shard], *shape[1:])


def _embedding_name(model: CausalLM) -> str:
    emb = model.embeddings()
    return next(f"{n}.weight" for n, m in model.named_modules() if m is emb)


def _swap_in_packed(model: CausalLM, name: str, weight: PackedWeight | list[PackedWeight]) -> None:
    """Replace the nn.Linear owning parameter `name` by a KernelLinear holding `weight` (a SegmentedLinear of one
    per shard for a list)."""
    module_name = name.rpartition(".")[0]
    parent_name, _, child = module_name.rpartition(".")
    bias = getattr(model.get_submodule(module_name), "bias", None)  # filled already, or None
    bias = bias if isinstance(bias, torch.Tensor) else None
    new: nn.Module
    if isinstance(weight, list):
        biases = [None] * len(weight) if bias is None else bias.split([w.out_features for w in weight])
        new = SegmentedLinear([KernelLinear(w, b, None) for w, b in zip(weight, biases, strict=True)])
    else:
        new = KernelLinear(weight, bias, None)
    setattr(model.get_submodule(parent_name), child, new)


def _check_complete(params: dict[str, nn.Parameter], filled: dict[str, set[int]], source: str) -> None:
    missing = []
    for name in params:
        fused = _whole(name)
        if fused is None:
            missing += [] if name in filled else [name]
            continue
        for hf_part, idx in STACKED_PARAMS[fused]:
            if idx not in filled.get(name, set()):
                missing.append(name.replace(f".{fused}.", f".{hf_part}."))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"checkpoint {source} is missing tensor(s): {shown}")
