"""A decode-only step through every decoder layer in one C++ call (kernels/csrc/stack/stack.h).

Per layer, the module path makes ~15 Python calls (norms, linears, RoPE, KV write, attention, SiLU*mul); on a
small model that Python costs more than the arithmetic. For a step in which every sequence decodes one token
over the paged cache, the runner hands the embedded tokens to this stack instead, which calls the same kernels
in the same order from C++ and returns the final norm's output. Prefills and mixed steps take the modules.

It applies to the Llama-shaped stack of `layers.py` (Llama, Mistral, Qwen2, Qwen3, and the MoE families whose
sparse layers' experts run on the one-call expert kernels: Qwen3-MoE, Mixtral, gpt-oss with its attention sinks,
windows, biased router and experts, and clamped SwiGLU) with every linear a `KernelLinear`;
`DecodeStack.build` returns None for anything else, which then runs on the modules.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from tokenmill.attention import KVBackend, PagedKVCache
from tokenmill.attention.paged import PagedMetadata, new_slots, padded_tables
from tokenmill.kernels import Kernels, formats
from tokenmill.kernels.ops import kernel_sinks
from tokenmill.kernels.stack_ops import NativeStack, StackExperts, StackLinear, StackShape
from tokenmill.models.layers import Attention, CausalLM, DecoderLayer, DecoderModel, GatedMLP, RMSNorm
from tokenmill.models.linear import KernelLinear, SegmentedLinear
from tokenmill.models.lora import ModelLoras
from tokenmill.models.moe import SparseMoE, experts_call
from tokenmill.models.packed_embedding import PackedEmbedding
from tokenmill.sampling_params import SamplingParams
from tokenmill.types import LogitsRead, SequenceInput


def _linear_spec(m: nn.Module, in_features: int) -> StackLinear | None:
    if type(m) is SegmentedLinear:
        return _segments_spec(m, in_features)
    if type(m) is not KernelLinear or m.ops is None or m.in_features != in_features:
        return None
    return StackLinear(m.data, m.format_id, m.out_features, m.padded_in, m.bias)


def _segments_spec(m: SegmentedLinear, in_features: int) -> StackLinear | None:
    """A fused projection of quantized shards in several formats, as one stack linear of up to three segments
    (each but the last a whole number of panels, all the same packed width)."""
    parts = [_linear_spec(p, in_features) for p in m.parts]
    if len(parts) > 3 or any(p is None or formats.format_name(p.format_id) not in formats.QUANTIZED for p in parts):
        return None
    specs = [p for p in parts if p is not None]
    if len({p.k for p in specs}) != 1 or any(p.n % formats.PANEL for p in specs[:-1]):
        return None
    starts = list(itertools.accumulate([0] + [p.n for p in specs[:-1]]))
    biases = [p.bias for p in specs]
    bias = None if all(b is None for b in biases) else torch.cat(
        [torch.zeros(p.n) if b is None else b for p, b in zip(specs, biases, strict=True)])  # fmt: skip
    segments = tuple((p.weight, p.format_id, n0) for p, n0 in zip(specs[1:], starts[1:], strict=True))
    return StackLinear(specs[0].weight, specs[0].format_id, m.out_features, specs[0].k, bias, segments)


def _norm(m: nn.Module | None, dtype: torch.dtype) -> torch.Tensor | None:
    if type(m) is not RMSNorm or m.weight.dtype != dtype or not m.weight.is_contiguous():
        return None
    return m.weight


def _layer_spec(layer: DecoderLayer, dims: tuple[int, ...], dtype: torch.dtype) -> list[Any] | None:
    """[[input norm, post norm, q norm, k norm], [qkv, o, gate_up, down]] for the kernel, or for a sparse layer
    [norms, [qkv, o], its SparseMoE]; None if it does not fit."""
    d, h, hkv, dh, i = dims
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(attn, Attention) or type(attn).forward is not Attention.forward:  # (gpt-oss's adds its sinks)
        return None
    if (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (h, hkv, dh):
        return None
    norms = [_norm(layer.input_layernorm, dtype), _norm(layer.post_attention_layernorm, dtype)]
    qk = [None, None] if attn.q_norm is None else [_norm(attn.q_norm, dtype), _norm(attn.k_norm, dtype)]
    specs = [_linear_spec(attn.qkv_proj, d), _linear_spec(attn.o_proj, h * dh)]
    if any(p is None for p in [*norms, *specs]) or (attn.q_norm is not None and None in qk):
        return None
    if isinstance(mlp, SparseMoE) and type(mlp).forward is SparseMoE.forward and type(mlp).route is SparseMoE.route:
        experts = _experts(mlp, d, dtype)  # (gpt-oss's GptOssMoE: its own router and experts, routed here alike)
        return None if experts is None else [[*norms, *qk], specs, experts]
    if type(mlp) is not GatedMLP or mlp.act != "silu" or mlp.intermediate_size != i:
        return None
    mlp_specs = [_linear_spec(mlp.gate_up_proj, d), _linear_spec(mlp.down_proj, i)]
    return None if None in mlp_specs else [[*norms, *qk], specs + mlp_specs]


def _experts(mlp: SparseMoE, d: int, dtype: torch.dtype) -> StackExperts | None:
    """A sparse MLP as the stack takes it, where its router and experts run on the one-call kernels."""
    call, cfg = experts_call(mlp), mlp.moe
    if not call or mlp.router_ops(torch.empty(0, d, dtype=dtype)) is None:
        return None
    if cfg.clamped_swiglu is None and mlp.experts[0].act != "silu":
        return None  # (stack/moe.h: SiLU*mul or gpt-oss's clamped SwiGLU)
    names = ("gate_up_proj", "down_proj")
    weights = [tuple(getattr(e, name).data for e in mlp.experts) for name in names]
    biases = tuple(b for name in names for e in mlp.experts if (b := getattr(e, name).bias) is not None)
    return StackExperts(mlp.gate.weight, cfg.num_experts, cfg.top_k, cfg.norm_topk_prob, cfg.weights_in_float32,
                        cfg.intermediate_size, call.gate_up, call.gate_up_format, call.gate_up_k, weights[0],
                        call.down, call.down_format, call.down_k, weights[1], mlp.router_bias,
                        cfg.softmax_after_top_k, call.gate_up_bias, call.down_bias, biases,
                        cfg.clamped_swiglu)  # fmt: skip


def _intermediate(layers: list[DecoderLayer]) -> int:
    """The dense MLPs' width (a model whose every MLP is sparse: its experts', which no stage then reads)."""
    for layer in layers:
        if type(layer.mlp) is GatedMLP:
            return layer.mlp.intermediate_size
    mlp = layers[0].mlp
    return mlp.moe.intermediate_size if isinstance(mlp, SparseMoE) else 0


T = TypeVar("T")

# the adapted projections in the native stack's order (stack/lora.h)
_LORA_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class DecodeStack:
    def __init__(self, native: NativeStack, decoder: DecoderModel, kv: PagedKVCache, vocab_size: int | None) -> None:
        self.native, self.decoder, self.kv, self.vocab_size = native, decoder, kv, vocab_size  # None: no head
        embed = decoder.embed_tokens
        # the embedding is a plain table in the cache's dtype, or a quantized one in the kernels' panels: the stack
        # reads its rows itself (`embed_table`, `embed_rows` rows of it)
        self.plain_embedding = (
            type(embed) is nn.Embedding and embed.weight.dtype == kv.dtype and embed.weight.is_contiguous()
        )
        self.embed_table, self.embed_rows = embed.weight if self.plain_embedding else None, embed.num_embeddings
        if type(embed) is PackedEmbedding and embed.dtype == kv.dtype and embed.padded_dim >= embed.embedding_dim:
            native.set_packed_embedding(embed.data, embed.format_id, embed.num_embeddings, embed.padded_dim)
            self.plain_embedding, self.embed_table = True, embed.data
        self.loras: ModelLoras | None = None  # the model's LoRA adapters, which single steps apply (use_loras)
        self._lora_version = -1  # the adapters' version whose tables the native stack holds
        # step's outputs: buffers for the most rows so far, and their views by row count
        self._full: tuple[torch.Tensor | None, ...] = ()
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]] = {}
        self._capacity = 0

    @staticmethod
    def build(model: CausalLM, kv: KVBackend) -> DecodeStack | None:
        """The stack for `model` over `kv`, or None when a layer, the cache or a weight does not fit."""
        decoder, pool = model.decoder(), kv.paged  # the block pool, which the stack reads and writes in place
        if pool is None or not isinstance(pool.ops, Kernels) or type(decoder) is not DecoderModel:
            return None  # the stack is the CPU kernels' (a GPU's fused ops run in the layers)
        if pool.storage not in (pool.dtype, torch.int8, torch.float8_e4m3fn):  # another float dtype: the modules'
            return None
        layers = [layer for layer in decoder.layers if type(layer) is DecoderLayer]
        if not layers or len(layers) != len(decoder.layers):
            return None
        first = layers[0].self_attn
        d = decoder.norm.weight.shape[0]
        dims = (d, first.num_heads, first.num_kv_heads, first.head_dim, _intermediate(layers))
        final = _norm(decoder.norm, pool.dtype)
        if final is None:
            return None
        native = pool.ops.decode_stack(pool.dtype, StackShape(*dims), decoder.norm.eps, pool.cache, final, len(layers),
                                       torch.get_num_threads(), pool.scales)  # fmt: skip
        for index, layer in enumerate(layers):
            spec = _layer_spec(layer, dims, pool.dtype)
            if spec is None or layer.self_attn.layer_idx != index:
                return None
            if len(spec) == 3:
                native.add_sparse_layer(*spec)
            else:
                native.add_layer(*spec)
            native.set_window(index, pool.windows[index] if pool.windows else None)
            native.set_sinks(index, kernel_sinks(layer.self_attn.sinks, dims[1]))  # as the module path's kernels
        # the LM head joins the stack when logits are the head's output as is (a family may post-process them)
        plain_logits = type(model).compute_logits is CausalLM.compute_logits
        head = _linear_spec(model.lm_head, dims[0]) if plain_logits else None
        if head is not None:
            native.set_head(head)
        return DecodeStack(native, decoder, pool, None if head is None else head.n)

    def use_loras(self, loras: ModelLoras | None) -> None:
        """Apply these adapters (the CPU kernels' tables: models/lora.py) to the rows that take one in `step` and
        `step_from_metadata` and `decode_run`; greedy drafts (a draft model's) take none."""
        self.loras = loras if loras is not None and loras.ops is not None else None
        self._lora_version = -1

    @property
    def takes_lora(self) -> bool:
        return self.loras is not None

    def _adapter_rows(self, rows: int) -> torch.Tensor | None:
        """The step's LoRA slot per row [rows] (the runner's batch), its tables registered first where adapters
        came or went; None where no row takes an adapter."""
        loras = self.loras
        batch = None if loras is None else loras.state.batch
        if loras is None or batch is None or batch.slots is None:
            return None
        if self._lora_version != loras.version:
            for (layer, name), tables in loras.tables().items():
                self.native.set_lora(layer, _LORA_PROJECTIONS.index(name), tables, loras.tables_bf16)
            self._lora_version = loras.version
        return batch.slots

    def _run(self, rows: int, call: Callable[[], T]) -> T:
        """`call` (native steps of these rows) with the step's adapter rows set, and none after it."""
        slots = self._adapter_rows(rows)
        if slots is None:
            return call()
        self.native.set_lora_rows(slots, rows)
        try:
            return call()
        finally:
            self.native.set_lora_rows(None, 0)

    def _table(self) -> torch.Tensor:
        assert self.embed_table is not None  # (only where plain_embedding)
        return self.embed_table

    @property
    def greedy_ready(self) -> bool:
        """`greedy_drafts` and `decode_run` can run: the head is in the stack, and the embedding is a plain table in the
        cache's dtype with a row for every token the head can give (`greedy_drafts` feeds them back unchecked)."""
        vocab = self.vocab_size
        return vocab is not None and self.plain_embedding and self.embed_rows >= vocab

    def greedy_drafts(
        self, feeds: list[list[int]], starts: list[int], tables: list[list[int]], rounds: list[int]
    ) -> list[list[int]]:
        """Greedy decoding in one native call, as a draft model proposes: row b feeds the tokens feeds[b] at
        positions starts[b].. (its catch-up; the last one's argmax is its first draft), then each draft back, and
        gets its rounds[b] >= 1 drafts. The caller has allocated the slots of every position fed, the drafts'
        included, in tables[b]."""
        order = sorted(range(len(feeds)), key=lambda b: -rounds[b])  # the rows of chain round r are a prefix
        n, r_max, bs = len(order), rounds[order[0]], self.kv.block_size
        fed = [feeds[b] for b in order]
        # NOTE: index lists in plain Python: a draft step is a few rows, where each torch op costs more than its
        # arithmetic (Xeon, demo draft: ~20 small ops were a fifth of a spec step)
        feed_seq = [i for i, f in enumerate(fed) for _ in f]  # [n0]: each feed row's row b
        feed_last = [e - 1 for e in itertools.accumulate(len(f) for f in fed)]  # [B]: b's last feed row
        first = [starts[b] for b in order]  # [B]
        feed_pos = [first[i] + j for i, f in enumerate(fed) for j in range(len(f))]  # [n0]
        # chain round r feeds draft r + 1 at first + len + r, up to the row's last draft fed (clamped: in range)
        after = [first[i] + len(fed[i]) for i in range(n)]  # [B]
        last = [max(after[i] + rounds[b] - 2, after[i] - 1) for i, b in enumerate(order)]  # [B]
        chain = [min(after[i] + r, last[i]) for r in range(r_max - 1) for i in range(n)]  # [(R - 1) B]
        pos = feed_pos + chain  # [n0 + (R - 1) B]
        width = max(-(-(starts[b] + len(feeds[b]) + rounds[b] - 1) // bs) for b in order)
        padded = [tables[b][:width] + [0] * (width - len(tables[b][:width])) for b in order]
        self.kv.zero_new_blocks(padded)
        block_tables = torch.tensor(padded, dtype=torch.int64)  # [B, M]
        row_of = feed_seq + [i for _ in range(r_max - 1) for i in range(n)]  # [n0 + (R - 1) B]
        slots = torch.tensor([padded[b][p // bs] * bs + p % bs for b, p in zip(row_of, pos)], dtype=torch.int64)
        lens = torch.tensor([p + 1 for p in pos], dtype=torch.int64)
        cos, sin = self.decoder.rotary(torch.tensor(pos, dtype=torch.int64), self.kv.dtype)  # [n0 + (R-1) B, Dh]
        active = torch.tensor([sum(rounds[b] > r + 1 for b in order) for r in range(r_max)], dtype=torch.int64)
        feed_tok = torch.tensor([t for f in fed for t in f], dtype=torch.int64)  # [n0]
        seq_t, last_t = torch.tensor(feed_seq, dtype=torch.int64), torch.tensor(feed_last, dtype=torch.int64)
        tokens = torch.empty(n, r_max, dtype=torch.int64)  # [B, R]: the drafts
        rows = max(len(feed_tok), n)
        out = torch.empty(rows, self.decoder.norm.weight.shape[0], dtype=self.kv.dtype)  # [rows, D] scratch
        logits = torch.empty(rows, self.vocab_size or 0, dtype=self.kv.dtype)  # [rows, V] scratch
        self.native.greedy(self._table(), tokens, active, feed_tok, seq_t, last_t, cos, sin, slots,
                           block_tables, lens, bs, out, logits)  # fmt: skip
        drafts = tokens.tolist()
        result: list[list[int]] = [[] for _ in order]
        for i, b in enumerate(order):
            result[b] = drafts[i][: rounds[b]]
        return result

    def profile(self, on: bool) -> None:
        """Time every stage of every run from now on (`on`), or stop; either way forget the runs so far. Off, it
        costs nothing."""
        self.native.set_profile(on)

    def stage_runs(self) -> list[list[tuple[str, int | None, float, float]]]:
        """The profiled runs' stages, each as (what it does, its layer or None, start, end): seconds from the run's
        start, as the calling thread saw them (a stage ends when its last chunk is done, on whichever thread)."""
        return self.native.stage_runs()

    def step(
        self,
        sequences: list[SequenceInput],
        input_ids: list[int],
        positions: list[int],
        reads: LogitsRead = LogitsRead.FULL,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """A decode-only step of `sequences` (one new token each: input_ids, positions [B]) from Python lists, with
        no torch op on the way: after a step's weights have streamed through the caches, each torch op's first
        call runs cold code, 20-60 us (Xeon), where a one-row step of Qwen2.5-0.5B in int4 is ~10 ms. Returns
        what `step_from_metadata` does, in buffers that the next call overwrites. Needs `plain_embedding`.

        `reads`: what the step's plan reads of the logits. Below FULL, a bf16 model's logits are not widened into a
        float32 copy (at 16 rows that copy is megabytes of writes a step), and what comes back in its place is None
        (ARGMAX) or the logits in the model's dtype (DRAW, which the CPU kernels draw from)."""
        slots, lens, tables, width = self._decode_lists(sequences)
        rows = len(input_ids)
        out, model_logits, wide, top = self._outputs(rows)
        if reads < LogitsRead.FULL and wide is not model_logits:
            wide = None
        cos_table, sin_table = self.decoder.rotary.tables(max(lens))  # [positions, Dh] float32
        embed = self._table()  # [vocab, D]
        self._run(rows, lambda: self.native.step_lists(embed, input_ids, positions, cos_table, sin_table, slots, tables,
                                                       width, lens, self.kv.block_size, out, model_logits, wide,
                                                       top))  # fmt: skip
        return out, model_logits if reads == LogitsRead.DRAW else wide, top

    def decode_run(
        self,
        sequences: list[SequenceInput],
        steps: int,
        draws: tuple[list[SamplingParams], list[list[float]]] | None = None,
    ) -> list[list[int]]:
        """A decode run (runner._decode_run): `steps` decode steps of `sequences` (one new token each) in one native
        call, each step fed the last one's tokens, from Python lists as step takes its inputs; the slots of
        every position are in the block tables. Each token is the head's argmax, or with `draws` (params [B],
        uniforms [steps][B]) the draw `Kernels.draw` would make from the logits in the model's dtype (a greedy
        row's: the argmax). Returns each sequence's tokens."""
        slots, tables, width = self._decode_run_lists(sequences, steps)
        out, logits, _, _ = self._outputs(len(sequences))  # [B, D], [B, V] model dtype (scratch)
        assert logits is not None and self.vocab_size is not None  # greedy_ready
        cos_table, sin_table = self.decoder.rotary.tables(max(s.start for s in sequences) + steps)  # [P, Dh] float32
        embed = self._table()  # [vocab, D]
        starts = [s.start for s in sequences]
        ids = [s.token_ids[0] for s in sequences]
        return self._run(len(ids), lambda: self.native.decode_run(embed, ids, starts, cos_table, sin_table, slots,
                                                                  tables, width, steps, self.kv.block_size, out,
                                                                  logits, draws))  # fmt: skip

    def _decode_lists(self, sequences: list[SequenceInput]) -> tuple[list[int], list[int], list[int], int]:
        """A decode-only step's inputs as plain lists: each sequence's new slot [B], its context length [B], the
        block tables [B * M] row by row, padded with block 0, and M."""
        tables, lens = [s.block_table for s in sequences], [s.seq_len for s in sequences]
        self.kv.zero_new_blocks(tables)
        width, padded = padded_tables(tables, lens, self.kv.block_size)
        return new_slots(tables, lens, self.kv.block_size), lens, padded, width

    def _decode_run_lists(self, sequences: list[SequenceInput], steps: int) -> tuple[list[int], list[int], int]:
        """_decode_lists for a decode run of `steps` steps of each sequence (one new token each, then each step's
        token): the new slots [steps * B], step r's at [r B, (r + 1) B); the block tables [B * M] row by row, padded
        with block 0 to the last step's longest context; and M."""
        tables, bs = [s.block_table for s in sequences], self.kv.block_size
        self.kv.zero_new_blocks(tables)
        slots = [slot for r in range(steps) for slot in new_slots(tables, [s.start + r + 1 for s in sequences], bs)]
        width, padded = padded_tables(tables, [s.start + steps for s in sequences], bs)
        return slots, padded, width

    def _outputs(self, rows: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """`rows` rows of step's outputs, views of buffers kept from step to step and grown to the most rows
        seen: out [B, D] and the logits [B, V] (model dtype), those as float32 [B, V] (the logits themselves for a
        float32 model) and their argmax [B] int64 (None, None, None without the head)."""
        if rows not in self._views:
            if rows > self._capacity:  # larger storage; the old views go with the old buffers
                d, v, dtype = self.decoder.norm.weight.shape[0], self.vocab_size, self.kv.dtype
                out = torch.empty(rows, d, dtype=dtype)
                logits = None if v is None else torch.empty(rows, v, dtype=dtype)
                wide = logits if v is None or dtype == torch.float32 else torch.empty(rows, v)
                top = None if v is None else torch.empty(rows, dtype=torch.int64)
                self._full, self._views, self._capacity = (out, logits, wide, top), {}, rows
            self._views[rows] = tuple(None if t is None else t[:rows] for t in self._full)  # type: ignore[assignment]
        return self._views[rows]

    def step_from_metadata(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """input_ids, positions [B] -> ([B, D] what the decoder's forward returns for them, [B, V] float32 what
        `compute_logits` makes of that, and [B] int64 each row's argmax of those logits, as torch.argmax; both
        None when the LM head is not a kernel linear)."""
        assert meta.decode_block_tables is not None and meta.decode_lens is not None
        tables, lens, slots = meta.decode_block_tables, meta.decode_lens, meta.slot_mapping
        rows, dtype = len(input_ids), self.kv.dtype
        out = torch.empty(rows, self.decoder.norm.weight.shape[0], dtype=dtype)  # [B, D]
        logits = None if self.vocab_size is None else torch.empty(rows, self.vocab_size, dtype=dtype)  # [B, V]
        # a bf16 model's logits come back widened to float32 as well, by the head's own chunks
        wide = logits if logits is None or logits.dtype == torch.float32 else torch.empty(logits.shape)  # [B, V]
        top = None if logits is None else torch.empty(rows, dtype=torch.int64)  # [B]
        if self.plain_embedding:  # the stack gathers the rows of the embedding and rotary tables itself
            cos_table, sin_table = self.decoder.rotary.tables(max(meta.seq_lens))  # [positions, Dh] float32
            embed = self._table()
            self._run(rows, lambda: self.native.step_tensors(embed, input_ids, positions, cos_table, sin_table, slots,
                                                             tables, lens, self.kv.block_size, out, logits, wide,
                                                             top))  # fmt: skip
            return out, wide, top
        x = self.decoder.embed_tokens(input_ids)  # [B, D]
        cos, sin = self.decoder.rotary(positions, dtype)  # [B, Dh] each
        self._run(rows, lambda: self.native.step_tensors(None, x, positions, cos, sin, slots, tables, lens,
                                                         self.kv.block_size, out, logits, wide, top))  # fmt: skip
        return out, wide, top
