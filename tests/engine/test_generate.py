"""The offline `LLM` API end to end on a tiny checkpoint: batching, baselines, stops, n, seeds, logprobs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests import target
from tokenmill import LLM, SamplingParams

PROMPTS = ["Hello world!", "To be, or not to be", "The quick brown fox jumps over", "café 日本語"]


@pytest.fixture(scope="module")
def folder(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("qwen2", initializer_range=0.1)


@pytest.fixture(scope="module")
def llm(folder: Path) -> LLM:
    return LLM(str(folder), dtype="float32", device=target.DEVICE)


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def assert_pool_full(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv is not None
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_batch_equals_each_prompt_alone(llm: LLM) -> None:
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    alone = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone
    assert len({tuple(t) for t in together}) > 1  # the prompts really differ


def test_recompute_baseline_equals_kv_cache(folder: Path, llm: LLM) -> None:
    no_cache = LLM(str(folder), dtype="float32", device=target.DEVICE, kv_cache="none")
    assert [o.outputs[0].token_ids for o in no_cache.generate(PROMPTS, GREEDY)] == [
        o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)
    ]


def test_outputs_shape_text_and_token_prompts(llm: LLM) -> None:
    out = llm.generate(["Hello world!"], SamplingParams(temperature=0, max_tokens=8, logprobs=3))[0]
    ids = llm.tokenizer.encode("Hello world!")
    assert out.prompt_token_ids == ids and out.finished
    c = out.outputs[0]
    assert len(c.token_ids) <= 8 and c.finish_reason in ("stop", "length")
    assert c.text == llm.tokenizer.decode(c.token_ids)
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert tok in entry and 3 <= len(entry) <= 4
        assert entry[tok] == max(entry.values())  # greedy picks the most likely raw token
    by_ids = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=8))[0]
    assert by_ids.outputs[0].token_ids == c.token_ids


def test_max_tokens_and_length_finish(llm: LLM) -> None:
    c = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert len(c.token_ids) == 5 and c.finish_reason == "length"


def test_stop_token_ids_and_eos(llm: LLM) -> None:
    free = llm.generate("Hello", GREEDY)[0].outputs[0].token_ids
    stop_at = free[3]
    c = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at]))[0].outputs[0]
    assert c.token_ids == free[: free.index(stop_at) + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_at
    # min_tokens suppresses the stop token until enough tokens exist
    first = free.index(stop_at)
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at], min_tokens=first + 2)
    c2 = llm.generate("Hello", params)[0].outputs[0]
    assert stop_at not in c2.token_ids[: first + 2]


def test_stop_strings_truncate_text(llm: LLM) -> None:
    free = llm.generate("Hello", GREEDY)[0].outputs[0].text
    stop = free[4:6]
    assert stop and stop in free
    c = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))[0]
    out = c.outputs[0]
    assert out.text == free[: free.index(stop)] and out.finish_reason == "stop" and out.stop_reason == stop


def test_seeds_reproduce_and_n_samples(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, n=3, ignore_eos=True)
    a = [c.token_ids for c in llm.generate("Hello", params)[0].outputs]
    b = [c.token_ids for c in llm.generate(["Hello", "noise"], params)[0].outputs]
    assert a == b and len(a) == 3
    assert len({tuple(x) for x in a}) > 1  # the n samples are different draws
    other = llm.generate("Hello", SamplingParams(temperature=1.0, max_tokens=12, seed=99, ignore_eos=True))
    assert other[0].outputs[0].token_ids != a[0]


def test_chat_applies_template(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=4))[0]
    expected = llm.tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False)
    assert out.prompt_token_ids == expected


def test_bad_requests_raise_and_leave_nothing_running(llm: LLM) -> None:
    with pytest.raises(ValueError, match="maximum context length is 512 tokens"):
        llm.generate("Hello", SamplingParams(max_tokens=600))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([{"prompt_token_ids": [1, 10**6]}], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    assert not llm.engine.has_unfinished()
    assert_pool_full(llm)


def test_streaming_deltas_add_up(llm: LLM) -> None:
    deltas, final = [], None
    for out in llm.stream("Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)):
        deltas.append(out.new_text[0])
        final = out
    assert final is not None and "".join(deltas) == final.outputs[0].text
    assert final.metrics is not None and final.metrics.ttft_ms is not None and final.metrics.ttft_ms > 0
    assert_pool_full(llm)


def test_generation_config_supplies_defaults_and_eos(folder: Path, tmp_path: Path) -> None:
    import json
    import shutil

    copy = Path(shutil.copytree(folder, tmp_path / "ckpt"))
    base = LLM(str(copy), dtype="float32", device=target.DEVICE)
    free = base.generate("Hello", GREEDY)[0].outputs[0].token_ids
    extra_eos = free[2]
    gen = json.loads((copy / "generation_config.json").read_text())
    gen.update(eos_token_id=[gen["eos_token_id"], extra_eos], temperature=0.7, top_p=0.9, top_k=20)
    (copy / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(copy), dtype="float32", device=target.DEVICE)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.7, 0.9, 20)
    c = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert c.token_ids == free[: free.index(extra_eos) + 1] and c.finish_reason == "stop"
    ignored = llm.generate("Hello", GREEDY)[0].outputs[0]
    assert ignored.token_ids == free  # ignore_eos keeps going
