"""Profile decode steps with torch.profiler: the table behind docs/benchmarks.md's "Profile of a decode step",
and a Chrome/Perfetto trace of a few steps (open it in https://ui.perfetto.dev or chrome://tracing).

    .venv/bin/python scripts/profile_decode.py /tmp/qwen05b --batch 1 --prompt-tokens 128 --steps 10 \\
        --trace /tmp/decode-trace.json

Queues `--batch` requests, runs their prefill and a few warm decode steps, then profiles `--steps` engine steps
(decode only) and prints the op table and the unprofiled wall time per step. tokenmill's own kernels are not
torch ops, so while profiling each linear, norm, attention and MLP call is labelled (`record_function`) with
its module; the labels cost nothing outside the profiled steps.

With `--prefill`, the step profiled is instead one prefill of `--batch` new prompts of `--prompt-tokens` each
(after a first wave has warmed the model), through the modules, grouped by module kind:

    .venv/bin/python scripts/profile_decode.py /tmp/qwen05b --prefill --batch 16 --prompt-tokens 128 \
        --quantization int4

Where a decode step runs as one call through the whole stack (models/decode_stack.py, the default with the CPU
kernels), the modules are not called at all: the stack times its own stages instead (`DecodeStack.profile`),
the table shows where the stack's time goes by stage (summed over the layers), and the trace shows each stage
of each layer inside the `decode_stack` slice.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.types import EngineRequest


def label_modules(model: nn.Module) -> Callable[[], None]:
    """Wrap every leaf-ish module's forward in a record_function named after its path; returns the undo."""
    from tokenmill.models.layers import Attention, GatedMLP, RMSNorm
    from tokenmill.models.linear import KernelLinear, Linear

    undo = []
    for name, module in model.named_modules():
        if not isinstance(module, Attention | GatedMLP | RMSNorm | KernelLinear | Linear):
            continue
        original = module.forward

        def labelled(*args: Any, _f: Any = original, _n: str = name, **kwargs: Any) -> Any:
            with record_function(_n):
                return _f(*args, **kwargs)

        module.forward = labelled  # type: ignore[method-assign]
        undo.append((module, original))

    def restore() -> None:
        for module, original in undo:
            module.forward = original  # type: ignore[method-assign]

    return restore


def linear_labels(model: nn.Module) -> set[str]:
    from tokenmill.models.linear import KernelLinear, Linear

    return {name for name, m in model.named_modules() if isinstance(m, KernelLinear | Linear)}


def print_groups(prof: Any, steps: int, linears: set[str]) -> None:
    """Self time per step, grouped by module kind (a label's last part: q_proj, input_layernorm, ...; an
    unlabelled torch op by its name), and the share outside the weight multiplications."""
    groups: dict[str, float] = {}
    in_linears = 0.0
    for e in prof.key_averages():
        ms = e.self_cpu_time_total / 1000 / steps
        key = e.key.rsplit(".", 1)[-1] if e.key.startswith("model.") or e.key == "lm_head" else e.key
        groups[key] = groups.get(key, 0.0) + ms
        in_linears += ms if e.key in linears else 0.0
    total = sum(groups.values())
    print(f"{'group':<28} {'ms/step':>8} {'share':>6}")
    for key, ms in sorted(groups.items(), key=lambda kv: -kv[1])[:16]:
        print(f"{key:<28} {ms:8.2f} {ms / total:6.1%}")
    print(f"weight multiplications {in_linears:.2f} ms/step; everything else {total - in_linears:.2f} ms/step "
          f"({(total - in_linears) / total:.1%} of the profiled step)")  # fmt: skip


# the stages that multiply weights (a MoE layer's chosen experts too: stack/moe.h)
LINEAR_STAGES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head", "experts_gate_up", "experts_down")


class LabelledStack:
    """The runner's decode stack, its calls labelled `decode_stack` for the profiler."""

    def __init__(self, stack: Any) -> None:
        self.stack = stack

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stack, name)

    def step_from_metadata(self, *args: Any) -> Any:
        with record_function("decode_stack"):
            return self.stack.step_from_metadata(*args)

    def step(self, *args: Any) -> Any:
        with record_function("decode_stack"):
            return self.stack.step(*args)

    def decode_run(self, *args: Any) -> Any:  # a decode run: several steps in one call
        with record_function("decode_stack"):
            return self.stack.decode_run(*args)


def print_stages(runs: list[list[tuple[str, int | None, float, float]]], wall: float) -> None:
    """Milliseconds per step in each kind of the stack's stages (summed over the layers), against the step's wall
    time (`wall`, seconds; a decode run's steps are each one of its tokens)."""
    kinds: dict[str, float] = {}
    for run in runs:
        for kind, _, start, end in run:
            kinds[kind] = kinds.get(kind, 0.0) + (end - start) * 1000 / len(runs)
    stack = sum(kinds.values())
    print(f"{'stage (all layers)':<28} {'ms/step':>8} {'share':>6}")
    for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"{kind:<28} {ms:8.2f} {ms / stack:6.1%}")
    linears = sum(kinds.get(k, 0.0) for k in LINEAR_STAGES)
    outside = wall * 1000 - stack
    print(f"decode stack {stack:.2f} ms/step: weight multiplications {linears:.2f} ({linears / stack:.1%}), the rest "
          f"{stack - linears:.2f} ({(stack - linears) / stack:.1%}); outside the stack (embedding, sampler, "
          f"scheduler, Python) {outside:.2f} ms/step")  # fmt: skip
    rest, step = stack - linears + outside, stack + outside  # issue 14's bar: at most 10% of a one-row step
    print(f"outside the weight multiplications: {rest:.2f} ms of a {step:.2f} ms step, {rest / step:.1%}")


def add_stages_to_trace(path: str, runs: list[list[tuple[str, int | None, float, float]]]) -> bool:
    """Nest each profiled run's stages under its `decode_stack` slice in the Chrome trace at `path` (aligned at
    the slice's start; a decode run's steps one after another); False where the slices and the runs do not pair
    up."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    calls = sorted((e for e in events if e.get("name") == "decode_stack" and e.get("ph") == "X"), key=lambda e: e["ts"])
    if not calls or len(runs) % len(calls):
        return False
    per_call = len(runs) // len(calls)  # the steps of a decode run, each its own native run
    offset = 0.0
    for i, run in enumerate(runs):
        call = calls[i // per_call]
        offset = 0.0 if i % per_call == 0 else offset + runs[i - 1][-1][3]
        for kind, layer, start, end in run:
            at = {"pid": call["pid"], "tid": call["tid"], "ts": call["ts"] + (offset + start) * 1e6,
                  "dur": (end - start) * 1e6}  # fmt: skip
            events.append({"name": kind, "ph": "X", "cat": "decode_stack", **at, "args": {"layer": layer}})
    with open(path, "w") as f:
        json.dump(trace, f)
    return True


def profile_prefill(llm: Any, a: argparse.Namespace) -> None:
    """Time one prefill step of `a.batch` fresh prompts, then profile another (each after a warm-up wave), and
    print the time per module kind."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def wave(tag: int) -> None:  # new prompts (prefix caching is off either way)
        for i in range(a.batch):
            first = 300 + 1000 * tag + 7 * i
            prompt = [t % engine.vocab_size for t in range(first, first + a.prompt_tokens)]
            engine.add_request(EngineRequest(f"w{tag}-{i}", prompt, params, engine.validate(prompt, params)))

    def finish() -> None:
        while engine.has_unfinished():
            engine.step()

    wave(0)
    finish()
    wave(1)
    start = time.perf_counter()
    engine.step()
    wall = time.perf_counter() - start
    finish()
    wave(2)
    undo = label_modules(llm.loaded.model)
    with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("engine.step"):
        engine.step()
    undo()
    finish()
    print_groups(prof, 1, linear_labels(llm.loaded.model))
    tokens = a.batch * a.prompt_tokens
    print(f"prefill of {a.batch} x {a.prompt_tokens} tokens: unprofiled {wall:.3f} s ({tokens / wall:.0f} tok/s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="default: the built-in demo model")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quantization", default="none")
    p.add_argument("--no-cpu-kernels", action="store_true", help="the pure-torch path, for comparison")
    p.add_argument("--num-scheduler-steps", type=int, default=EngineConfig.num_scheduler_steps,
                   help="decode steps in one call where they apply (1: one step a call)")  # fmt: skip
    p.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of the profiled steps here")
    p.add_argument("--prefill", action="store_true", help="profile one prefill step of --batch prompts instead")
    a = p.parse_args()
    llm = LLM(a.model, dtype=a.dtype, threads=a.threads, quantization=a.quantization, enable_prefix_caching=False,
              cpu_kernels=not a.no_cpu_kernels, num_scheduler_steps=a.num_scheduler_steps)  # fmt: skip
    if a.prefill:
        return profile_prefill(llm, a)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3 * a.steps * a.num_scheduler_steps + 8, ignore_eos=True)
    for i in range(a.batch):
        prompt = list(range(300 + i, 300 + i + a.prompt_tokens))
        engine.add_request(EngineRequest(f"r{i}", prompt, params, engine.validate(prompt, params)))
    for _ in range(4):  # prefill (one step at these sizes) and warm decodes
        engine.step()
    stack = engine.runner.decode_stack  # None: the steps run on the modules
    if stack is not None:
        stack.profile(True)  # its own stage clock: ~250 clock reads a step
    start, generated = time.perf_counter(), engine.stats.generation_tokens
    for _ in range(a.steps):
        engine.step()
    steps = (engine.stats.generation_tokens - generated) / a.batch  # a decode run's tokens are steps each
    wall = (time.perf_counter() - start) / steps
    unprofiled_runs = stack.stage_runs() if stack is not None else []
    undo = label_modules(llm.loaded.model)
    if stack is not None:
        stack.profile(True)
        engine.runner.decode_stack = LabelledStack(stack)  # type: ignore[assignment]  # a stand-in
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            with record_function("engine.step"):
                engine.step()
    undo()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    if stack is None:
        print_groups(prof, a.steps, linear_labels(llm.loaded.model))
    else:
        engine.runner.decode_stack = stack
        print_stages(unprofiled_runs, wall)
    if a.trace:
        prof.export_chrome_trace(a.trace)
        if stack is not None and not add_stages_to_trace(a.trace, stack.stage_runs()):
            print("(the trace has no decode stack stages: its decode_stack slices and the stack's runs differ)")
        print(f"trace: {a.trace}")
    if stack is not None:
        stack.profile(False)
    print(f"batch {a.batch}: unprofiled wall time per decode step {wall * 1000:.1f} ms over {steps:.0f} steps "
          f"({a.steps} engine steps)")  # fmt: skip


if __name__ == "__main__":
    main()
