"""One step plan: what a step computes and what its sampling reads is decided by `step_plan.plan_step` alone, from
the batch and its sampling settings, and the runner picks its forward path by that plan with one rule."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import pytest

from tokenmill import LLM
from tokenmill.cuda_graphs import DecodeGraphs
from tokenmill.forward import flatten
from tokenmill.sampling_params import SamplingParams as SP
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.step_plan import model_input, plan_step, row_reads
from tokenmill.types import LogitsRead, PromptLogprobsInput, SamplingInput, SequenceInput

# Every sampling parameter is either read by the rule (it changes what sampling reads of the logits) or does not
# touch the logits. A new parameter fails here until it is placed: a logit modifier the rule does not know would be
# silently skipped by the paths that hand sampling less than the float32 logits.
READ_BY_THE_RULE = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "logprobs", "logit_bias", "structured_outputs", "min_tokens",
                    "stop_token_ids", "ignore_eos",
                    "thinking"}  # fmt: skip  # (a spent budget forces a token: the row is constrained, engine/core.py)
NOT_LOGITS = {"n", "seed", "max_tokens", "stop", "prompt_logprobs", "skip_special_tokens",
              "include_stop_str_in_output"}  # fmt: skip


def _seq(rid: str, params: SP | None, new: int = 1, drafts: tuple[int, ...] = (), suppressed: list[int] = (),  # type: ignore[assignment]
         prompt_logprobs: bool = False) -> SequenceInput:  # fmt: skip
    sampling = None
    if params is not None:
        sampling = SamplingInput(params, None, [1, 2], [3], [list(suppressed)] * (len(drafts) + 1), drafts)
    plp = PromptLogprobsInput(0, 1, 1, [5]) if prompt_logprobs else None
    return SequenceInput(rid, [7] * (new + len(drafts)), 3, [0], 64, sampling, plp)


def test_every_sampling_parameter_is_placed() -> None:
    assert {f.name for f in fields(SP)} == READ_BY_THE_RULE | NOT_LOGITS


@pytest.mark.parametrize(
    ("params", "suppressed", "constrained", "reads"),
    [(SP(temperature=0), [], False, LogitsRead.ARGMAX), (SP(temperature=0, top_k=5, top_p=0.5), [], False,
      LogitsRead.ARGMAX), (SP(temperature=0.8, top_k=5, min_p=0.1), [], False, LogitsRead.DRAW),
     (SP(temperature=0, logprobs=0), [], False, LogitsRead.FULL), (SP(logit_bias={3: 1.0}), [], False, LogitsRead.FULL),
     (SP(repetition_penalty=1.2), [], False, LogitsRead.FULL), (SP(presence_penalty=1.0), [], False, LogitsRead.FULL),
     (SP(frequency_penalty=1.0), [], False, LogitsRead.FULL), (SP(temperature=0), [2], False, LogitsRead.FULL),
     (SP(temperature=0), [], True, LogitsRead.FULL)],
)  # fmt: skip
def test_what_one_row_reads(params: SP, suppressed: list[int], constrained: bool, reads: LogitsRead) -> None:
    assert row_reads(params, suppressed, constrained) == reads


def test_a_step_reads_the_most_any_row_reads() -> None:
    greedy, drawn = SP(temperature=0), SP(temperature=0.7)
    plan = plan_step([_seq("a", greedy), _seq("b", greedy)], ())
    assert (plan.logits, plan.draws, plan.decode_only, plan.drafts, plan.num_steps) == (
        LogitsRead.ARGMAX, False, True, False, 1)  # fmt: skip
    plan = plan_step([_seq("a", greedy), _seq("b", drawn)], (), num_steps=4)
    assert (plan.logits, plan.draws, plan.num_steps) == (LogitsRead.DRAW, True, 4)
    assert plan_step([_seq("a", drawn), _seq("b", greedy)], {"b"}).logits == LogitsRead.FULL  # b's grammar
    assert plan_step([_seq("a", greedy, suppressed=[1])], ()).logits == LogitsRead.FULL  # min_tokens


def test_drafts_chunks_and_prompt_logprobs_shape_the_plan() -> None:
    greedy = SP(temperature=0)
    plan = plan_step([_seq("a", greedy, drafts=(4, 5)), _seq("b", greedy)], ())
    assert plan.drafts and plan.decode_only and plan.logits == LogitsRead.FULL  # each draft row is one token
    plan = plan_step([_seq("a", None, new=5), _seq("b", greedy)], ())  # a prompt's chunk that samples nothing
    assert not plan.decode_only and plan.logits == LogitsRead.FULL
    plan = plan_step([_seq("a", greedy, prompt_logprobs=True)], ())
    assert plan.prompt_logprobs and plan.decode_only


def test_the_runner_takes_the_first_path_that_supports_the_plan(make_checkpoint: Callable[..., Path]) -> None:
    """With the CPU kernels a Llama-shaped model's decode-only steps take the decode stack and every other step
    the modules; CUDA graph buckets (run eagerly on a CPU) take decode-only steps that read no hidden state."""
    llm = LLM(str(make_checkpoint("llama")), dtype="float32", block_size=8)
    runner = llm.engine.runner
    if runner.decode_stack is None:
        pytest.skip("no CPU kernels here: every step runs on the modules")
    greedy = SP(temperature=0)
    decode = model_input([_seq("a", greedy), _seq("b", greedy)])
    prefill = model_input([_seq("a", greedy, new=6)])
    with_prompt_logprobs = model_input([_seq("a", greedy, prompt_logprobs=True)])

    def path(batch: object) -> str:
        return runner.path_for(batch.plan, flatten(batch.sequences)).name  # type: ignore[attr-defined]

    assert [p.name for p in runner.paths] == ["decode_stack", "decode_stack_metadata", "modules"]
    assert (path(decode), path(prefill), path(with_prompt_logprobs)) == ("decode_stack", "modules", "decode_stack")
    assert runner.runs_decode_steps
    runner.decode_stack = None
    assert path(decode) == "modules" and not runner.runs_decode_steps

    # the pure-torch path's pool has the spare block that graphs' padded rows write to
    eager = LLM(str(make_checkpoint("llama")), dtype="float32", block_size=8, cpu_kernels=False)
    runner = eager.engine.runner
    runner.graphs = DecodeGraphs(eager.loaded.model, runner.kv, 4, 64, record=False)
    assert [p.name for p in runner.paths] == ["cuda_graphs", "modules"]
    assert (path(decode), path(with_prompt_logprobs), path(prefill)) == ("cuda_graphs", "modules", "modules")
    assert not runner.runs_decode_steps  # a run samples inside the decode stack


def test_structured_outputs_field_is_the_grammar() -> None:
    """`structured_outputs` reaches the rule as `constrained` (the core's grammar rows): a constrained row reads
    float32 logits whatever its other settings."""
    params = SP(temperature=0, structured_outputs=StructuredOutputsParams(regex="a+"))
    batch = model_input([_seq("a", params)], grammar_bitmask=object(), grammar_rows={"a": 0})
    assert batch.plan.logits == LogitsRead.FULL
