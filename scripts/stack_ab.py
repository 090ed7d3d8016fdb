"""A/B of whole decode steps through the decode stack: several kernel source trees, one model, steps alternated in
blocks so that a shared machine's drift hits every tree alike. Times `EngineCore.step` (the stack and the Python
around it) and prints each tree's median and its ratio to the first.

    cp -r src/tokenmill/kernels/csrc /tmp/A; cp -r src/tokenmill/kernels/csrc /tmp/B   # then edit B
    .venv/bin/python scripts/stack_ab.py /tmp/qwen05b --trees /tmp/A,/tmp/B --quantization int4 --batch 1

Each tree builds with its own C++ namespace (`-Dtmk=tmk_ab<i>`), so each module has its own helper threads (the
idle one's fall asleep within ~0.1 ms). Without it the inline functions' statics (`Pool::shared`) are GNU unique
symbols: every module in the process would share the first one's pool, and a tree whose pool differs in layout
would crash.

With `--tensor-inputs`, each tree also runs as "<tree> (tensor inputs)": the step's inputs built as tensors by
the KV cache's `prepare` and fed through `DecodeStack.step_from_metadata`, the path before `step` took lists.

With `--probe`, each turn starts with a short read of 128 MB (the memory's bandwidth at that moment, GB/s), and each
tree's steps are also split by it: turns whose probe read above the midpoint of the probes' 10th and 90th
percentiles, and the rest (where the 90th reads at least 1.3 times the 10th; else the probes saw one level). A
shared host's bandwidth can flip between two levels within seconds (Zen 4: ~31 and ~53 GB/s, another tenant's
load); a change can win at one and not at the other.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenmill import LLM, SamplingParams
from tokenmill.bench.bandwidth import cpu_prober
from tokenmill.kernels import build, isa
from tokenmill.kernels.ops import Kernels
from tokenmill.models.decode_stack import DecodeStack
from tokenmill.types import EngineRequest


class TensorInputs:
    """A stack that the runner feeds through `step_from_metadata` (prepare's tensors), never `step`."""

    plain_embedding = False
    greedy_ready = False  # no decode runs either: each step is one call

    def __init__(self, stack: DecodeStack | None) -> None:
        assert stack is not None
        self.stack, self.kv = stack, stack.kv

    def step_from_metadata(self, *args: Any) -> Any:
        return self.stack.step_from_metadata(*args)


def _tree_cflags(plain: Callable[[str], list[str]], define: str, level: str) -> list[str]:
    return [*plain(level), define]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--trees", required=True, help="kernel source folders, comma-separated (the first: the baseline)")
    p.add_argument("--level", default="", help="kernel variant (default: the best this CPU runs)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default="none")
    p.add_argument("--kv-cache-dtype", default="auto", help="the KV pool's element type (auto, bfloat16, int8, fp8)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=400, help="measured steps per tree")
    p.add_argument("--block", type=int, default=20, help="steps per turn")
    p.add_argument("--tensor-inputs", action="store_true", help="also each tree with its inputs as tensors")
    p.add_argument("--probe", action="store_true", help="also split each tree's steps by the bandwidth of their turn")
    args = p.parse_args()
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    engine, runner = llm.engine, llm.engine.runner
    level = args.level or isa.choose().level
    stacks = {}
    plain_cflags = build.cflags
    for i, tree in enumerate(args.trees.split(",")):
        build.CSRC = Path(tree)
        build.cflags = functools.partial(_tree_cflags, plain_cflags, f"-Dtmk=tmk_ab{i}")
        runner.kv.ops = Kernels(build.load(level), level, build.layout_key(level))  # type: ignore[attr-defined]
        stacks[tree] = DecodeStack.build(llm.loaded.model, runner.kv)
        if args.tensor_inputs:
            stacks[f"{tree} (tensor inputs)"] = TensorInputs(stacks[tree])  # type: ignore[assignment]  # a stand-in
    total = args.steps * len(stacks) + 2 * args.block
    params = SamplingParams(temperature=0, max_tokens=total + 8, ignore_eos=True)
    for b in range(args.batch):
        ids = [100 + (7 * b + i) % 1000 for i in range(args.prompt_tokens)]
        engine.add_request(EngineRequest(request_id=str(b), prompt_token_ids=ids, params=params, max_tokens=total + 8))
    times: dict[str, list[tuple[float, float]]] = {t: [] for t in stacks}  # (step seconds, its turn's probe)
    prober = cpu_prober(128) if args.probe else None  # 128 MB, kept from turn to turn
    runner.decode_stack = stacks[next(iter(stacks))]
    decoding: set[str] = set()
    while len(decoding) < args.batch:  # the prefill: until every request has its first token
        decoding.update(out.request_id for out in engine.step() if out.outputs and out.outputs[0].token_ids)
    for _ in range(args.block):  # warm steps
        engine.step()
    while min(len(v) for v in times.values()) < args.steps:
        for tree, stack in stacks.items():
            runner.decode_stack = stack
            bandwidth = prober(2) if prober is not None else 0.0
            engine.step()  # the first step after a switch wakes this tree's helpers: not counted
            for _ in range(args.block):
                start = time.perf_counter()
                engine.step()
                times[tree].append((time.perf_counter() - start, bandwidth))
    _report(times, args.probe)


def _report(times: dict[str, list[tuple[float, float]]], by_probe: bool) -> None:
    """Each tree's median step and its ratio to the first tree's; with the probes, also above and below their cut."""
    probes = sorted(b for ts in times.values() for _, b in ts)
    low, high = probes[len(probes) // 10], probes[len(probes) * 9 // 10]
    cut = (low + high) / 2  # between the two levels of a bimodal host
    groups = {"": lambda b: True}
    if by_probe and high < 1.3 * low:
        print(f"the probes read {low:.1f}-{high:.1f} GB/s (10th-90th percentile): one level, not split")
    elif by_probe:
        groups |= {f" probe > {cut:.1f} GB/s": lambda b: b > cut, f" probe <= {cut:.1f} GB/s": lambda b: b <= cut}
    for name, keep in groups.items():
        kept = {tree: [t for t, b in ts if keep(b)] for tree, ts in times.items()}
        if not all(kept.values()):
            print(f"{name.strip()}: no turns of " + ", ".join(tree for tree, ts in kept.items() if not ts))
            continue
        base = statistics.median(next(iter(kept.values())))
        for tree, ts in kept.items():
            med = statistics.median(ts)
            print(f"{tree}{name}: {med * 1e3:.3f} ms/step (median of {len(ts)}), {base / med:.3f}x the first")


if __name__ == "__main__":
    main()
