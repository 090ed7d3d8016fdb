"""What one decode step costs on a GPU, beside what its weights cost: the numbers behind docs/benchmarks.md's
"CUDA kernels" table (issue 63).

    python scripts/gpu_step.py /tmp/q05 --batch 1 --context 160 [--quantization int8] [--no-gpu-kernels]

Loads the model on the GPU (bf16), decodes once so the step's CUDA graph is recorded, then:
- replays that graph back to back and times it with CUDA events: the GPU time of a whole step (ms);
- runs the same step eagerly under torch.profiler: how many kernels a step launches, their summed time, and the
  most launched by name (what the next fusion should take) and those that take the most GPU time;
- times a 4 GiB read (a sum) to get the GPU's memory bandwidth, and from it what the weights alone take.
The step's overhead beyond the weights is the replay time less the weights' time. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM, SamplingParams
from tokenmill.models.linear import weight_bytes


def cuda_ms(fn: Callable[[], object], repeat: int) -> float:
    """fn's mean GPU time in ms over `repeat` calls, after one warm-up (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def _bandwidth_gbs() -> float:
    x = torch.ones(2**30, dtype=torch.float32, device="cuda")  # 4 GiB
    ms = cuda_ms(lambda: x.sum(), 10)
    return x.numel() * 4 / ms / 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--quantization", default="none")
    p.add_argument("--no-gpu-kernels", action="store_true")
    args = p.parse_args()
    llm = LLM(args.model, device="cuda", dtype="bfloat16", quantization=args.quantization,
              gpu_kernels=not args.no_gpu_kernels, max_num_seqs=max(args.batch, 1))  # fmt: skip
    prompt = {"prompt_token_ids": [5 + i % 1000 for i in range(args.context - 2)]}
    llm.generate([prompt] * args.batch, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.buckets, "no CUDA graph was recorded"
    (rows, width), bucket = next(iter(graphs.buckets.items()))
    assert bucket.graph is not None
    replay_ms = cuda_ms(bucket.graph.replay, 50)
    graphs._forward(bucket.inputs, rows, width)  # eager, warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphs._forward(bucket.inputs, rows, width)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = Counter(e.name[:60] for e in kernels).most_common(12)
    times: Counter[str] = Counter()  # each kernel's summed GPU time in the eager step, ms: where the step's time goes
    for e in kernels:
        times[e.name[:60]] += e.device_time / 1e3
    most_time = [(name, round(ms, 4)) for name, ms in times.most_common(12)]
    gbs = _bandwidth_gbs()
    wbytes = weight_bytes(llm.loaded.model)
    weights_ms = wbytes / gbs / 1e6
    print(json.dumps(dict(
        quantization=args.quantization, gpu_kernels=not args.no_gpu_kernels, batch=args.batch, context=args.context,
        bucket=[rows, width], step_ms=round(replay_ms, 4), kernels_per_step=len(kernels),
        kernel_ms_eager=round(sum(e.device_time for e in kernels) / 1e3, 4), weight_mb=round(wbytes / 1e6, 1),
        probe_gbs=round(gbs, 1), weights_ms=round(weights_ms, 4), overhead_ms=round(replay_ms - weights_ms, 4),
        weights_share_of_step=round(weights_ms / replay_ms, 3), most_launched=names, most_time=most_time,
    )), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
