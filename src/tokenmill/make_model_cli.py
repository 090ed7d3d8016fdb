"""`tokenmill make-model`: its flags and its command (cli.py hands it the parsed arguments)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

from tokenmill.config import DTYPES


def add_make_model_args(mk: argparse.ArgumentParser) -> None:
    """`tokenmill make-model`'s flags."""
    from tokenmill.make_model import SHAPES

    mk.add_argument(
        "--arch",
        choices=_FamilyNames(),
        metavar="FAMILY",
        required=True,
        help="model family (llama, qwen2, ...; a wrong name lists them all)",
    )
    mk.add_argument("--shape", choices=list(SHAPES), required=True)
    mk.add_argument("--tokenizer", required=True, help="folder with a Hugging Face tokenizer")
    mk.add_argument("--out", required=True)
    mk.add_argument("--dtype", choices=[d for d in DTYPES if d != "auto"], default="bfloat16")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--device", default="cpu",
                    help="where the random weights are drawn before they are written (cpu, cuda, cuda:N): a GPU "
                         "draws an 8B model's in a second, a CPU's cores in minutes (default: cpu)")  # fmt: skip
    mk.add_argument("--gguf", default=None, metavar="TYPE",
                    help="write a GGUF file of this type straight to --out, without a checkpoint (f32, bf16, q8_0, "
                         "q4_0, q4_k, q5_k, q6_k, q4_k_m, q5_k_m; Llama-shaped families)")  # fmt: skip


class _FamilyNames:
    """`--arch` choices, read from the model registry only when argparse needs them (it imports torch)."""

    def _names(self) -> list[str]:
        from tokenmill.models import FAMILIES

        return [f.name for f in FAMILIES]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()


def cmd_make_model(a: argparse.Namespace) -> int:
    from tokenmill.make_model import make_model, shape_fields

    if a.gguf is None:
        out = make_model(a.arch, a.shape, a.tokenizer, a.out, a.dtype, a.seed, a.device)
        print(f"wrote {a.arch} {a.shape} ({a.dtype}) to {out}")
        return 0
    if a.device != "cpu":
        raise ValueError(f"--device {a.device} draws a checkpoint's weights; a --gguf file's are drawn on the CPU")
    from tokenmill.bench.gguf_random import write_random_gguf
    from tokenmill.progress import progress

    fields = shape_fields(a.shape, a.tokenizer)
    with progress(f"make-model: {a.arch} at the {a.shape} shape, a {a.gguf} GGUF"):
        out = write_random_gguf(a.arch, fields, Path(a.tokenizer), Path(a.out), a.gguf, a.seed)
    print(f"wrote {a.arch} {a.shape} ({a.gguf} GGUF, random weights) to {out}")
    return 0
