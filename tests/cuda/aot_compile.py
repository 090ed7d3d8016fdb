"""Compile every Triton kernel of kernels/cuda/ for NVIDIA targets without a GPU: `triton.compile` on each kernel's
source for an sm_80 and an sm_90 target, through PTX to a cubin with the ptxas Triton ships. It catches what
only a GPU's compiler refuses (Triton's interpreter runs Python and accepts it): a runtime `if` that rebinds a
name to another type, a `tl.dot` under 16 wide, an op the backend lacks. Run by test_triton_compiles.py in a
process of its own, as Triton's interpreter must be off when the kernels are defined.

    python tests/cuda/aot_compile.py [NAME_PART...]     prints one line per kernel variant, exits 1 if any failed
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # (before the kernels are defined)

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tokenmill.kernels.cuda import attention, fp8, int8, moe, pointwise, prefill

Case = tuple[str, Any, dict[str, str], dict[str, Any]]


def _cases() -> list[Case]:
    cases: list[Case] = []
    for dt in ("bf16", "fp32"):
        cases.append((f"rmsnorm {dt}", pointwise._rmsnorm,
                      dict(x_ptr=f"*{dt}", res_ptr=f"*{dt}", w_ptr=f"*{dt}", out_ptr=f"*{dt}", D="i32", eps="fp32"),
                      dict(HAS_RES=True, BLOCK=1024)))  # fmt: skip
        cases.append((f"silu_mul {dt}", pointwise._silu_mul, dict(gu_ptr=f"*{dt}", out_ptr=f"*{dt}", inter="i32"),
                      dict(BLOCK=1024)))  # fmt: skip
        for tanh in (False, True):
            cases.append((f"gelu_mul {dt} tanh={tanh}", pointwise._gelu_mul,
                          dict(gu_ptr=f"*{dt}", out_ptr=f"*{dt}", inter="i32"),
                          dict(TANH=tanh, BLOCK=1024)))  # fmt: skip
        cases.append((f"rope {dt}", pointwise._rope, dict(x_ptr=f"*{dt}", cos_ptr=f"*{dt}", sin_ptr=f"*{dt}",
                      row_stride="i64"), dict(HALF=32, BLOCK=32)))  # fmt: skip
        cases.append((f"kv_write {dt}", pointwise._kv_write, dict(k_ptr=f"*{dt}", k_stride="i64", v_ptr=f"*{dt}",
                      v_stride="i64", cache_ptr=f"*{dt}", slots_ptr="*i64", kv_offset="i64"),
                      dict(WIDTH=128, BLOCK=128)))  # fmt: skip
        for norm in (False, True):
            cases.append((f"rope_kv {dt} norm={norm}", pointwise._rope_kv,
                          dict(qkv_ptr=f"*{dt}", row_stride="i64", cos_ptr=f"*{dt}", sin_ptr=f"*{dt}", qw_ptr=f"*{dt}",
                               kw_ptr=f"*{dt}", eps="fp32", cache_ptr=f"*{dt}", slots_ptr="*i64", kv_offset="i64"),
                          dict(Q_HEADS=14, KV_HEADS=2, HALF=32, NORM=norm, BLOCK=32)))  # fmt: skip
        for split in (False, True):
            for sinks in (False, True):
                cases.append((f"decode {dt} split={split} sinks={sinks}", attention._decode,
                              dict(q_ptr=f"*{dt}", cache_ptr=f"*{dt}", tables_ptr="*i64", lens_ptr="*i64",
                                   out_ptr=f"*{dt}", part_ptr="*fp32", sinks_ptr="*fp32", kv_offset="i64",
                                   table_width="i32", scale="fp32", window="i32", split_len="i32", splits="i32"),
                              dict(H=14, HKV=2, G=7, GP=8, DH=64, DP=64, BS=16, TILE=attention.TILE, SPLIT=split,
                                   SINKS=sinks)))  # fmt: skip
            cases.append((f"prefill {dt} sinks={split}", prefill._prefill,
                          dict(q_ptr=f"*{dt}", q_stride="i64", cache_ptr=f"*{dt}", tables_ptr="*i64", seqs_ptr="*i64",
                               out_ptr=f"*{dt}", sinks_ptr="*fp32", kv_offset="i64", table_width="i32",
                               scale="fp32", window="i32"),
                          dict(H=14, HKV=2, G=7, DH=64, DP=64, BS=16, BM=prefill.BM, BN=prefill.BN, SINKS=split,
                               IEEE=dt == "fp32")))  # fmt: skip
        cases.append((f"combine {dt} sinks", attention._combine,
                      dict(part_ptr="*fp32", out_ptr=f"*{dt}", sinks_ptr="*fp32", splits="i32"),
                      dict(H=14, DH=64, DP=64, SP=8, SINKS=True)))  # fmt: skip
        q8 = dict(
            x_ptr=f"*{dt}",
            q_ptr="*i8",
            d_ptr="*fp32",
            bias_ptr="*fp32",
            out_ptr=f"*{dt}",
            part_ptr="*fp32",
            M="i32",
            N="i32",
            KX="i32",
            KP="i32",
            k_per_split="i32",
        )
        for bm, bn in ((16, 64), (128, 128)):
            cases.append((f"q8_linear {dt} {bm}x{bn}", int8._q8_linear, q8,
                          dict(HAS_BIAS=True, BM=bm, BN=bn, GROUPS=4, SPLIT=True, IEEE=dt == "fp32")))  # fmt: skip
        cases.append((f"q8_gemv {dt}", int8._q8_gemv, q8, dict(HAS_BIAS=True, BM=4, BN=16, BK=128, SPLIT=True)))
        cases.append((f"sum_splits {dt}", int8._sum_splits, dict(part_ptr="*fp32", bias_ptr="*fp32", out_ptr=f"*{dt}",
                      total="i32", N="i32", splits="i32"), dict(HAS_BIAS=True, BLOCK=1024)))  # fmt: skip
        cases.append((f"grouped_gemm {dt}", moe._grouped_gemm,
                      dict(a_ptr=f"*{dt}", w_ptr=f"*{dt}", out_ptr="*fp32", slots_ptr="*i64", block_expert_ptr="*i64",
                           blocks_ptr="*i64", weight_ptr="*fp32", P="i32", N="i32", K="i32"),
                      dict(TOP_K=2, GATHER=True, WEIGHTED=True, BM=moe.BM, BN=64, BK=64,
                           IEEE=dt == "fp32")))  # fmt: skip
        cases.append((f"fp8_rows {dt}", fp8._fp8_rows, dict(x_ptr=f"*{dt}", q_ptr="*fp8e4nv", scale_ptr="*fp32",
                      K="i32"), dict(BLOCK=1024)))  # fmt: skip
    return cases


def archs(case: Case) -> tuple[int, ...]:
    """The targets a variant compiles for: fp8's only where FP8 exists (Ada's 8.9, Hopper's 9.0)."""
    return (90,) if case[0].startswith("fp8") else (80, 90)


def compile_case(case: Case, arch: int) -> str | None:
    """None where it compiles to a cubin; else the error's first lines."""
    _, kernel, types, constexprs = case
    signature = {a: "constexpr" if a in constexprs else types[a] for a in kernel.arg_names}
    try:
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32))
    except Exception as e:  # the compiler's own error, reported per kernel
        return f"{type(e).__name__}: {str(e)[:800]}"
    return None if compiled.asm.get("cubin") else "no cubin"


def _run(job: tuple[int, int]) -> str:
    index, arch = job
    case = _cases()[index]
    error = compile_case(case, arch)
    return f"{'ok  ' if error is None else 'FAIL'} sm_{arch} {case[0]}" + ("" if error is None else f": {error}")


def main(parts: list[str]) -> int:
    """Every variant on sm_80 and sm_90, on all cores (each compile is single-threaded)."""
    jobs = [(i, arch) for i, case in enumerate(_cases()) if not parts or any(p in case[0] for p in parts)
            for arch in archs(case)]  # fmt: skip
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count() or 1) as pool:
        lines = list(pool.map(_run, jobs))
    print("\n".join(lines))
    return 1 if any(line.startswith("FAIL") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
