"""transformers' `generate` with one static batch, the baseline of docs/benchmarks.md's GPU section: N prompts of
L random tokens, L new tokens each (greedy, no early stop), bf16, on the GPU.

    python scripts/hf_static_batch.py /tmp/q05 --batch 64 --len 128
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--len", type=int, default=128, help="prompt tokens, and new tokens")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(args.device).eval()
    rng = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size, (args.batch, args.len), generator=rng).to(args.device)
    mask = torch.ones_like(ids)
    n = args.len
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=8, min_new_tokens=8, do_sample=False)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    print(f"transformers generate, static batch of {args.batch} x {n}/{n}: {args.batch * n / elapsed:.1f} output tok/s "
          f"({elapsed:.2f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
