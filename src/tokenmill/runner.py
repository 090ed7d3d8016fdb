"""The model runner: turns the scheduled requests into one flattened batch, runs the model once, samples.

It owns every tensor of a step (inputs, KV storage, sampler state) and nothing about who runs: the engine
core hands it the requests and how many new tokens each computes this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.attention.contiguous import ContiguousKVStore
from tokenmill.models import CausalLM
from tokenmill.outputs import Logprobs
from tokenmill.sampling import Sampler, SamplingBatch, topk_logprobs
from tokenmill.types import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # computed this step, starting at request.num_computed_tokens


@dataclass
class RunnerOutput:
    """Pure data back to the engine core."""

    sampled: dict[str, tuple[int, Logprobs | None]] = field(default_factory=dict)  # request id -> token
    prompt_logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)  # request id -> new entries


class ModelRunner:
    def __init__(self, model: CausalLM, device: torch.device, kv_cache: str, seed: int = 0) -> None:
        cfg = model.config
        self.model, self.device = model, device
        self.dtype = model.lm_head.weight.dtype
        self.use_cache = kv_cache != "none"
        self.kv = ContiguousKVStore(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, device)
        self.sampler = Sampler(seed)
        self._slots: dict[str, int] = {}
        self._next_slot = 0
        self._generators: dict[str, torch.Generator] = {}

    def free(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self.kv.free(slot)
        self._generators.pop(request_id, None)

    def _slot(self, req: Request) -> int:
        slot = self._slots.get(req.request_id)
        if slot is None:
            slot = self._slots[req.request_id] = self._next_slot
            self._next_slot += 1
            if self.use_cache:
                self.kv.allocate(slot, req.num_prompt_tokens + req.max_tokens)
            if req.seed is not None:
                self._generators[req.request_id] = torch.Generator().manual_seed(req.seed)
        return slot

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> RunnerOutput:
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc, seq_lens, slots = [0], [], []
        sample_rows: list[int] = []  # flattened index of the last token of each request that samples
        sampling_reqs: list[Request] = []
        prompt_rows: list[tuple[Request, int, int]] = []  # (request, first flat index, count)
        for item in scheduled:
            req, start, n = item.request, item.request.num_computed_tokens, item.num_new_tokens
            slots.append(self._slot(req))
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

        meta = AttentionMetadata(query_start_loc, seq_lens, slots, self.kv if self.use_cache else None)
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
