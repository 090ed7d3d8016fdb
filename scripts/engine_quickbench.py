"""Quick engine measurements until `tokenmill bench` exists: continuous vs static batching throughput, and
the TTFT of a request that shares a long prefix, with prefix caching on vs off.

    python scripts/engine_quickbench.py MODEL [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import random
import time

from tokenmill import LLM, SamplingParams


def throughput(model: str, dtype: str, batching: str, num_prompts: int, max_num_seqs: int) -> dict[str, float]:
    llm = LLM(model, dtype=dtype, batching=batching, max_num_seqs=max_num_seqs)
    rng = random.Random(0)
    vocab = llm.loaded.config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randrange(16, 128))]}
               for _ in range(num_prompts)]  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(8, 64), ignore_eos=True) for _ in prompts]
    llm.generate(prompts[:2], params[:2])  # warm up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": elapsed, "output_tok_s": generated / elapsed, "mean_batch": llm.engine.stats.mean_batch_size}


def prefix_ttft(model: str, dtype: str, caching: bool, prefix_len: int) -> float:
    llm = LLM(model, dtype=dtype, enable_prefix_caching=caching)
    rng = random.Random(1)
    vocab = llm.loaded.config.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prefix + [1, 2, 3]}], params)  # fills the cache (when on)
    out = llm.generate([{"prompt_token_ids": prefix + [4, 5, 6, 7]}], params)[0]
    assert out.metrics is not None and out.metrics.ttft_ms is not None
    return out.metrics.ttft_ms


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1024)
    a = p.parse_args()
    for batching in ("continuous", "static"):
        r = throughput(a.model, a.dtype, batching, a.num_prompts, a.max_num_seqs)
        print(f"{batching:10s}: {r['seconds']:.1f} s, {r['output_tok_s']:.1f} output tok/s, "
              f"mean batch {r['mean_batch']:.1f}")  # fmt: skip
    for caching in (True, False):
        ttft = prefix_ttft(a.model, a.dtype, caching, a.prefix_len)
        print(f"prefix caching {'on ' if caching else 'off'}: TTFT {ttft:.0f} ms ({a.prefix_len}-token shared prefix)")


if __name__ == "__main__":
    main()
