"""Draft-model proposer: a smaller model with the target's tokenizer guesses the next k tokens, greedily.

The draft keeps its own paged KV pool and KV manager (its layers and heads differ from the target's) and its
own runner. Per request it remembers the tokens whose keys are in its cache (`cached_token_ids`). Each round it:
1. keeps the longest prefix of `cached_token_ids` that the request still has (rejected drafts fall away; their slots are
   simply overwritten), and computes the rest of the request's tokens, sampling draft 1;
2. feeds each draft back to get the next one, k - 1 more one-token steps, batched over the requests.
Where the draft runs on the decode stack, both are one native call (`DecodeStack.greedy_drafts`; a prompt's catch-up
is a prefill on the runner first); elsewhere each is a runner step.
Drafting greedily makes the proposal deterministic, so the runner's rule (keep a draft while it equals the
target's own sample) stays lossless (spec_decode/__init__.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from tokenmill.errors import TokenmillError
from tokenmill.kv_cache import KVManager
from tokenmill.runner import ModelRunner
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.request import DraftRequest
from tokenmill.step_plan import model_input
from tokenmill.types import SamplingInput, SequenceInput

if TYPE_CHECKING:
    from tokenmill.assembly.model import LoadedModel
    from tokenmill.config import EngineConfig

GREEDY = SamplingParams(temperature=0.0)
SPLIT_MAX = 16  # catch-ups of up to this many tokens run as one-token rows (a decode step), longer as a prefill


@dataclass
class _State:
    cached_token_ids: list[int] = field(default_factory=list)  # tokens whose keys and values are in the draft's cache


class DraftProposer:
    def __init__(self, runner: ModelRunner, kv: KVManager, num_tokens: int, max_num_tokens: int, vocab: int) -> None:
        self.runner, self.kv = runner, kv
        self.num_tokens, self.max_num_tokens = num_tokens, max_num_tokens  # drafts per round, the draft's context
        self.vocab = vocab  # the draft's embedding rows: a target padded wider can give tokens past them
        self._states: dict[str, _State] = {}

    def release(self, request_id: str) -> None:
        if self._states.pop(request_id, None) is not None:
            self.kv.free(request_id)
            self.runner.release(request_id)

    def propose_batch(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        """Greedy drafts for each request (none where the draft's pool is full)."""
        drafts: dict[str, list[int]] = {r.request_id: [] for r in requests}
        # the draft's own context bounds what it can draft for
        want = {r.request_id: min(self.num_tokens, r.limit, self.max_num_tokens - len(r.token_ids)) for r in requests}
        stack = self.runner.decode_stack
        native = stack is not None and stack.greedy_ready
        steps: list[SequenceInput] = []  # the runner's: prompts (and every catch-up without the native path)
        feeds: dict[str, tuple[list[int], int]] = {}  # the native path's catch-ups: (tokens, first position)
        for r in requests:
            rid = r.request_id
            caught = self._catch_up(r, want[rid]) if want[rid] > 0 else None
            if caught is None:
                continue
            keep, new = caught
            if native and len(new) <= SPLIT_MAX:
                feeds[rid] = (new, keep)
            elif len(new) > SPLIT_MAX:  # a prompt: one prefill
                steps.append(self._input(rid, new, keep))
            else:  # a few tokens go as one-token rows, so the round is a decode step
                steps += [self._input(rid, [t], keep + j, sample=j == len(new) - 1) for j, t in enumerate(new)]
        if steps:
            for rid, out in self.runner.compute(model_input(steps)).sampled.items():
                drafts[rid].append(out[0][0])
        if native and stack is not None:  # every other round, and the catch-ups, in one native call
            for rid in drafts:
                if len(drafts[rid]) == 1 and want[rid] > 1:  # after a prefill: feed draft 1 back
                    feeds[rid] = ([drafts[rid][0]], len(self._states[rid].cached_token_ids))
            if feeds:
                rids = list(feeds)
                rounds = [want[rid] - len(drafts[rid]) for rid in rids]
                tables = [self.kv.block_table(rid) for rid in rids]
                rest = stack.greedy_drafts(
                    [feeds[rid][0] for rid in rids], [feeds[rid][1] for rid in rids], tables, rounds
                )
                for rid, tokens in zip(rids, rest):
                    drafts[rid] += tokens
            for rid, d in drafts.items():
                if rid in self._states:
                    self._states[rid].cached_token_ids += d[:-1]  # the last draft is not fed back
            return drafts
        more = [self._feed(rid, d[0]) for rid, d in drafts.items() if d and want[rid] > 1]
        while more:  # one batched draft forward per draft position
            next_steps = []
            for rid, out in self.runner.compute(model_input(more)).sampled.items():
                drafts[rid].append(out[0][0])
                if len(drafts[rid]) < want[rid]:
                    next_steps.append(self._feed(rid, out[0][0]))
            more = next_steps
        return drafts

    def _catch_up(self, r: DraftRequest, want: int) -> tuple[int, list[int]] | None:
        """(keep, new): the draft's cache keeps the first `keep` tokens of the request, and `new` are the ones it
        has not computed; the last of them samples draft 1. None when the draft's pool is full."""
        state = self._states.setdefault(r.request_id, _State())
        keep = 0
        for a, b in zip(state.cached_token_ids, r.token_ids):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(r.token_ids) - 1)  # at least the newest token is computed: its logits give draft 1
        if max(r.token_ids[keep:]) >= self.vocab:  # a token the draft has no embedding for: no drafts for this one
            self.release(r.request_id)
            return None
        if not self.kv.allocate_slots(r.request_id, r.token_ids, keep, len(r.token_ids) - keep,
                                      num_lookahead_tokens=want - 1):  # fmt: skip
            self.release(r.request_id)  # the draft's pool is full: no drafts for this one
            return None
        state.cached_token_ids = list(r.token_ids)
        return keep, r.token_ids[keep:]

    def _feed(self, request_id: str, token: int) -> SequenceInput:
        state = self._states[request_id]
        start = len(state.cached_token_ids)
        state.cached_token_ids.append(token)
        return self._input(request_id, [token], start)

    def _input(self, request_id: str, token_ids: list[int], start: int, sample: bool = True) -> SequenceInput:
        sampling = SamplingInput(GREEDY, None, [], [], [[]]) if sample else None
        return SequenceInput(request_id, token_ids, start, self.kv.block_table(request_id), self.max_num_tokens,
                             sampling)  # fmt: skip


def build_draft_proposer(target: LoadedModel, cfg: EngineConfig, max_len: int) -> DraftProposer:
    """A draft model (`cfg.speculative_model`) with the target's tokenizer, its own paged KV pool sized for the
    sequences that draft (`speculative_disable_by_batch_size`), and its own runner."""
    from tokenmill.assembly import build_parts
    from tokenmill.assembly.model import DEMO_DRAFT, load

    ref = str(DEMO_DRAFT) if cfg.speculative_model == "demo-draft" else cfg.speculative_model
    draft_cfg = replace(cfg, model=ref, task="generate", speculative_model=None,
                        quantization=cfg.speculative_model_quantization, max_model_len=None, kv_cache="paged",
                        num_kv_blocks=None, kv_cache_memory_gb=None, touch_kv_cache=False,
                        max_num_seqs=cfg.speculative_disable_by_batch_size, enable_prefix_caching=False,
                        enforce_eager=True)  # fmt: skip
    try:
        draft = load(draft_cfg)
    except TokenmillError as e:  # (the message named a model, not the flag that gave it)
        raise type(e)(f"speculative_model={cfg.speculative_model!r}: {e}") from None
    max_len = min(max_len, draft.max_model_len)  # a draft with a shorter context drafts for shorter sequences
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(f"speculative_model={cfg.speculative_model!r} has another tokenizer than the model; "
                         "a draft model must share the target's vocabulary")  # fmt: skip
    # the pool holds every sequence that drafts at full length (max_model_len given: plan_num_blocks)
    parts = build_parts(draft, replace(draft_cfg, max_model_len=max_len), max_len)
    return DraftProposer(parts.runner, parts.kv, cfg.num_speculative_tokens, max_len, draft.config.vocab_size)
