"""Random switch combinations against the references, on every family of tests/parity/test_models.py: a fuzz that
looks where the parity tests' fixed prompts and switches do not.

    # float32 against transformers (greedy tokens, prompt logprobs and token logprobs to 1e-4)
    .venv/bin/python scripts/switch_fuzz.py --seeds 1-5
    # batch_invariant=True in bf16, int8 and int4: each prompt alone against all of them batched (greedy, seeded draws)
    .venv/bin/python scripts/switch_fuzz.py --mode invariant --seeds 1-3 --configs llama-gqa2,qwen3moe-top2of8-dense1
    # the same over the K-quants and legacy types too (hidden 256: rows of whole superblocks), on the avx2 kernels
    TOKENMILL_ISA=avx2 .venv/bin/python scripts/switch_fuzz.py --mode invariant --wide --seeds 1-3

Per config and seed: 2-6 random prompts (some sharing a prefix, up to 90 tokens: past every tiny window and
LongRoPE's original length), then three random sets of max_num_seqs, the step budget (4-512 tokens), prefix caching,
decode runs, block size, a KV pool just big enough to preempt, ngram speculation, the contiguous cache or none, and
torch's ops without our kernels. The
reference is transformers' greedy `generate` with no EOS (under `min_new_tokens` it would forbid the tiny
tokenizer's EOS, token 0). Prints a line per run
and exits 1 on any mismatch or error. Needs the test suite's helpers (run from the repository root).
"""

from __future__ import annotations

import argparse
import random
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.conftest import TINY, build_tokenizer
from tests.parity.test_models import CONFIGS, SPREAD
from tokenmill import LLM, SamplingParams
from tokenmill.make_model import hf_config, write_checkpoint

LOGPROB_TOL = 1e-4
WIDE = dict(hidden_size=256, intermediate_size=512)  # (--wide: every weight row a whole number of superblocks)


def prompts_for(rng: random.Random) -> list[list[int]]:
    shared = [rng.randrange(5, 380) for _ in range(40)]
    out = []
    for _ in range(rng.randint(2, 6)):
        head = shared[: rng.randint(1, 40)] if rng.random() < 0.5 else []
        out.append((head + [rng.randrange(5, 380) for _ in range(rng.randint(3, 60))])[:90])
    return out


def switches(rng: random.Random, prompts: list[list[int]], max_tokens: int, invariant: bool) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        max_num_seqs=rng.choice([1, 2, 3, 8]) if not invariant else rng.choice([2, 3, 8]),
        max_num_batched_tokens=rng.choice([4, 7, 16, 33, 512]),
        enable_prefix_caching=rng.random() < 0.6,
        num_scheduler_steps=rng.choice([1, 2, 4, 8]),
        block_size=rng.choice([4, 8, 16]),
    )
    if rng.random() < 0.4:  # a pool that holds the longest sequence, and little more: preemption
        need = max(-(-(len(p) + max_tokens) // kw["block_size"]) for p in prompts)
        kw["num_kv_blocks"] = rng.randint(need, 2 * need + 4)
    if rng.random() < 0.3:
        kw.update(speculative_model="ngram", num_speculative_tokens=rng.choice([1, 3, 5]))
    if not invariant and rng.random() < 0.25:
        kw["kv_cache"] = rng.choice(["contiguous", "none"])  # (none: every step computes the whole context again)
        kw.pop("num_kv_blocks", None)
        if kw["kv_cache"] == "none":  # (drafts need a cache to verify against)
            kw.pop("speculative_model", None), kw.pop("num_speculative_tokens", None)
    if not invariant and rng.random() < 0.2:
        kw["cpu_kernels"] = False  # torch's ops alone
    return kw


def hf_reference(hf: Any, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor], torch.Tensor]:
    """transformers' greedy `generate` with no EOS (its tokens and each step's log-softmax [V]), and the prompt's
    log-softmax [T, V] from one forward."""
    hf.generation_config.eos_token_id = None  # (a GenerationConfig's None would take the model's)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)  # fmt: skip
        prompt_lp = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    return out.sequences[0, len(prompt) :].tolist(), [s[0].float().log_softmax(-1) for s in out.logits], prompt_lp


def check_hf(folder: Path, rng: random.Random) -> list[str]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompts, max_tokens = prompts_for(rng), rng.randint(8, 40)
    refs = [hf_reference(hf, p, max_tokens) for p in prompts]
    lines = []
    for _ in range(3):
        kw = switches(rng, prompts, max_tokens, invariant=False)
        plp, lp = rng.choice([None, 1, 3]), rng.choice([None, 2])
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=plp, logprobs=lp)
        outs = LLM(str(folder), dtype="float32", **kw).generate([{"prompt_token_ids": p} for p in prompts], params)
        problems = []
        for p, (tokens, steps, prompt_lp), out in zip(prompts, refs, outs):
            got = list(out.outputs[0].token_ids)
            if got != tokens:
                k = next((j for j in range(min(len(got), len(tokens))) if got[j] != tokens[j]), None)
                problems.append(f"a {len(p)}-token prompt's token {k}: {got[k]} against {tokens[k]}" if k is not None
                                else f"a {len(p)}-token prompt: {len(got)} tokens against {len(tokens)}")  # fmt: skip
                continue
            worst = 0.0
            if plp is not None and out.prompt_logprobs is not None:
                scored = out.prompt_logprobs[1:]  # position i scores token i (none for the first)
                worst = max(abs(e[t] - prompt_lp[i, t].item()) for i, (e, t) in enumerate(zip(scored, p[1:])) if e)
            if lp is not None and out.outputs[0].logprobs is not None:
                worst = max([worst] + [abs(e[t] - s[t].item()) for e, t, s in zip(out.outputs[0].logprobs, got, steps)])
            if worst > LOGPROB_TOL:
                problems.append(f"a {len(p)}-token prompt's logprobs off by {worst:.2e}")
        lines.append(f"{kw} plp={plp} lp={lp}: " + ("; ".join(problems) or "ok"))
    return lines


def draw_params(rng: random.Random, max_tokens: int) -> SamplingParams:
    """Greedy, or a seeded draw through temperature, top-p and top-k."""
    if rng.random() < 0.5:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    temperature, top_p, top_k = rng.choice([0.7, 1.3]), rng.choice([1.0, 0.9]), rng.choice([0, 20])
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature, top_p=top_p, top_k=top_k,
                          seed=rng.randrange(1000))  # fmt: skip


QUANTS = ("none", "int8", "int4")
K_QUANTS = ("q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "q4_1", "q4_k_m", "q5_k_m")  # (rows of 256: --wide)


def check_invariant(folder: Path, rng: random.Random, quants: tuple[str, ...] = QUANTS) -> list[str]:
    prompts, max_tokens = prompts_for(rng), rng.randint(8, 40)
    quant = rng.choice(quants)
    params = [draw_params(rng, max_tokens) for _ in prompts]
    fixed: dict[str, Any] = dict(dtype="bfloat16", quantization=quant, batch_invariant=True)
    alone = LLM(str(folder), **fixed, max_num_seqs=1, enable_prefix_caching=False, num_scheduler_steps=1)
    want = [list(alone.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].token_ids)
            for p, sp in zip(prompts, params)]  # fmt: skip
    lines = []
    for _ in range(3):
        kw = switches(rng, prompts, max_tokens, invariant=True)
        if any(sp.temperature > 0 for sp in params):
            kw.pop("speculative_model", None)  # (drafts change which uniforms a drawn row takes)
            kw.pop("num_speculative_tokens", None)
        outs = LLM(str(folder), **fixed, **kw).generate([{"prompt_token_ids": p} for p in prompts], params)
        bad = [i for i, o in enumerate(outs) if list(o.outputs[0].token_ids) != want[i]]
        lines.append(f"{quant} {kw}: " + (f"rows {bad} differ from alone" if bad else "ok"))
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["hf", "invariant"], default="hf")
    p.add_argument("--seeds", default="1", help="a seed, or a range a-b")
    p.add_argument("--configs", default="", help="comma-separated names of test_models.CONFIGS (default: all)")
    p.add_argument("--workdir", default="/tmp/switch_fuzz", help="where the checkpoints are written")
    p.add_argument("--wide", action="store_true", help="hidden 256 and FFN rows of 512 (a K-quant's superblock is "
                   "256): --mode invariant then draws the K-quants and legacy types too")  # fmt: skip
    args = p.parse_args()
    first, _, last = args.seeds.partition("-")
    names = args.configs.split(",") if args.configs else list(CONFIGS)
    failures = 0
    for seed in range(int(first), int(last or first) + 1):
        rng, root = random.Random(seed), Path(args.workdir) / (f"{seed}-wide" if args.wide else str(seed))
        tokenizer = build_tokenizer(root / "tokenizer") if not (root / "tokenizer").exists() else root / "tokenizer"
        for name in names:
            arch, overrides = CONFIGS[name]
            folder = root / name
            if not folder.exists():
                shape = {**TINY, **SPREAD, **overrides, **(WIDE if args.wide else {})}
                if args.wide and "moe_intermediate_size" in overrides:
                    shape["moe_intermediate_size"] = 256
                if args.wide and "long_factor" in overrides.get("rope_scaling", {}):  # (its factors: head_dim 16)
                    shape["num_attention_heads"] = WIDE["hidden_size"] // 16
                write_checkpoint(hf_config(arch, **shape), tokenizer, folder, "float32", seed)
            try:
                if args.mode == "hf":
                    lines = check_hf(folder, rng)
                else:
                    lines = check_invariant(folder, rng, QUANTS + K_QUANTS if args.wide else QUANTS)
            except Exception as e:  # (a fuzz reports every failure and goes on)
                lines = ["error: " + "".join(traceback.format_exception_only(type(e), e)).strip()]
            for line in lines:
                failures += not line.endswith(": ok")
                print(f"seed {seed} {name}: {line}", flush=True)
    print(f"{failures} failing runs")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
