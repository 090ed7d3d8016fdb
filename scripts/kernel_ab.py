"""Time the packed linears of a Qwen2.5-0.5B-shaped model (or --shape 1.5b: 28 layers; qkv, o, gate_up, down, and
the LM head) at a few row counts, several kernel builds alternated in one process, so that a shared machine's drift hits
them alike.

    # every variant this CPU runs
    .venv/bin/python scripts/kernel_ab.py --levels avx2,avxvnni,avx512,avx512bf16 --formats q8_0,q4_0 --rows 1,4,16
    # two source trees (copies of src/tokenmill/kernels/csrc, one edited), one variant
    .venv/bin/python scripts/kernel_ab.py --trees /tmp/A,/tmp/B --levels avx512bf16 --formats q4_0 --rows 1,8
    # AMX tiles against the register tiles, toggled in the same build
    .venv/bin/python scripts/kernel_ab.py --amx --formats q8_0,q4_0 --rows 5,8,9,16
    # K-quants (rows of 1536: whole superblocks), 6 layers of the 1.5B shape
    .venv/bin/python scripts/kernel_ab.py --shape 1.5b --layers 6 --no-head --levels avx2 --formats q4_k --rows 1,16

The weights (~1.2 GB in bf16) come from memory on every pass, as in a decode step; the medians of --reps passes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from tokenmill.kernels import build
from tokenmill.kernels.formats import pack
from tokenmill.kernels.ops import Kernels

# hidden, MLP, q+k+v, layers of each shape (Qwen2.5); the vocabulary, 151936, is the LM head's rows
DIMS = {"0.5b": (896, 4864, 1152, 24), "1.5b": (1536, 8960, 2048, 28)}
V = 151936


def shapes(shape: str, layers: int, head: bool) -> list[tuple[int, int]]:
    """[out, in] of each linear, in step order; `layers` (0: the model's own) and the head where `head`"""
    d, ff, qkv, n = DIMS[shape]
    return [(qkv, d), (d, d), (2 * ff, d), (d, ff)] * (layers or n) + ([(V, d)] if head else [])


def builds(args: argparse.Namespace) -> dict[str, tuple[Kernels, int]]:
    """label -> (kernels, set_amx mode to run them with)"""
    out: dict[str, tuple[Kernels, int]] = {}
    trees = args.trees.split(",") if args.trees else [str(build.CSRC)]
    for tree in trees:
        build.CSRC = Path(tree)
        for level in args.levels.split(","):
            ops = Kernels(build.load(level), level, build.layout_key(level))
            label = f"{Path(tree).name}:{level}" if args.trees else level
            if args.amx:
                out[f"{label}+amx"], out[f"{label}-amx"] = (ops, -1), (ops, 0)
            else:
                out[label] = (ops, -1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default="avx512bf16", help="kernel variants (isa.LEVELS), comma-separated")
    p.add_argument("--trees", default="", help="kernel source folders to compare, comma-separated")
    p.add_argument("--amx", action="store_true", help="each build with and without its AMX tiles")
    p.add_argument("--formats", default="bf16,q8_0,q4_0")
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--shape", choices=sorted(DIMS), default="0.5b", help="Qwen2.5 shape (1.5b: K-quant rows)")
    p.add_argument("--layers", type=int, default=0, help="layers to time (0: all; fewer packs faster)")
    p.add_argument("--no-head", action="store_true", help="leave the LM head out")
    args = p.parse_args()
    d, ff = DIMS[args.shape][:2]
    runs = builds(args)
    torch.manual_seed(0)
    for fmt in args.formats.split(","):
        weights = [pack(torch.randn(n, k) * 0.02, fmt) for n, k in shapes(args.shape, args.layers, not args.no_head)]
        nbytes = sum(w.data.numel() for w in weights)
        for m in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in (d, ff)}
            times: dict[str, list[float]] = {label: [] for label in runs}
            for _ in range(args.reps):
                for label, (ops, amx) in runs.items():
                    before = ops.module.set_amx(amx)
                    start = time.perf_counter()
                    for w in weights:
                        ops.linear(xs[w.in_features], w.data, w.format_id, w.out_features, w.padded_in, None)
                    times[label].append(time.perf_counter() - start)
                    ops.module.set_amx(before)
            med = {label: sorted(t)[len(t) // 2] for label, t in times.items()}
            cells = "  ".join(f"{label} {s * 1e3:6.2f} ms ({nbytes / s / 1e9:4.1f} GB/s)" for label, s in med.items())
            print(f"{fmt} {m:3d} rows: {cells}", flush=True)


if __name__ == "__main__":
    main()
