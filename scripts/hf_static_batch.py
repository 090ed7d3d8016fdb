"""transformers' own batched generation, the baselines of docs/benchmarks.md's GPU section (issue 63's 64-stream
target: the better of the two): N prompts of L random tokens, L new tokens each (greedy, no early stop), bf16.

    python scripts/hf_static_batch.py /tmp/q05 --batch 64 --len 128                        # generate, a static batch
    python scripts/hf_static_batch.py /tmp/q05 --batch 64 --len 128 --continuous-batching  # generate_batch

Each mode runs once on a few prompts to warm up, then once timed. `generate_batch` (transformers' continuous
batching, what `transformers serve --continuous-batching` runs) builds its manager and captures its graphs inside
each call, so its timed call includes that setup; the tokens counted are the ones it returned.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def static_batch(model: Any, ids: torch.Tensor, n: int, device: str) -> tuple[int, float]:
    mask = torch.ones_like(ids)
    model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=8, min_new_tokens=8, do_sample=False)
    _sync(device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    _sync(device)
    return (out.shape[1] - ids.shape[1]) * ids.shape[0], time.perf_counter() - start


def continuous_batching(model: Any, ids: torch.Tensor, n: int, device: str) -> tuple[int, float]:
    prompts = ids.tolist()
    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate_batch(inputs=prompts[:2], generation_config=GenerationConfig(max_new_tokens=8, do_sample=False,
                         eos_token_id=None, pad_token_id=0))  # fmt: skip
    _sync(device)
    start = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=config)
    _sync(device)
    return sum(len(o.generated_tokens) for o in out.values()), time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--len", type=int, default=128, help="prompt tokens, and new tokens")
    p.add_argument("--device", default="cuda")
    p.add_argument("--continuous-batching", action="store_true", help="generate_batch instead of generate")
    args = p.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(args.device).eval()
    rng = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size, (args.batch, args.len), generator=rng).to(args.device)
    with torch.no_grad():
        run = continuous_batching if args.continuous_batching else static_batch
        tokens, elapsed = run(model, ids, args.len, args.device)
    mode = "generate_batch (continuous batching)" if args.continuous_batching else "generate, one static batch"
    print(f"transformers {mode} of {args.batch} x {args.len}/{args.len}: {tokens / elapsed:.1f} output tok/s "
          f"({tokens} tokens in {elapsed:.2f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
