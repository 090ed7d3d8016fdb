"""The model runner: turns a `ModelInput` into one flattened batch, runs it on the first forward path that supports
the step's plan (forward/), samples.

It owns the step's tensors, the per-request random generators, a chunked pooled prompt's running sum and the KV
backend it was given, and nothing about who runs or why: it reads the batch description the engine core built and
never a `Request`. Before each step it runs the test hooks the environment sets (fault_hooks.py).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator

import torch

from tokenmill.attention import KVBackend
from tokenmill.cuda_graphs import DecodeGraphs
from tokenmill.fault_hooks import StepHooks
from tokenmill.forward import (
    DecodeRunPath,
    Forward,
    ForwardPath,
    GraphsPath,
    ModulesPath,
    Rows,
    StackListsPath,
    StackMetadataPath,
    flatten,
)
from tokenmill.models import CausalLM
from tokenmill.models.decode_stack import DecodeStack
from tokenmill.models.lora import Adapter, LoraBatch, ModelLoras
from tokenmill.models.pooling import Pooler
from tokenmill.outputs import Logprobs
from tokenmill.sampling import Sampler, SamplingBatch, drafts
from tokenmill.types import ModelInput, RunnerOutput, SequenceInput, StepPlan


class ModelRunner:
    def __init__(
        self, model: CausalLM, device: torch.device, kv: KVBackend, seed: int = 0, sample: bool = True
    ) -> None:
        self.model, self.device, self.kv = model, device, kv
        self.sample = sample  # False: compute only (a tensor-parallel worker; rank 0 samples)
        self.sampler = Sampler(seed, getattr(kv, "ops", None))
        self._generators: dict[str, torch.Generator] = {}
        self.pooler: Pooler | None = None  # a pooling model's (models/pooling.py; the assembly sets it)
        self._pool_sums: dict[str, torch.Tensor] = {}  # mean pooling: a prompt's rows summed so far [D] float32
        self._graphs: DecodeGraphs | None = None
        self._lora: ModelLoras | None = None
        self._stack = DecodeStack.build(model, kv)  # decode-only steps in one kernel call, where it fits
        self._set_paths()
        self.hooks = StepHooks()  # the test hooks of the environment (fault_hooks.py); `compute` skips them

    # -- the forward paths: the first of `paths` that supports a step's plan computes it --------------------------
    @property
    def graphs(self) -> DecodeGraphs | None:
        """Decode-only steps as CUDA graph replays (the assembly sets them on a GPU)."""
        return self._graphs

    @graphs.setter
    def graphs(self, graphs: DecodeGraphs | None) -> None:
        self._graphs = graphs
        self._set_paths()

    @property
    def lora(self) -> ModelLoras | None:
        """The model's LoRA adapters, where served with them (the assembly sets them)."""
        return self._lora

    @lora.setter
    def lora(self, lora: ModelLoras | None) -> None:
        self._lora = lora
        self._set_paths()

    @property
    def decode_stack(self) -> DecodeStack | None:
        """The fused decode stack over this model and cache, where it fits (None: the modules compute every step)."""
        return self._stack

    @decode_stack.setter
    def decode_stack(self, stack: DecodeStack | None) -> None:
        self._stack = stack
        self._set_paths()

    def _set_paths(self) -> None:
        stack = self._stack
        paths: list[ForwardPath] = [] if self._graphs is None else [GraphsPath(self._graphs)]
        if stack is not None:
            stack.use_loras(self._lora)
            paths += [StackListsPath(stack), StackMetadataPath(stack, self.device)]
        self.paths: list[ForwardPath] = [*paths, ModulesPath(self.model, self.kv, self.device)]
        # decode runs sample inside the stack with the CPU kernels' draw, which a CUDA graph or a worker cannot
        runs = stack is not None and stack.greedy_ready and self._graphs is None and self.sample
        runs = runs and (self._lora is None or (stack is not None and stack.takes_lora))
        self.run_path = DecodeRunPath(stack) if runs and stack is not None else None

    def path_for(self, plan: StepPlan, rows: Rows) -> ForwardPath:
        """The one rule: the first path that supports the plan (the modules support every step)."""
        return next(p for p in self.paths if p.supports(plan, rows))

    @property
    def runs_decode_steps(self) -> bool:
        """It can run a decode of several steps in one call (`StepPlan.num_steps`), greedy or drawn."""
        return self.run_path is not None

    def release(self, request_id: str) -> None:
        """Forget a finished request: its KV storage (where the backend keeps any), its random generator and its
        pooling sum."""
        self.kv.release(request_id)
        self._generators.pop(request_id, None)
        self._pool_sums.pop(request_id, None)

    def install_lora(self, adapter_id: int, adapter: Adapter) -> None:
        """Put an adapter's matrices beside the model's projections, under `adapter_id` (its rows' `lora_id`)."""
        assert self.lora is not None, "this runner serves no LoRA adapters"
        self.lora.install(adapter_id, adapter)

    def remove_lora(self, adapter_id: int) -> None:
        if self.lora is not None:
            self.lora.remove(adapter_id)

    def _generator(self, seq: SequenceInput) -> torch.Generator | None:
        seed = seq.sampling.seed if seq.sampling is not None else None
        if seed is None:
            return None
        gen = self._generators.get(seq.request_id)
        if gen is None:
            gen = self._generators[seq.request_id] = torch.Generator().manual_seed(seed)
        return gen

    def idle(self) -> None:
        """Nothing runs: let go of what only a running step needs (the MLPs' scratch buffers)."""
        release = getattr(self.model, "release_scratch", None)
        if release is not None:
            release()

    def close(self) -> None:
        """Release what outlives a step (a tensor-parallel runner's worker processes)."""

    @property
    def alive(self) -> bool:
        """Everything this runner needs is running (a tensor-parallel runner: every worker)."""
        return True

    def execute(self, batch: ModelInput) -> RunnerOutput:
        self.hooks.before_step(batch)
        return self.compute(batch)

    @torch.inference_mode()
    def compute(self, batch: ModelInput) -> RunnerOutput:
        """The step itself (`execute` runs the test hooks first)."""
        plan = batch.plan
        if plan.num_steps > 1:
            return self._decode_run(batch)
        runs, rows_of = _split_drafts(batch.sequences)
        rows = flatten(runs)
        flat_rows: dict[tuple[str, int], int] = {}  # (request id, j) -> flattened row sampling its position j
        prompt_rows: list[tuple[SequenceInput, int]] = []  # (sequence, flat index of its first scored position)
        for s, offset in zip(rows.sequences, rows.offsets, strict=True):
            for j, row in rows_of.get(id(s), ()):  # the rows of this run that sample (see _split_drafts)
                flat_rows[s.request_id, j] = offset + row
            if s.prompt_logprobs is not None:
                prompt_rows.append((s, offset + s.prompt_logprobs.first - s.start))
        sampling = [s for s in batch.sequences if s.sampling is not None]
        sample_rows = [flat_rows[s.request_id, j] for s in sampling for j in range(_num_drafts(s) + 1)]
        path = self.path_for(plan, rows)
        computed = self._forward(plan, rows, path)
        hidden, all_logits, all_argmax = computed.hidden, computed.logits, computed.argmax

        out = RunnerOutput(forward_path=path.name)
        if plan.pooling and self.sample:
            assert hidden is not None  # (the CUDA graphs, which give none, take no pooling step)
            out.pooled = self._pool(rows, hidden)
        for s, row in prompt_rows:
            plp = s.prompt_logprobs
            assert plp is not None and hidden is not None
            scores = self.model.compute_logits(hidden[row : row + plp.count])  # [count, V]
            if not self.sample:  # a tensor-parallel worker: its share of a vocab-parallel head, nothing more
                continue
            out.prompt_logprobs[s.request_id] = self.sampler.logprobs_at(scores, plp.target_token_ids, plp.num_top)
        if sampling:
            argmax = None  # [R] int64: the logits' argmax, where the path took it
            logits: torch.Tensor | None  # [R, V] float32, or None where sampling reads only the argmax
            if all_logits is None and all_argmax is not None and sample_rows == list(range(len(all_argmax))):
                logits, argmax = None, all_argmax
            elif all_logits is None:
                assert hidden is not None
                logits = self.model.compute_logits(hidden[sample_rows])  # [R, V] float32
            elif sample_rows == list(range(len(all_logits))):  # every row samples, in order: no gather
                logits, argmax = all_logits, all_argmax
            else:
                logits = all_logits[sample_rows]
                argmax = None if all_argmax is None else all_argmax[sample_rows]
            if self.sample:
                self._sample(sampling, logits, out, batch, argmax)
        return out

    def _forward(self, plan: StepPlan, rows: Rows, path: ForwardPath) -> Forward:
        """The step on its path, with the rows' LoRA adapters where any takes one."""
        with self._adapters(plan, rows):
            return path.forward(plan, rows)

    @contextlib.contextmanager
    def _adapters(self, plan: StepPlan, rows: Rows) -> Iterator[None]:
        """Where rows take LoRA adapters: those rows grouped by adapter for the model's projections (and the decode
        stack) while the block runs."""
        lora = self.lora
        if not plan.lora or lora is None:
            yield
            return
        lora.state.batch = _lora_batch(rows, self.device, lora.slot_of if lora.ops is not None else None)
        try:
            yield
        finally:
            lora.state.batch = None

    def _pool(self, rows: Rows, hidden: torch.Tensor) -> dict[str, list[float]]:
        """The pooled sequences' part of the step (hidden [T, D]): each chunk's rows reduced (mean pooling keeps a
        prompt's running sum from chunk to chunk, restarting at its first: a preempted prompt is recomputed from
        there), and the outputs of those whose prompts end here. The sums are kept only once all are done: a step
        that fails is rerun sequence by sequence."""
        pooler = self.pooler
        assert pooler is not None, "a pooling request reached a runner without a pooler"
        sums: dict[str, torch.Tensor] = {}
        done: list[tuple[SequenceInput, torch.Tensor]] = []  # (sequence, pooled [D])
        for s, offset in zip(rows.sequences, rows.offsets, strict=True):
            if s.pooling is None:
                continue
            part = pooler.reduce(hidden[offset : offset + s.num_new_tokens])  # [D]
            if pooler.mean:
                before = self._pool_sums.get(s.request_id) if s.start > 0 else None
                part = part if before is None else before + part
                sums[s.request_id] = part
            if s.pooling.finish:
                done.append((s, part / s.seq_len if pooler.mean else part))
        self._pool_sums.update(sums)
        if not done:
            return {}
        pooled = torch.stack([p for _, p in done])  # [N, D]
        outputs = pooler.finish(pooled, [s.pooling.params for s, _ in done if s.pooling is not None], hidden.dtype)
        return {s.request_id: vector for (s, _), vector in zip(done, outputs, strict=True)}

    def _decode_run(self, batch: ModelInput) -> RunnerOutput:
        """A decode run (`DecodeRunPath`): `plan.num_steps` decode steps for every sequence in one call, each fed
        the last one's token. Where a row draws, every step takes one uniform number per row, as `Sampler.__call__`
        does (a seeded row's from its own generator), and draws as its kernel does: the tokens single steps would
        give. The slots of every position are in the block tables."""
        seqs, plan, path = batch.sequences, batch.plan, self.run_path
        assert path is not None and path.supports(plan, flatten(seqs)), "a decode run this runner cannot take"
        params = [s.sampling.params for s in seqs if s.sampling is not None]
        draws, states = None, []
        if plan.draws:
            generators = [self._generator(s) for s in seqs]
            # the numbers are taken before the model runs (a single step takes them after): put them back if it fails
            used = [self.sampler.default_generator, *dict.fromkeys(g for g in generators if g is not None)]
            states = [(g, g.get_state()) for g in used]
            draws = (params, [self.sampler.uniforms(generators) for _ in range(plan.num_steps)])
        try:
            with self._adapters(plan, flatten(seqs)):
                runs = path.run(seqs, plan.num_steps, draws)
        except Exception:
            for g, state in states:
                g.set_state(state)
            raise
        out = RunnerOutput(forward_path=path.name)
        for s, tokens in zip(seqs, runs):
            out.sampled[s.request_id] = [(t, None) for t in tokens]
        return out

    def _sample(
        self,
        sampling: list[SequenceInput],
        logits: torch.Tensor | None,
        out: RunnerOutput,
        batch: ModelInput,
        argmax: torch.Tensor | None = None,
    ) -> None:
        """Sample every row (a sequence's last known token, then one row per draft), then keep each sequence's
        drafts while they equal the target's own samples (sampling/drafts.py; spec_decode/ says why that is
        lossless)."""
        params, prompts, outputs, generators, suppressed, mask_rows = [], [], [], [], [], []
        for s in sampling:
            inp = s.sampling
            assert inp is not None
            gen = self._generator(s)
            for j in range(len(inp.draft_token_ids) + 1):  # row j samples after the first j drafts
                params.append(inp.params)
                prompts.append(inp.prompt_token_ids)
                outputs.append(inp.output_token_ids + list(inp.draft_token_ids[:j]) if j else inp.output_token_ids)
                generators.append(gen)
                suppressed.append(inp.suppressed_token_ids[j])
                mask_rows.append(batch.grammar_rows.get(s.request_id, -1) if j == 0 else -1)
        bitmask = None
        if batch.grammar_rows:  # rows of free sequences allow every token
            ones = torch.full((1, batch.grammar_bitmask.shape[1]), -1, dtype=torch.int32)
            bitmask = torch.cat([ones, batch.grammar_bitmask])[torch.tensor(mask_rows) + 1]  # [R, W]
        params_batch = SamplingBatch.build(params, prompts, outputs, generators, suppressed, self.device, bitmask,
                                           batch.plan.logits)  # fmt: skip
        result = self.sampler(logits, params_batch, argmax)
        row = 0
        for s in sampling:
            proposed = s.sampling.draft_token_ids if s.sampling is not None else ()
            kept: list[tuple[int, Logprobs | None]] = []
            for j in range(len(proposed) + 1):
                token, logprobs = result.token_ids[row + j], result.logprobs[row + j]
                if j < len(proposed) and drafts.accepts_draft(token, proposed[j]):
                    kept.append((proposed[j], logprobs))  # the next row was computed after this draft
                    continue
                kept.append((token, logprobs))  # the target's own token ends the run
                break
            out.sampled[s.request_id] = kept
            row += len(proposed) + 1


def _lora_batch(rows: Rows, device: torch.device, slot_of: Callable[[int], int] | None = None) -> LoraBatch:
    """The rows of each adapter the step's sequences take: one slice where they are consecutive, else their indices
    (built per sequence, never per token in Python); with `slot_of` (the CPU kernel's), also each row's slot."""
    spans: dict[int, list[tuple[int, int]]] = {}  # adapter id -> [(first row, end)] in row order
    counts, slots = [], []  # per sequence: its rows, and its adapter's slot (-1: none)
    for s, offset in zip(rows.sequences, rows.offsets, strict=True):
        counts.append(s.num_new_tokens)
        slots.append(slot_of(s.lora_id) if s.lora_id and slot_of is not None else -1)
        if s.lora_id:
            spans.setdefault(s.lora_id, []).append((offset, offset + s.num_new_tokens))
    groups: list[tuple[int, slice | torch.Tensor]] = []
    for adapter_id, ranges in spans.items():
        if all(a == b_prev for (_, b_prev), (a, _) in itertools.pairwise(ranges)):
            groups.append((adapter_id, slice(ranges[0][0], ranges[-1][1])))
        else:
            index = torch.cat([torch.arange(a, b) for a, b in ranges])  # [N] int64
            groups.append((adapter_id, index.to(device)))
    if slot_of is None:
        return LoraBatch(groups)
    row_slots = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64), torch.tensor(counts))  # [T]
    return LoraBatch(groups, row_slots)


def _num_drafts(s: SequenceInput) -> int:
    return len(s.sampling.draft_token_ids) if s.sampling is not None else 0


def _split_drafts(
    sequences: list[SequenceInput],
) -> tuple[list[SequenceInput], dict[int, list[tuple[int, int]]]]:
    """The sequences to run, and for each (by id) its rows that sample: [(j, row within it)], j = 0 being the last
    known token and j > 0 the drafts. A decode with k drafts runs as k + 1 one-token sequences over the same
    blocks (row j at position start + j, its context ending there): verification is then a plain decode step,
    in one batched attention call and, for a Llama-shaped model, the decode stack. Every row's keys and values
    are written before any row attends, so row j sees the drafts before it."""
    runs: list[SequenceInput] = []
    rows_of: dict[int, list[tuple[int, int]]] = {}
    for s in sequences:
        k = _num_drafts(s)
        if k and s.num_new_tokens == k + 1:
            for j, token in enumerate(s.token_ids):
                run = SequenceInput(s.request_id, [token], s.start + j, s.block_table, s.max_num_tokens, None,
                                    lora_id=s.lora_id, rope_long_below=s.rope_long_below)  # fmt: skip
                runs.append(run)
                rows_of[id(run)] = [(j, 0)]
        else:
            runs.append(s)
            if s.sampling is not None:
                rows_of[id(s)] = [(j, s.num_new_tokens - 1 - k + j) for j in range(k + 1)]
    return runs, rows_of
