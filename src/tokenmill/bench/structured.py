"""`tokenmill bench sweep --experiment structured_output`: what a grammar costs per decode step, and to compile.

For each batch size (--batch-sizes), the same random-token prompts decode --gen-tokens tokens each, free and
constrained to a JSON schema, in alternating trials; a step's time is the run's wall time over its engine
steps. The schema is an object whose one string must be at least 4000 characters long, so no request can end
before --gen-tokens and both runs do the same steps, most of them inside a JSON string (as a JSON answer's
tokens mostly are). Compile time is measured for a typical schema: cold (the tokenizer's first wrap included),
a new schema once warm, and cached.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from tokenmill.bench.stats import summarize

LONG = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4000}}, "required": ["text"],
        "additionalProperties": False}  # fmt: skip
TYPICAL = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "email", "tags", "address"],
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}, "email": {"type": "string",
                                                                                      "format": "email"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                    "pattern": "^[0-9]{5}$"}}, "required": ["city"]},
    },
}  # fmt: skip


def run(args: argparse.Namespace, kw: dict[str, Any]) -> list[dict[str, Any]]:
    from tokenmill import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(args.model, **kw)
    core = llm.engine
    times = {}
    for label, schema in (("cold", TYPICAL), ("new_schema", {**TYPICAL, "title": "another"}), ("cached", TYPICAL)):
        t = time.perf_counter()
        core.structured.compile(StructuredOutputsParams(json=schema))
        times[label] = (time.perf_counter() - t) * 1000
    rng = random.Random(args.seed)
    vocab = core.vocab_size
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = [
            {"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.prompt_tokens)]} for _ in range(batch)
        ]
        free = SamplingParams(temperature=1.0, seed=1, max_tokens=args.gen_tokens, ignore_eos=True)
        constrained = SamplingParams(temperature=1.0, seed=1, max_tokens=args.gen_tokens, ignore_eos=True,
                                     structured_outputs=StructuredOutputsParams(json=LONG))  # fmt: skip
        step_ms: dict[str, list[float]] = {"free": [], "constrained": []}
        llm.generate(prompts[:1], free)  # warmup
        for _ in range(args.trials):
            for name, params in (("free", free), ("constrained", constrained)):
                steps, t = core.stats.num_steps, time.perf_counter()
                outs = llm.generate(prompts, params)
                assert all(len(o.outputs[0].token_ids) == args.gen_tokens for o in outs)
                step_ms[name].append((time.perf_counter() - t) * 1000 / (core.stats.num_steps - steps))
        f, c = summarize(step_ms["free"])["p50"], summarize(step_ms["constrained"])["p50"]
        rows.append({"batch": batch, "step_ms_free": f, "step_ms_constrained": c, "overhead_pct": 100 * (c - f) / f,
                     "compile_cold_ms": times["cold"], "compile_new_schema_ms": times["new_schema"],
                     "compile_cached_ms": times["cached"], "trials": args.trials})  # fmt: skip
    return rows
