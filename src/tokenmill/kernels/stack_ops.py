"""The native decode stack (csrc stack.h) behind checked calls: tensors and lists in, and every check of shape,
dtype, layout and range made here, before a pointer crosses. `Kernels.decode_stack` makes one.

The stack keeps raw pointers to what it was given once (norms, packed weights, the KV pool); this object keeps
those tensors alive as long as it lives. Per step it checks what could make the C++ read or write out of bounds:
token ids against the embedding's rows, positions against the rotary tables, slots and block ids against the
pool, and every buffer's shape and dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from tokenmill.kernels.formats import FORMATS, PANEL, QUANTIZED, check_packed

QUANTIZED_IDS = {FORMATS[f] for f in QUANTIZED}


@dataclass(frozen=True)
class StackLinear:
    """A packed linear the stack multiplies by: its weight (uint8 panels), format, [n, k] and bias (float32 [n]).
    `segments`: output rows [n0, next n0 or n) in another weight and format, after the first's (up to two: a fused
    projection whose shards came in different quantized formats; csrc/linear/segments.h)."""

    weight: torch.Tensor
    format_id: int
    n: int
    k: int
    bias: torch.Tensor | None = None
    segments: tuple[tuple[torch.Tensor, int, int], ...] = ()  # (weight, format id, n0)

    def parts(self) -> list[tuple[torch.Tensor, int, int, int]]:
        """(weight, format id, first row, rows) of every segment, the first included."""
        starts = [(self.weight, self.format_id, 0), *self.segments]
        ends = [n0 for _, _, n0 in self.segments] + [self.n]
        return [(w, f, n0, end - n0) for (w, f, n0), end in zip(starts, ends, strict=True)]

    def spec(self) -> tuple[int, ...]:
        rest = [v for w, f, n0 in self.segments for v in (w.data_ptr(), f, n0)]
        rest += [0, 0, self.n] * (2 - len(self.segments))
        return (self.weight.data_ptr(), self.format_id, self.n, self.k, _ptr(self.bias), *rest)


@dataclass(frozen=True)
class StackShape:
    d: int  # hidden size
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


@dataclass(frozen=True)
class StackExperts:
    """A sparse layer's MLP: the router [E, d] (the model dtype), k of E experts a token (their softmax weights
    renormalised over the k where `renorm`, kept float32 where `keep_f32`), and the experts' packed weights, each
    projection in one format: int64 [E] pointers to gate_up_weights ([2 I, gate_up_k] each) and down_weights
    ([d, down_k] each). gpt-oss's: the router's bias [E] (the model dtype) and the softmax over its top k logits
    (`softmax_after_top_k`), int64 [E] pointers to the experts' float32 biases ([2 I] / [d] each, the tensors in
    `biases`), and the clamped SwiGLU's (alpha, limit)."""

    router: torch.Tensor
    num_experts: int
    top_k: int
    renorm: bool
    keep_f32: bool
    intermediate: int
    gate_up: torch.Tensor
    gate_up_format: int
    gate_up_k: int
    gate_up_weights: tuple[torch.Tensor, ...]
    down: torch.Tensor
    down_format: int
    down_k: int
    down_weights: tuple[torch.Tensor, ...]
    router_bias: torch.Tensor | None = None
    softmax_after_top_k: bool = False
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    biases: tuple[torch.Tensor, ...] = ()
    clamped_swiglu: tuple[float, float] | None = None


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _check(t: torch.Tensor | None, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if t is None:
        return
    if t.shape != shape or t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous CPU {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")


def _in_range(values: Sequence[int], end: int, name: str) -> None:
    if values and (min(values) < 0 or max(values) >= end):
        raise ValueError(f"{name} must lie in [0, {end}), got {min(values)}..{max(values)}")


class NativeStack:
    def __init__(
        self, module: ModuleType, dtype: torch.dtype, shape: StackShape, eps: float, cache: torch.Tensor,
        final_norm: torch.Tensor, num_layers: int, threads: int, scales: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"the decode stack computes in bfloat16 or float32, not {dtype}")
        if cache.dim() != 5 or cache.shape[1] != 2 or cache.shape[3:] != (shape.kv_heads, shape.head_dim):
            raise ValueError(f"the KV pool must be [L, 2, slots, {shape.kv_heads}, {shape.head_dim}]")
        _check(final_norm, "the final norm", (shape.d,), dtype)
        if cache.dtype != dtype and (scales is None or cache.dtype not in (torch.int8, torch.float8_e4m3fn)):
            raise ValueError(f"the KV pool must hold {dtype}, or int8 / float8_e4m3fn with scales, not {cache.dtype}")
        _check(scales, "the quantized pool's scales", tuple(cache.shape[:4]), torch.bfloat16)
        self.dtype, self.shape, self.cache, self.scales = dtype, shape, cache, scales
        self.num_slots = cache.shape[2]
        self.native = module.DecodeStack(dtype == torch.bfloat16, shape.d, shape.heads, shape.kv_heads,
                                             shape.head_dim, shape.intermediate, eps, self.num_slots,
                                             final_norm.data_ptr(), num_layers, threads)  # fmt: skip
        self.num_layers, self.vocab = num_layers, 0  # vocab: the head's rows (0: no head)
        self.packed_embedding: tuple[torch.Tensor, int] | None = None  # (panels, rows): set_packed_embedding
        self._alive: list[torch.Tensor | None] = [final_norm]  # what the native stack points at
        self._lora_tables: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # set_lora's, by (layer, projection)
        self._lora_rows: torch.Tensor | None = None

    def _linear(self, lin: StackLinear, n: int | None, k: int) -> tuple[int, ...]:
        if len(lin.segments) > 2:
            raise ValueError("a stack linear has at most three segments")
        for weight, format_id, n0, rows in lin.parts():
            check_packed(weight, format_id, rows, lin.k)
            if lin.segments and (n0 % PANEL or rows <= 0 or format_id not in QUANTIZED_IDS):
                raise ValueError("a stack linear's segments are quantized and start on whole panels")
            self._alive.append(weight)
        if (n is not None and lin.n != n) or lin.k < k:
            raise ValueError(f"a stack linear must be [{n}, >= {k}], got [{lin.n}, {lin.k}]")
        _check(lin.bias, "a linear's bias", (lin.n,), torch.float32)
        self._alive.append(lin.bias)
        return lin.spec()

    def add_layer(self, norms: Sequence[torch.Tensor | None], linears: Sequence[StackLinear]) -> None:
        """Layer l's [input norm, post-attention norm, q norm, k norm] (None: no q/k norm) and [qkv, o, gate_up,
        down], over the pool's layer l."""
        s, layer = self.shape, self.native.num_layers()
        if layer >= self.num_layers:
            raise ValueError(f"the stack was made for {self.num_layers} layers")
        norm_specs, attention = self._attention(norms, linears[:2])
        shapes = [(2 * s.intermediate, s.d), (s.d, s.intermediate)]
        mlp = [self._linear(lin, n, k) for lin, (n, k) in zip(linears[2:], shapes, strict=True)]
        self.native.add_layer(*norm_specs, self.cache[layer].data_ptr(), *attention, *mlp)
        self._set_scales(layer)

    def set_window(self, layer: int, window: int | None) -> None:
        """Layer `layer` (added) attends to each row's last `window` positions only (None: its whole context)."""
        if not 0 <= layer < self.native.num_layers():
            raise ValueError(f"layer {layer} has not been added")
        if window is not None and window < 1:
            raise ValueError(f"a sliding window is at least 1 position, not {window}")
        self.native.set_window(layer, window or 0)

    def _set_scales(self, layer: int) -> None:
        if self.scales is not None:  # a quantized pool: the layer quantizes its rows and widens them (kv_quant.h)
            self.native.set_kv_scales(layer, self.scales[layer].data_ptr(), self.cache.dtype == torch.float8_e4m3fn)

    def _attention(
        self, norms: Sequence[torch.Tensor | None], linears: Sequence[StackLinear]
    ) -> tuple[list[int], list[tuple[int, ...]]]:
        """A layer's norms and [qkv, o], checked: their pointers and specs."""
        s = self.shape
        for i, norm in enumerate(norms):
            _check(norm, "a norm", (s.d if i < 2 else s.head_dim,), self.dtype)
        if norms[0] is None or norms[1] is None or (norms[2] is None) != (norms[3] is None):
            raise ValueError("a layer needs its two norms, and a q norm exactly where it has a k norm")
        q = (s.heads + 2 * s.kv_heads) * s.head_dim
        shapes = [(q, s.d), (s.d, s.heads * s.head_dim)]
        specs = [self._linear(lin, n, k) for lin, (n, k) in zip(linears, shapes, strict=True)]
        self._alive += list(norms)
        return [_ptr(n) for n in norms], specs

    def add_sparse_layer(self, norms: Sequence[torch.Tensor | None], linears: Sequence[StackLinear],
                         experts: StackExperts) -> None:  # fmt: skip
        """A sparse layer (stack/moe.h): its norms and [qkv, o] as add_layer's, and its router and experts."""
        s, layer, x = self.shape, self.native.num_layers(), experts
        if layer >= self.num_layers:
            raise ValueError(f"the stack was made for {self.num_layers} layers")
        norm_specs, attention = self._attention(norms, linears)
        _check(x.router, "a router", (x.num_experts, s.d), self.dtype)
        if not 1 <= x.top_k <= min(64, x.num_experts):
            raise ValueError(f"a sparse layer chooses 1 to 64 of its {x.num_experts} experts a token, not {x.top_k}")
        for ptrs, weights, (n, k) in ((x.gate_up, x.gate_up_weights, (2 * x.intermediate, x.gate_up_k)),
                                      (x.down, x.down_weights, (s.d, x.down_k))):  # fmt: skip
            _check(ptrs, "the experts' weight pointers", (x.num_experts,), torch.int64)
            if len(weights) != x.num_experts or ptrs.tolist() != [w.data_ptr() for w in weights]:
                raise ValueError("the experts' weight pointers must be their weights'")
            for w in weights:
                check_packed(w, x.gate_up_format if ptrs is x.gate_up else x.down_format, n, k)
        if x.gate_up_k < s.d or x.down_k < x.intermediate:
            raise ValueError("an expert's packed weights are narrower than its inputs")
        _check(x.router_bias, "a router's bias", (x.num_experts,), self.dtype)
        self._check_expert_biases(x)
        self._alive += [x.router, x.gate_up, x.down, *x.gate_up_weights, *x.down_weights, x.router_bias,
                        x.gate_up_bias, x.down_bias, *x.biases]  # fmt: skip
        alpha, limit = x.clamped_swiglu or (0.0, 0.0)
        self.native.add_sparse_layer(*norm_specs, self.cache[layer].data_ptr(), *attention, x.router.data_ptr(),
                                     x.num_experts, x.top_k, x.renorm, x.keep_f32, x.gate_up.data_ptr(),
                                     x.gate_up_format, x.gate_up_k, x.down.data_ptr(), x.down_format, x.down_k,
                                     x.intermediate, _ptr(x.router_bias), x.softmax_after_top_k, _ptr(x.gate_up_bias),
                                     _ptr(x.down_bias), x.clamped_swiglu is not None, alpha, limit)  # fmt: skip
        self._set_scales(layer)

    def _check_expert_biases(self, x: StackExperts) -> None:
        """Each bias pointer table is int64 [E], and points at float32 [2 I] / [d] tensors held in `x.biases`."""
        held = {b.data_ptr(): b for b in x.biases}
        for table, n in ((x.gate_up_bias, 2 * x.intermediate), (x.down_bias, self.shape.d)):
            if table is None:
                continue
            _check(table, "the experts' bias pointers", (x.num_experts,), torch.int64)
            for ptr in table.tolist():
                if ptr not in held:
                    raise ValueError("the experts' bias pointers must be their biases'")
                _check(held[ptr], "an expert's bias", (n,), torch.float32)

    def set_sinks(self, layer: int, sinks: torch.Tensor | None) -> None:
        """Layer `layer` (added) adds each head's sink logit (float32 [heads]; gpt-oss) to its softmax's denominator
        (None: no sinks)."""
        if not 0 <= layer < self.native.num_layers():
            raise ValueError(f"layer {layer} has not been added")
        _check(sinks, "a layer's attention sinks", (self.shape.heads,), torch.float32)
        self._alive.append(sinks)
        self.native.set_sinks(layer, _ptr(sinks))

    def set_packed_embedding(self, packed: torch.Tensor, format_id: int, rows: int, k: int) -> None:
        """The embedding is a quantized (or a tied LM head's bf16) weight's panels [rows, k >= d], its rows
        unpacked as they are looked up; the step calls then take `packed` itself as their `embed`."""
        if format_id not in {*QUANTIZED_IDS, FORMATS["bf16"]} or k < self.shape.d:
            raise ValueError(f"a packed embedding is bf16 or quantized, and at least {self.shape.d} wide")
        check_packed(packed, format_id, rows, k)
        self.native.set_packed_embedding(format_id, k)
        self.packed_embedding = (packed, rows)
        self._alive.append(packed)

    def _rows(self, embed: torch.Tensor) -> int:
        """The embedding's rows (a packed one's as set, a table's its first dimension)."""
        packed = self.packed_embedding
        return packed[1] if packed is not None and embed is packed[0] else embed.shape[0]

    def set_lora(self, layer: int, projection: int, tables: Sequence[torch.Tensor], bf16: bool) -> None:
        """Layer `layer`'s projection (0 qkv, 1 o, 2 gate_up, 3 down) takes the adapters of these slot tables: A
        and B^T pointers (to bfloat16 matrices where `bf16`, else float32) and ranks, int64 [slots], and scales,
        float32 [slots] (models/lora.py: LoraProjection)."""
        if not 0 <= layer < self.native.num_layers() or not 0 <= projection < 4:
            raise ValueError(f"no projection {projection} of layer {layer} in the stack")
        slots = tables[0].shape[0]
        for t, dtype in zip(tables, (torch.int64, torch.int64, torch.int64, torch.float32), strict=True):
            _check(t, "a LoRA slot table", (slots,), dtype)
        self._lora_tables[layer, projection] = tuple(tables)  # alive while the stack points at them
        self.native.set_lora(layer, projection, *(t.data_ptr() for t in tables), slots, bf16)

    def set_lora_rows(self, slots: torch.Tensor | None, rows: int) -> None:
        """The next steps' LoRA slot per row (int64 [rows], -1: the base model), or none; a slot past the
        tables raises before anything runs."""
        if slots is not None:
            _check(slots, "the rows' LoRA slots", (rows,), torch.int64)
        self._lora_rows = slots
        self.native.set_lora_rows(_ptr(slots), rows)

    def set_head(self, head: StackLinear) -> None:
        self.native.set_head(self._linear(head, None, self.shape.d))
        self.vocab = head.n

    # -- per step ---------------------------------------------------------------------------------------------
    def _check_step(
        self, embed: torch.Tensor | None, ids: Sequence[int], rows: int, positions: Sequence[int],
        tables: Sequence[int], slots: Sequence[int], block_size: int,
    ) -> None:  # fmt: skip
        """Token ids within the embedding, positions within the rotary tables' `rows`, slots and the block tables'
        ids (flat) within the pool."""
        if embed is not None:
            if self.packed_embedding is None or embed is not self.packed_embedding[0]:
                _check(embed, "the embedding", (embed.shape[0], self.shape.d), self.dtype)
            _in_range(ids, self._rows(embed), "token ids")
        _in_range(positions, rows, "positions (the rotary tables' rows)")
        _in_range(slots, self.num_slots, "slots")
        _in_range(tables, self.num_slots // block_size, "block ids")

    def _check_outputs(self, rows: int, out: torch.Tensor, logits: torch.Tensor | None, wide: torch.Tensor | None,
                       top: torch.Tensor | None) -> None:  # fmt: skip
        _check(out, "out", (rows, self.shape.d), self.dtype)
        if (logits is not None or wide is not None or top is not None) and not self.vocab:
            raise ValueError("logits asked of a stack without its head")
        _check(logits, "logits", (rows, self.vocab), self.dtype)
        _check(wide, "float32 logits", (rows, self.vocab), torch.float32)
        _check(top, "argmax", (rows,), torch.int64)

    def _check_rotary(self, cos: torch.Tensor, sin: torch.Tensor, rows: int | None = None) -> int:
        """The rotary tables' rows (float32 [P, Dh] or, per row, the model's dtype [rows, Dh])."""
        for t in (cos, sin):
            bad_rows = rows is not None and t.shape[0] != rows
            if t.dim() != 2 or t.shape[1] != self.shape.head_dim or not t.is_contiguous() or bad_rows:
                raise ValueError(f"rotary tables must be contiguous [P, {self.shape.head_dim}], got {list(t.shape)}")
        return int(cos.shape[0])

    def step_lists(
        self, embed: torch.Tensor, ids: list[int], positions: list[int], cos: torch.Tensor, sin: torch.Tensor,
        slots: list[int], tables: list[int], width: int, lens: list[int], block_size: int, out: torch.Tensor,
        logits: torch.Tensor | None, wide: torch.Tensor | None, top: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """One decode step of len(ids) rows from lists: embedding rows, rotary rows, new slots, tables [B * width]."""
        self._check_step(embed, ids, self._check_rotary(cos, sin), positions, tables, slots, block_size)
        self._check_outputs(len(ids), out, logits, wide, top)
        self.native.run_lists(embed.data_ptr(), self._rows(embed), ids, positions, cos.data_ptr(), sin.data_ptr(),
                              slots, tables, width, lens, block_size, out.data_ptr(), _ptr(logits), _ptr(wide),
                              _ptr(top))  # fmt: skip

    def step_tensors(
        self, embed: torch.Tensor | None, ids: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, block_size: int,
        out: torch.Tensor, logits: torch.Tensor | None, wide: torch.Tensor | None, top: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """One decode step over int64 tensors: with `embed`, token ids and positions into the rotary tables;
        without it, `ids` are the embedded rows [B, D] and cos/sin are each row's [B, Dh]."""
        rows = ids.shape[0]
        for t, name in ((slots, "slots"), (lens, "lens"), (tables, "block tables")):
            if t.dtype != torch.int64 or not t.is_contiguous() or t.shape[0] != rows:
                raise ValueError(f"{name} must be contiguous int64 with a row per sequence")
        self._check_outputs(rows, out, logits, wide, top)
        table_list = tables.view(-1).tolist()
        bs = block_size
        if embed is not None:
            self._check_step(embed, ids.tolist(), self._check_rotary(cos, sin), positions.tolist(), table_list,
                             slots.tolist(), bs)  # fmt: skip
            self.native.run_ids(embed.data_ptr(), self._rows(embed), ids.data_ptr(), positions.data_ptr(),
                                cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1],
                                lens.data_ptr(), rows, bs, out.data_ptr(), _ptr(logits), _ptr(wide),
                                _ptr(top))  # fmt: skip
            return
        _check(ids, "the embedded rows", (rows, self.shape.d), self.dtype)
        self._check_rotary(cos, sin, rows)
        self._check_step(None, [], rows, [], table_list, slots.tolist(), bs)
        self.native.run(ids.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                        tables.shape[1], lens.data_ptr(), rows, bs, out.data_ptr(), _ptr(logits), _ptr(wide),
                        _ptr(top))  # fmt: skip

    def decode_run(
        self, embed: torch.Tensor, ids: list[int], starts: list[int], cos: torch.Tensor, sin: torch.Tensor,
        slots: list[int], tables: list[int], width: int, steps: int, block_size: int, out: torch.Tensor,
        logits: torch.Tensor, draws: tuple[list[Any], list[list[float]]] | None,
    ) -> list[list[int]]:  # fmt: skip
        """`steps` decode steps of len(ids) rows, each fed the last one's tokens: the head's argmax, or with `draws`
        (params [B], uniforms [steps][B]) the kernel's draw. Returns each row's tokens."""
        rows = len(ids)
        positions = [p + r for p in starts for r in (0, steps - 1)]
        self._check_step(embed, ids, self._check_rotary(cos, sin), positions, tables, slots, block_size)
        self._check_outputs(rows, out, logits, None, None)
        if not self.vocab:
            raise ValueError("a decode run needs the stack's head")
        params, u = draws if draws is not None else ([], [])
        return self.native.run_steps(embed.data_ptr(), self._rows(embed), ids, starts, cos.data_ptr(), sin.data_ptr(),
                                     slots, tables, width, steps, block_size, out.data_ptr(), logits.data_ptr(),
                                     logits.dtype == torch.bfloat16, self.vocab, [p.temperature for p in params],
                                     [max(p.top_k, 0) for p in params], [p.top_p for p in params],
                                     [p.min_p for p in params], [x for row in u for x in row])  # fmt: skip

    def greedy(
        self, embed: torch.Tensor, tokens: torch.Tensor, active: torch.Tensor, feed: torch.Tensor,
        feed_seq: torch.Tensor, feed_last: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
        tables: torch.Tensor, lens: torch.Tensor, block_size: int, out: torch.Tensor, logits: torch.Tensor,
    ) -> None:  # fmt: skip
        """Greedy rounds (a draft model's): rows feed `feed` (their catch-up, rows `feed_seq`, each row's last at
        `feed_last`), then each round's argmax back while `active` rows remain; tokens [B, R] gets the drafts."""
        rows, rounds = tokens.shape
        n0, positions = feed.shape[0], slots.shape[0]
        self._check_rotary(cos, sin, positions)
        _check(tables, "block tables", (rows, tables.shape[1]), torch.int64)
        for t, name, size in ((active, "active", rounds), (feed_seq, "feed rows", n0), (feed_last, "last feeds", rows),
                              (lens, "lens", positions)):  # fmt: skip
            _check(t, name, (size,), torch.int64)
        # (the rounds after the catch-up feed back the head's argmax: the caller's embedding covers the head's rows)
        self._check_step(embed, feed.tolist(), positions, [], tables.view(-1).tolist(), slots.tolist(), block_size)
        scratch = max(n0, rows)
        self._check_outputs(scratch, out, logits, None, None)
        self.native.run_greedy(embed.data_ptr(), tokens.data_ptr(), active.data_ptr(), rounds, n0, feed.data_ptr(),
                               feed_seq.data_ptr(), feed_last.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                               slots.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(), rows, block_size,
                               out.data_ptr(), logits.data_ptr())  # fmt: skip

    # -- profiling --------------------------------------------------------------------------------------------
    def set_profile(self, on: bool) -> None:
        self.native.set_profile(on)

    def stage_runs(self) -> list[list[tuple[str, int | None, float, float]]]:
        """The profiled runs' stages as (kind, layer or None, start, end), seconds from the run's start."""
        runs = []
        for marks in self.native.marks():
            stages = [self.native.stage_of(i) for i in range(len(marks) - 1)]
            runs.append([(kind, None if layer < 0 else layer, marks[i], marks[i + 1])
                         for i, (kind, layer) in enumerate(stages)])  # fmt: skip
        return runs
