"""Pooling requests in the engine: they share steps with generating sequences without changing their tokens, survive
preemption (a mean-pooled prompt recomputed from its start), end with their blocks freed, and are refused with a
message where they can never run. The model serves both (`task="generate,embed"`), mean pooling (every row read)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests import target
from tests.pooling_checkpoints import hf_hidden, sentence_transformers
from tokenmill import LLM, PoolingParams, SamplingParams
from tokenmill.engine.core import EngineCore
from tokenmill.outputs import RequestOutput
from tokenmill.types import EngineRequest

TOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = make_checkpoint("llama", initializer_range=0.1)
    return sentence_transformers(source, tmp_path_factory.mktemp("mean") / "llama", "mean")


@pytest.fixture(scope="module")
def hf(folder: Path) -> object:
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()


def _add(core: EngineCore, ids: list[int], pooling: PoolingParams | None = None) -> str:
    rid = core.new_request_id()
    if pooling is not None:
        core.validate_pooling(ids, pooling)
        core.add_request(EngineRequest(rid, ids, SamplingParams(max_tokens=None), 0, time.perf_counter(),
                                       pooling=pooling))  # fmt: skip
    else:
        core.add_request(EngineRequest(rid, ids, GREEDY, core.validate(ids, GREEDY)))
    return rid


def _run(core: EngineCore) -> dict[str, RequestOutput]:
    finals = {}
    while core.has_unfinished():
        finals.update({o.request_id: o for o in core.step() if o.finished})
    return finals


def _mean_ref(hf: object, ids: list[int]) -> torch.Tensor:
    return F.normalize(hf_hidden(hf, ids).mean(0), dim=-1)


def test_a_pooling_request_shares_a_step_with_generation_and_changes_none_of_its_tokens(
    folder: Path, hf: object
) -> None:
    llm = LLM(str(folder), device=target.DEVICE, dtype="float32", task="generate,embed")
    core, tok = llm.engine, llm.tokenizer
    prompt, text = tok.encode("ROMEO: Hello world"), tok.encode("To be, or not to be, that is the question.")
    alone = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0].outputs[0].token_ids
    gen, pooled = _add(core, prompt), _add(core, text, PoolingParams())
    first = {o.request_id: o for o in core.step()}
    assert first[pooled].finished and first[pooled].pooled is not None  # computed in the first step ...
    assert len(first[gen].outputs[0].token_ids) == 1  # ... beside the generating prompt
    assert (torch.tensor(first[pooled].pooled.data) - _mean_ref(hf, text)).abs().max() < TOL
    finals = _run(core)
    assert finals[gen].outputs[0].token_ids == alone
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_a_one_token_pooled_prompt_in_a_decode_step_is_the_final_norms_output(folder: Path, hf: object) -> None:
    """A one-token prompt beside decoding sequences makes a decode-only step (the decode stack's, where it runs)."""
    llm = LLM(str(folder), device=target.DEVICE, dtype="float32", task="generate,embed")
    core = llm.engine
    gen = _add(core, llm.tokenizer.encode("ROMEO: Hello world"))
    core.step()  # its prompt: from now on it decodes
    one = [llm.tokenizer.encode("a")[0]]
    pooled = _add(core, one, PoolingParams())
    out = {o.request_id: o for o in core.step()}
    assert out[pooled].pooled is not None and len(out[gen].outputs[0].token_ids) == 2
    assert (torch.tensor(out[pooled].pooled.data) - _mean_ref(hf, one)).abs().max() < TOL
    _run(core)


def test_a_preempted_mean_pooled_prompt_is_recomputed_from_its_start(folder: Path, hf: object) -> None:
    """Six blocks of four tokens: a generating sequence and a 24-token prompt chunked 8 tokens a step cannot both
    hold theirs, so the pooled prompt (the newest) is preempted and later pooled from its first token again."""
    llm = LLM(str(folder), device=target.DEVICE, dtype="float32", task="generate,embed", block_size=4, num_kv_blocks=6,
              max_num_batched_tokens=8)  # fmt: skip
    core, tok = llm.engine, llm.tokenizer
    text = tok.encode("Shall I compare thee to a summer's day? Thou art more lovely and more temperate.")[:24]
    assert len(text) == 24
    gen, pooled = _add(core, tok.encode("ROMEO:")[:4]), _add(core, text, PoolingParams())
    finals = _run(core)
    assert core.scheduler.num_preemptions > 0
    assert finals[pooled].pooled is not None and len(finals[gen].outputs[0].token_ids) == GREEDY.max_tokens
    assert (torch.tensor(finals[pooled].pooled.data) - _mean_ref(hf, text)).abs().max() < TOL
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_an_aborted_pooling_request_ends_without_a_result_and_frees_its_blocks(folder: Path) -> None:
    llm = LLM(str(folder), device=target.DEVICE, dtype="float32", task="generate,embed", max_num_batched_tokens=8)
    core = llm.engine
    rid = _add(core, llm.tokenizer.encode("To be, or not to be, that is the question."), PoolingParams())
    core.step()  # its first chunk
    final = core.abort(rid)
    assert final is not None and final.finished and final.pooled is None
    assert not core.has_unfinished() and core.kv.num_free_blocks == core.kv.num_blocks


def test_requests_a_model_cannot_serve_are_refused_with_what_to_do(folder: Path) -> None:
    embedder = LLM(
        str(folder), device=target.DEVICE, dtype="float32", max_model_len=32
    )  # auto: sentence-transformers files -> embed
    core = embedder.engine
    with pytest.raises(ValueError, match="does not generate.*--task generate"):
        core.validate([1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="not score.*--task score"):
        core.validate_pooling([1, 2, 3], PoolingParams(task="score"))
    cases = {
        "empty": ([], PoolingParams()),
        "maximum context length is 32": (list(range(1, 34)), PoolingParams()),
        "dimensions=65 is invalid": ([1, 2], PoolingParams(dimensions=65)),
        "out of range": ([10**6], PoolingParams()),
    }
    for message, (ids, params) in cases.items():
        with pytest.raises(ValueError, match=message):
            core.validate_pooling(ids, params)
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)
    generator = LLM(str(folder), device=target.DEVICE, dtype="float32", task="generate")
    with pytest.raises(ValueError, match="not embed.*--task embed"):
        generator.embed(["Hello"])
