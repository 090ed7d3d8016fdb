"""The runner's view of one scheduled request: a `SequenceInput` read from the `Request` (which only the core
writes) and the scheduler's decision for it."""

from __future__ import annotations

from tokenmill.types import PoolingInput, PromptLogprobsInput, Request, SamplingInput, ScheduledRequest, SequenceInput


def sequence_input(req: Request, s: ScheduledRequest) -> SequenceInput:
    """What the runner computes of `req` this step: its known tokens the scheduler chose (and drafts), the sampling
    inputs where the step reaches its last known token (a pooling request's: its pooling), and the prompt positions to
    score."""
    drafts = list(s.spec_token_ids)
    start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens - len(drafts)  # known tokens
    sampling, pooling = None, None
    if req.pooling is not None:
        pooling = PoolingInput(req.pooling, finish=end == req.num_tokens)
    elif end == req.num_tokens:
        num_out, min_tokens = len(req.output_token_ids), req.params.min_tokens
        stop = req.stop_ids_active() if num_out < min_tokens else []
        suppressed = [stop if num_out + j < min_tokens else [] for j in range(len(drafts) + 1)]
        sampling = SamplingInput(req.params, req.seed, req.prompt_token_ids, req.output_token_ids, suppressed,
                                 tuple(drafts))  # fmt: skip
    prompt_logprobs = None
    if req.prompt_logprobs is not None:
        # position p scores prompt token p+1; skip positions already scored (recompute mode)
        first = max(start, len(req.prompt_logprobs) - 1)
        num = min(end, req.num_prompt_tokens - 1) - first
        if num > 0:
            targets = req.prompt_token_ids[first + 1 : first + 1 + num]
            prompt_logprobs = PromptLogprobsInput(first, num, req.params.prompt_logprobs or 0, targets)
    return SequenceInput(
        request_id=req.request_id,
        token_ids=req.token_ids_between(start, end) + drafts,
        start=start,
        block_table=s.block_table,
        max_num_tokens=req.num_prompt_tokens + req.max_tokens,
        sampling=sampling,
        prompt_logprobs=prompt_logprobs,
        pooling=pooling,
        lora_id=req.lora_id,
        rope_long_below=req.rope_long_below,
    )
