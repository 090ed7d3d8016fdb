"""How far a bfloat16 run drifts from float32, per engine: transformers' bf16, tokenmill on torch's ops, and
tokenmill on its GPU (Triton) kernels, each against transformers' float32 on the same tiny checkpoints.

    python scripts/bf16_drift.py [CONFIG ...]        (names from tests/parity/test_models.py; default: all)

transformers' float32 greedy continuation (32 tokens) is the reference sequence. Each bf16 engine reads the prompt
plus that continuation (teacher forcing) and gives the log-probability of each next reference token; the table
shows the largest and the mean error against float32's, and the reference's own smallest margin (its top logit
over the runner-up), which says how close the nearest tie is. A greedy run parts from the reference where an
error exceeds that position's margin. Prints one JSON line per config.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from tests.conftest import TINY, build_tokenizer
from tests.parity.test_models import CONFIGS, PROMPT, SPREAD
from tokenmill import LLM, SamplingParams
from tokenmill.make_model import hf_config, write_checkpoint

NEW = 32


def _hf(
    folder: Path, ids: list[int], dtype: torch.dtype, seq: list[int] | None = None
) -> tuple[list[int], torch.Tensor]:
    """(greedy continuation, log-probs [len(seq) - 1, V] over `seq`, by default ids + that continuation), transformers
    on the GPU."""
    from transformers import AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM  # (transformers' decorators type from_pretrained's first argument wrongly)
    hf = auto.from_pretrained(str(folder), dtype=dtype).to("cuda").eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        read = out if seq is None else torch.tensor([seq], device="cuda")
        logits = hf(read).logits[0, :-1].float()
    return out[0, len(ids) :].tolist(), torch.log_softmax(logits, -1).cpu()


def _ours(folder: Path, seq: list[int], gpu_kernels: bool) -> torch.Tensor:  # [len(seq) - 1] log-probs
    llm = LLM(str(folder), dtype="bfloat16", device="cuda", gpu_kernels=gpu_kernels, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    lps = llm.generate([{"prompt_token_ids": seq}], params)[0].prompt_logprobs
    assert lps is not None
    rows = [row[t] for row, t in zip(lps[1:], seq[1:], strict=True) if row is not None]  # position 0 has none
    assert len(rows) == len(seq) - 1
    return torch.tensor(rows)


def main() -> None:
    names = sys.argv[1:] or list(CONFIGS)
    root = Path(tempfile.mkdtemp())
    tok = build_tokenizer(root / "tok")
    for name in names:
        arch, overrides = CONFIGS[name]
        folder = write_checkpoint(hf_config(arch, **{**TINY, **SPREAD, **overrides}), tok, root / name, "float32")
        ids = LLM(str(folder), device="cpu").tokenizer.encode(PROMPT)
        cont, ref = _hf(folder, ids, torch.float32)
        seq = ids + cont
        pos = torch.arange(len(seq) - 1)
        nxt = torch.tensor(seq[1:])
        want = ref[pos, nxt]  # float32's log-prob of each next token
        top2 = ref.topk(2, -1).values
        margin = (top2[len(ids) - 1 :, 0] - top2[len(ids) - 1 :, 1]).min().item()
        hf_bf16 = _hf(folder, ids, torch.bfloat16, seq)[1][pos, nxt]  # teacher-forced on float32's sequence
        row = dict(config=name, min_margin=round(margin, 4))
        for label, got in (("hf_bf16", hf_bf16), ("ours_torch", _ours(folder, seq, False)),
                           ("ours_triton", _ours(folder, seq, True))):  # fmt: skip
            err = (got - want).abs()[len(ids) - 1 :]  # the generated positions
            row[label] = [round(err.max().item(), 4), round(err.mean().item(), 5)]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
