"""CUDA graphs for decode steps: a decode-only step on a GPU replays one recorded graph instead of launching the
model's ~30 kernels per layer from Python, one by one.

A graph is recorded per bucket on first use: the batch padded up to one of `BATCH_BUCKETS` rows, and the block
tables to a width in blocks that is a power of two. A bucket's inputs live in one static int64 tensor (token ids,
positions, new slots, context lengths, then the block tables), which a step fills with one copy. Padded rows hold
token 0 at position 0, write their keys and values to the pool's spare block (which no table holds) and attend
to that one position. The graph computes every row's logits; the runner samples the real rows outside it.

`--enforce-eager` (vLLM's name) turns graphs off. Where recording fails (an op CUDA cannot record, no memory left
for a graph), one warning says so and decode steps run eagerly from then on; the step itself is computed eagerly.
Without a GPU (the tests on a CPU) the same buckets run eagerly: what a graph would record, without recording it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.attention import KVBackend, PagedKVCache
from tokenmill.models import CausalLM
from tokenmill.types import SequenceInput

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
log = logging.getLogger("tokenmill.engine")


@dataclass
class _Bucket:
    inputs: torch.Tensor  # [4 B + B M] int64: ids, positions, slots, lens [B] each, then tables [B, M]
    logits: torch.Tensor | None = None  # [B, V] float32: the last run's (the graph's static output)
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv: PagedKVCache, max_num_seqs: int, max_model_len: int, record: bool):
        assert kv.spare_slot is not None, "padded rows need the pool's spare block"
        self.model, self.kv, self.record = model, kv, record
        self.batch_buckets = [b for b in BATCH_BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.max_blocks = -(-max_model_len // kv.block_size)
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if record else None

    @classmethod
    def build(
        cls, model: CausalLM, kv: KVBackend, max_num_seqs: int, max_model_len: int, enforce_eager: bool
    ) -> DecodeGraphs | None:
        """Graphs for a model on a GPU over the paged pool, unless `enforce_eager`; None elsewhere, and for a model
        whose steps cannot be recorded (`graph_capturable`: a MoE's routing)."""
        pool = kv.paged
        if enforce_eager or pool is None or pool.device.type != "cuda" or pool.spare_slot is None:
            return None
        if not model.graph_capturable:
            return None
        return cls(model, pool, max_num_seqs, max_model_len, record=True)

    def applies(self, seqs: Sequence[SequenceInput], num_decodes: int) -> bool:
        """A decode-only step (every sequence one new token) of a size some bucket holds."""
        return 0 < num_decodes == len(seqs) <= self.batch_buckets[-1]

    def logits(self, seqs: Sequence[SequenceInput]) -> torch.Tensor:  # [B, V] float32
        """Run the decode step of `seqs` (one new token each) through its bucket's graph."""
        bs, n = self.kv.block_size, len(seqs)
        rows = next(b for b in self.batch_buckets if b >= n)
        needed = max(-(-s.seq_len // bs) for s in seqs)
        width = min(1 << (needed - 1).bit_length(), max(self.max_blocks, needed))
        tables = [s.block_table[:width] for s in seqs]
        self.kv.zero_new_blocks(tables)
        spare = self.kv.spare_slot
        assert spare is not None
        pad = rows - n
        ids = [s.token_ids[0] for s in seqs] + [0] * pad
        positions = [s.start for s in seqs] + [0] * pad
        slots = [t[s.start // bs] * bs + s.start % bs for t, s in zip(tables, seqs)] + [spare] * pad
        lens = [s.seq_len for s in seqs] + [1] * pad
        flat = [b for t in tables for b in t + [0] * (width - len(t))]
        flat += [spare // bs] * (width * pad)  # a padded row's table: the spare block, its one position
        host = torch.tensor(ids + positions + slots + lens + flat, dtype=torch.int64)
        bucket = self.buckets.get((rows, width))
        if bucket is None:
            inputs = torch.empty(host.shape, dtype=torch.int64, device=self.kv.device)
            bucket = self.buckets[rows, width] = _Bucket(inputs)
        bucket.inputs.copy_(host, non_blocking=False)
        if bucket.graph is not None:
            bucket.graph.replay()
        elif self.record:
            try:
                self._record(bucket, rows, width)
            except RuntimeError as e:  # a model op CUDA cannot record, or no memory for the graph: run eagerly
                log.warning("recording a CUDA graph failed (%s); decode steps run eagerly from now on",
                            str(e).splitlines()[0] if str(e) else type(e).__name__)  # fmt: skip
                self.record, self.buckets = False, {}
                return self.logits(seqs)
        else:
            bucket.logits = self._forward(bucket.inputs, rows, width)
        assert bucket.logits is not None
        return bucket.logits[:n]

    def _forward(self, inputs: torch.Tensor, rows: int, width: int) -> torch.Tensor:  # [rows, V] float32
        ids, positions, slots, lens = inputs[: 4 * rows].view(4, rows)
        meta = self.kv.decode_metadata(slots, lens, inputs[4 * rows :].view(rows, width))
        return self.model.compute_logits(self.model(ids, positions, self.kv, meta))

    def _record(self, bucket: _Bucket, rows: int, width: int) -> None:
        """Warm the bucket up on a side stream (as CUDA graphs require), then record it; its inputs are this step's,
        so the warm-up runs compute this step (writing the same keys and values to the same slots) and the
        recording's output is its result."""
        stream = torch.cuda.Stream(device=self.kv.device)
        stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(bucket.inputs, rows, width)
        torch.cuda.current_stream(self.kv.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bucket.logits = self._forward(bucket.inputs, rows, width)
        graph.replay()
        bucket.graph = graph
