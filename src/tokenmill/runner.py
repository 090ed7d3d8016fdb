"""The model runner: turns the scheduled requests into one flattened batch, runs the model once, samples.

It owns every tensor of a step (inputs, KV storage, sampler state) and nothing about who runs: the
scheduler's output says which requests compute how many new tokens, and in which KV blocks they live.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.attention.contiguous import ContiguousKVStore
from tokenmill.attention.paged import PagedKVStore
from tokenmill.models import CausalLM
from tokenmill.outputs import Logprobs
from tokenmill.sampling import Sampler, SamplingBatch, topk_logprobs
from tokenmill.scheduler import ScheduledRequest, SchedulerOutput
from tokenmill.types import Request


@dataclass
class RunnerOutput:
    """Pure data back to the engine core."""

    sampled: dict[str, tuple[int, Logprobs | None]] = field(default_factory=dict)  # request id -> token
    prompt_logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)  # request id -> new entries


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        kv_cache: str,
        num_kv_blocks: int = 0,
        block_size: int = 16,
        seed: int = 0,
    ) -> None:
        cfg = model.config
        self.model, self.device = model, device
        self.dtype = model.model.embed_tokens.weight.dtype
        self.kv_mode = kv_cache
        self.paged: PagedKVStore | None = None
        self.contiguous: ContiguousKVStore | None = None
        if kv_cache == "paged":
            self.paged = PagedKVStore(
                cfg.num_layers, num_kv_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype, device
            )
        elif kv_cache == "contiguous":
            self.contiguous = ContiguousKVStore(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, device)
        self.block_size = block_size
        self.sampler = Sampler(seed)
        self._slots: dict[str, int] = {}  # contiguous store: request id -> buffer
        self._next_slot = 0
        self._generators: dict[str, torch.Generator] = {}
        self._zeroed_below = 0  # paged blocks [0, this) have been zeroed once (the store is torch.empty)

    def free(self, request_id: str) -> None:
        """Forget a finished request: its contiguous buffer and its random generator."""
        slot = self._slots.pop(request_id, None)
        if slot is not None and self.contiguous is not None:
            self.contiguous.free(slot)
        self._generators.pop(request_id, None)

    def _first_sight(self, req: Request) -> None:
        if req.seed is not None and req.request_id not in self._generators:
            self._generators[req.request_id] = torch.Generator().manual_seed(req.seed)
        if self.contiguous is not None and req.request_id not in self._slots:
            slot = self._slots[req.request_id] = self._next_slot
            self._next_slot += 1
            self.contiguous.allocate(slot, req.num_prompt_tokens + req.max_tokens)

    def _slots_of(self, block_table: list[int], start: int, end: int) -> torch.Tensor:  # [end - start]
        pos = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.int64)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.device)

    def _metadata(
        self, items: list[ScheduledRequest], num_decodes: int, so: SchedulerOutput, query_start_loc: list[int],
        seq_lens: list[int],
    ) -> AttentionMetadata:  # fmt: skip
        meta = AttentionMetadata(query_start_loc, seq_lens)
        if self.paged is not None:
            bs = self.block_size
            tables = [so.block_tables[s.request.request_id] for s in items]
            # batched decode reads whole blocks, padding included: never uninitialized memory. A block is in some
            # table before its first write, so zeroing every id up to the highest seen keeps that true.
            top = max((max(t) for t in tables if t), default=-1) + 1
            if top > self._zeroed_below:
                self.paged.zero_blocks(self._zeroed_below, top)
                self._zeroed_below = top
            meta.kv = self.paged
            # decodes: the new token's slot by arithmetic; the context is read as whole blocks in one gather
            slots = [tables[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(seq_lens[:num_decodes])]
            pieces = [torch.tensor(slots, dtype=torch.int64, device=self.device)]
            meta.context_slots = [None] * num_decodes
            if num_decodes:
                width = max(-(-n // bs) for n in seq_lens[:num_decodes])
                padded = [t[:width] + [0] * (width - len(t[:width])) for t in tables[:num_decodes]]
                meta.num_decodes = num_decodes
                meta.decode_block_tables = torch.tensor(padded, dtype=torch.int64, device=self.device)  # [B, M]
                lens = torch.tensor(seq_lens[:num_decodes], device=self.device)
                pad = torch.arange(width * bs, device=self.device) >= lens[:, None]  # [B, S]
                bias = torch.zeros(pad.shape, dtype=self.dtype, device=self.device).masked_fill_(pad, float("-inf"))
                meta.decode_bias = bias[:, None, None, :]
            for i in range(num_decodes, len(items)):
                n, q_len = seq_lens[i], query_start_loc[i + 1] - query_start_loc[i]
                ctx = self._slots_of(tables[i], 0, n) if q_len != n else None  # a fresh prefill reads no cache
                meta.context_slots.append(ctx)
                pieces.append(ctx[n - q_len :] if ctx is not None else self._slots_of(tables[i], 0, n))
            meta.slot_mapping = torch.cat(pieces)  # [T]
        elif self.contiguous is not None:
            meta.kv = self.contiguous
            meta.slots = [self._slots[s.request.request_id] for s in items]
        return meta

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc, seq_lens = [0], []
        sample_rows: list[int] = []  # flattened index of the last token of each request that samples
        sampling_reqs: list[Request] = []
        prompt_rows: list[tuple[Request, int, int]] = []  # (request, first flat index, count)
        # one-token sequences first: with the paged store they share one batched attention call
        items = [s for s in so.scheduled if s.num_new_tokens == 1] if self.paged is not None else []
        num_decodes = len(items)
        items += [s for s in so.scheduled if s.num_new_tokens != 1 or self.paged is None]
        for item in items:
            req, start, n = item.request, item.request.num_computed_tokens, item.num_new_tokens
            self._first_sight(req)
            offset = len(input_ids)
            input_ids += req.all_token_ids[start : start + n]
            positions += range(start, start + n)
            query_start_loc.append(len(input_ids))
            seq_lens.append(start + n)
            if start + n == req.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sampling_reqs.append(req)
            if req.params.prompt_logprobs is not None:
                # position p scores prompt token p+1; skip positions already scored (recompute mode)
                first = max(start, len(req.prompt_logprobs) - 1 if req.prompt_logprobs else 0)
                count = min(start + n, req.num_prompt_tokens - 1) - first
                if count > 0:
                    prompt_rows.append((req, offset + first - start, count))

        meta = self._metadata(items, num_decodes, so, query_start_loc, seq_lens)
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden = self.model(ids_t, pos_t, meta)  # [T, D]

        out = RunnerOutput()
        for req, row, count in prompt_rows:
            logprobs = self.model.compute_logits(hidden[row : row + count]).log_softmax(dim=-1)
            first = positions[row]
            targets = torch.tensor(req.prompt_token_ids[first + 1 : first + 1 + count], device=self.device)
            k = req.params.prompt_logprobs or 0
            out.prompt_logprobs[req.request_id] = topk_logprobs(logprobs, targets, [k] * count)
        if sampling_reqs:
            logits = self.model.compute_logits(hidden[sample_rows])  # [B, V] float32
            batch = SamplingBatch.build(
                [r.params for r in sampling_reqs],
                [r.prompt_token_ids for r in sampling_reqs],
                [r.output_token_ids for r in sampling_reqs],
                [self._generators.get(r.request_id) for r in sampling_reqs],
                [r.stop_ids_active() if len(r.output_token_ids) < r.params.min_tokens else [] for r in sampling_reqs],
                self.device,
            )
            result = self.sampler(logits, batch)
            for req, tok, lp in zip(sampling_reqs, result.token_ids, result.logprobs):
                out.sampled[req.request_id] = (tok, lp)
        return out


def plan_num_kv_blocks(
    model: CausalLM,
    device: torch.device,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    num_kv_blocks: int | None = None,
    kv_cache_memory_gb: float | None = None,
) -> int:
    """How many KV blocks to allocate: explicit, or from a memory budget.

    The default budget is a quarter of available RAM capped at 4 GiB on CPU (vLLM's CPU default), or 80% of
    free GPU memory after the weights on CUDA; it is never more than `max_num_seqs` full-length requests need.
    """
    if num_kv_blocks is not None:
        return num_kv_blocks
    cfg = model.config
    dtype = model.model.embed_tokens.weight.dtype
    per_block = PagedKVStore.bytes_per_block(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
    useful = max_num_seqs * -(-max_model_len // block_size)
    if kv_cache_memory_gb is not None:
        return max(1, int(kv_cache_memory_gb * 2**30 // per_block))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = 0.8 * free
    else:
        import psutil

        budget = min(0.25 * psutil.virtual_memory().available, 4 * 2**30)
    return max(1, min(int(budget // per_block), useful))
