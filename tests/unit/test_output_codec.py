"""The engine's outputs sent between processes as what each adds (engine/output_codec.py): rebuilt equal to the
engine's own, across pickling, whatever each step adds or (never seen, but allowed) takes back."""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterator
from dataclasses import replace

import pytest

from tokenmill.engine.output_codec import OutputDecoder, OutputEncoder
from tokenmill.outputs import CompletionOutput, PoolingOutput, RequestMetrics, RequestOutput


def _outputs(rng: random.Random, n: int, steps: int, logprobs: bool) -> Iterator[RequestOutput]:
    """A request's cumulative outputs over `steps`, as the engine makes them (fresh lists each time, one live
    metrics object), with texts and tokens that now and then lose their tail."""
    metrics = RequestMetrics(arrival_time=1.0, num_prompt_tokens=3)
    texts, tokens, lps = [""] * n, [[] for _ in range(n)], [[] for _ in range(n)]
    for step in range(steps):
        for i in range(n):
            if step and rng.random() < 0.15:  # taken back
                cut = rng.randrange(len(tokens[i]) + 1)
                del tokens[i][cut:], lps[i][cut:]
                texts[i] = texts[i][: rng.randrange(len(texts[i]) + 1)]
            for _ in range(rng.randrange(0, 4)):
                t = rng.randrange(1000)
                tokens[i].append(t)
                lps[i].append({t: -rng.random(), t + 1: -2.0})
                texts[i] += rng.choice(["a", "é", " b", "日本", ""])
                metrics.token_times.append(float(step))
        metrics.num_generated_tokens = len(tokens[0])
        metrics.first_token_time = 2.0 if tokens[0] else None
        last = step == steps - 1
        completions = [CompletionOutput(i, texts[i], list(tokens[i]), -1.5 * step if logprobs else None,
                                        list(lps[i]) if logprobs else None, "length" if last else None)
                       for i in range(n)]  # fmt: skip
        yield RequestOutput("r", "the prompt", [1, 2, 3], completions, last, [None, {2: -0.5}] if logprobs else None,
                            metrics, [f"d{step}"] * n)  # fmt: skip


def _expected(out: RequestOutput) -> RequestOutput:
    """`out` as it stood when it was made (its metrics' token times then)."""
    assert out.metrics is not None
    return replace(out, metrics=replace(out.metrics, token_times=list(out.metrics.token_times)))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("logprobs", [False, True])
def test_outputs_rebuild_equal_across_processes(seed: int, logprobs: bool) -> None:
    rng = random.Random(seed)
    encoder, decoder = OutputEncoder(), OutputDecoder("r", "the prompt", [1, 2, 3])
    sizes, whole = [], 0
    for out in _outputs(rng, n=rng.choice([1, 3]), steps=25, logprobs=logprobs):
        assert out.metrics is not None
        times = len(out.metrics.token_times)
        out_then = _expected(out)
        wire = pickle.dumps(encoder.encode(out))
        sizes.append(len(wire))
        whole = len(pickle.dumps(out))
        got = decoder.decode(pickle.loads(wire))
        assert got == out_then
        assert got.metrics is not None and len(got.metrics.token_times) == times
    # what each step adds travels, not the whole: the last message is far smaller than the output it rebuilds
    assert sizes[-1] < whole / 2


def test_a_pooling_output_and_an_error_travel() -> None:
    encoder, decoder = OutputEncoder(), OutputDecoder("p", None, [5, 6])
    pooled = RequestOutput("p", None, [5, 6], [], True, metrics=RequestMetrics(arrival_time=0.0),
                           pooled=PoolingOutput([0.25, -1.0]))  # fmt: skip
    assert decoder.decode(pickle.loads(pickle.dumps(encoder.encode(pooled)))) == pooled
    encoder, decoder = OutputEncoder(), OutputDecoder("e", None, [5])
    failed = RequestOutput("e", None, [5], [CompletionOutput(0, "", [], finish_reason="error")], True,
                           error="boom")  # fmt: skip
    assert decoder.decode(pickle.loads(pickle.dumps(encoder.encode(failed)))) == failed
