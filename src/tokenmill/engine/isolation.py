"""A step's failure kept to the request that caused it: when the batched step raises, each sequence runs alone, and
only the ones that fail alone fail (engine/core.py ends them with their error; the others' outputs stand)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from tokenmill.runner import ModelRunner
from tokenmill.types import ModelInput, RunnerOutput, SchedulerOutput

log = logging.getLogger("tokenmill.engine")


def execute_isolated(
    runner: ModelRunner, so: SchedulerOutput, model_input: Callable[[SchedulerOutput], ModelInput]
) -> tuple[RunnerOutput, dict[str, str]]:
    """Run the step. If it raises, run each sequence alone, so a failure one request causes fails that request
    only: (merged output of the others, {failed sequence id: error})."""
    try:
        return runner.execute(model_input(so)), {}
    except Exception as e:
        log.warning("a step of %d sequences failed (%r); running them one by one", len(so.scheduled), e)
    merged, failed = RunnerOutput(), {}
    for s in so.scheduled:
        try:
            result = runner.execute(model_input(replace(so, scheduled=[s])))
        except Exception as e:
            log.exception("request %s failed inside the engine", s.request_id)
            failed[s.request_id] = f"{type(e).__name__}: {e}"
            continue
        merged.sampled.update(result.sampled)
        merged.prompt_logprobs.update(result.prompt_logprobs)
        merged.forward_path = result.forward_path
    return merged, failed
