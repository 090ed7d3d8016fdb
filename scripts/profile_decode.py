"""Profile decode steps with torch.profiler: the table behind docs/benchmarks.md's "Profile of a decode step".

    .venv/bin/python scripts/profile_decode.py /tmp/qwen05b --batch 1 --prompt-tokens 128 --steps 10

Queues `--batch` requests, runs their prefill and a few warm decode steps, then profiles `--steps` engine steps
(decode only) and prints the op table and the unprofiled wall time per step.
"""

from __future__ import annotations

import argparse
import time

from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM, SamplingParams
from tokenmill.types import EngineRequest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quantization", default="none")
    a = p.parse_args()
    llm = LLM(a.model, dtype=a.dtype, threads=a.threads, quantization=a.quantization, enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3 * a.steps + 8, ignore_eos=True)
    for i in range(a.batch):
        prompt = list(range(300 + i, 300 + i + a.prompt_tokens))
        engine.add_request(EngineRequest(f"r{i}", prompt, params, engine.validate(prompt, params)))
    for _ in range(4):  # prefill (one step at these sizes) and warm decodes
        engine.step()
    start = time.perf_counter()
    for _ in range(a.steps):
        engine.step()
    wall = (time.perf_counter() - start) / a.steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    print(f"batch {a.batch}: unprofiled wall time per decode step {wall * 1000:.1f} ms over {a.steps} steps")


if __name__ == "__main__":
    main()
