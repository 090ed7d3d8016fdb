"""The machine's arithmetic peaks, and a run's model GFLOPS against them: where bandwidth.py judges a decode by the
bytes it streams, this judges a batched run (16 streams, long prompts) by the multiply-adds it does.

The probe (`peak_gflops`, `compute_peaks`) runs the C++ kernels' `peak_probe` (kernels/csrc/ops/peak.h): every
thread of torch's pool (the threads the model runs on) runs independent accumulator chains of one instruction, and
the call returns the operations done, counted exactly (a multiply-add is 2). One peak per instruction this build of
the kernels and this CPU have: the widest float32 FMA always; vdpbf16ps (AVX-512 BF16), vpdpbusd (VNNI: the int8,
int4 and K-quant kernels' products) and the AMX tiles where there are.

A run's model GFLOPS (`model_flops`) counts the linears' multiply-adds only, 2 operations each: every prompt token,
and every generated token but each request's last, passes through every layer's linears (`body` parameters); every
generated token through the LM head (`head` parameters: a prefill computes logits at its last position only).
Attention's products (QK^T, PV) and the norms are left out, so the figure is a lower bound on the work done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

FMA = 0  # kernels/csrc/ops/peak.h: PeakKind::kFma


@dataclass(frozen=True)
class Peak:
    instruction: str  # "vfmadd231ps ymm", "vpdpbusd zmm", "tdpbf16ps (AMX)", ...
    operands: str  # what is multiplied: "float32", "int8 products into int32", ...
    giga_ops: float  # the best of the repeats: 1e9 operations a second, a multiply-add being 2
    threads: int  # torch's threads, one task each


def compute_peaks(repeats: int = 3, seconds: float = 0.2) -> list[Peak]:
    """Every peak this CPU's kernels can probe, each the best of `repeats` runs of ~`seconds`; [] where no kernels
    are built (the pure-torch path)."""
    from tokenmill import kernels

    ops = kernels.active()
    if ops is None:
        return []
    return [
        _probe(ops.module, kind, name, operands, repeats, seconds) for kind, name, operands in ops.module.peak_kinds()
    ]


def peak_gflops(repeats: int = 3, seconds: float = 0.2) -> float | None:
    """The float32 FMA peak of torch's threads, GFLOPS (best of `repeats`); None without compiled kernels."""
    from tokenmill import kernels

    ops = kernels.active()
    if ops is None:
        return None
    name, operands = next((n, o) for k, n, o in ops.module.peak_kinds() if k == FMA)
    return _probe(ops.module, FMA, name, operands, repeats, seconds).giga_ops


def _probe(module: ModuleType, kind: int, name: str, operands: str, repeats: int, seconds: float) -> Peak:
    """Rounds per thread grown until a call takes a quarter of `seconds`, scaled to `seconds`, then the best of
    `repeats` calls: operations over wall time."""
    import torch

    iters, elapsed = 256, 0.0
    while elapsed < seconds / 4 and iters < 2**40:
        iters *= 4
        elapsed = _timed(module, kind, iters)[1]
    iters = max(1, int(iters * seconds / max(elapsed, 1e-9)))
    best = 0.0
    for _ in range(repeats):
        done, took = _timed(module, kind, iters)
        best = max(best, done / took / 1e9)
    return Peak(name, operands, best, torch.get_num_threads())


def _timed(module: ModuleType, kind: int, iters: int) -> tuple[int, float]:
    start = time.perf_counter()
    done, _ = module.peak_probe(kind, iters, 1.0)
    return int(done), max(time.perf_counter() - start, 1e-9)


def model_flops(body_params: int, head_params: int, prompt_tokens: int, output_tokens: int, requests: int) -> int:
    """Operations of a run's linears: 2 x (body_params x the tokens through the layers + head_params x the tokens
    through the LM head). Through the layers: every prompt token and every generated one but each request's last
    (nothing is computed from it); through the head: every generated token. Prefix-cache hits count as computed."""
    if min(body_params, head_params, prompt_tokens, output_tokens, requests) < 0:
        raise ValueError("parameters, tokens and requests must be >= 0")
    layer_tokens = prompt_tokens + max(0, output_tokens - requests)
    return 2 * (body_params * layer_tokens + head_params * output_tokens)


def peak_shares(gflops: float, peaks: list[Peak]) -> list[tuple[Peak, float]]:
    """Each peak with the share of it that `gflops` is (0.42: 42%)."""
    return [(p, gflops / p.giga_ops) for p in peaks if p.giga_ops > 0]


def matmul_params(model_ref: str) -> tuple[int, int]:
    """(body, head): the multiply-adds a token costs in the layers' linears and in the LM head, from the model's
    config alone (its modules built on the meta device: no weight is read). A tied head counts as the head."""
    import torch

    from tokenmill.assembly.model import read_checkpoint
    from tokenmill.config import EngineConfig
    from tokenmill.models import family_for
    from tokenmill.models.linear import Linear

    _, _, hf_config, config = read_checkpoint(EngineConfig(model=model_ref))
    with torch.device("meta"):
        model = family_for(hf_config).model_class(config)
    head = model.lm_head.weight.numel()
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head)
    return body, head


def flops_summary(body: int, head: int, prompt_tokens: int, output_tokens: int, requests: int, duration_s: float,
                  peaks: list[Peak]) -> dict[str, Any]:  # fmt: skip
    """A run's summary fields: its model GFLOPS and each peak's share (a bench's report prints them)."""
    flops = model_flops(body, head, prompt_tokens, output_tokens, requests)
    gflops = flops / max(duration_s, 1e-9) / 1e9
    return {
        "matmul_params": {"body": body, "head": head},
        "model_gflops": gflops,
        "peaks": [{**vars(p), "share": share} for p, share in peak_shares(gflops, peaks)],
    }


def report_rows(summary: dict[str, Any]) -> list[str]:
    """A report's table rows (two columns): the model GFLOPS, then its share of each peak, named by instruction."""
    rows = [f"| model GFLOPS (linears; formula below) | {summary['model_gflops']:.1f} |"]
    for p in summary["peaks"]:
        unit = "GFLOPS" if "float" in p["operands"] else "GOPS"
        rows.append(f"| share of the {p['instruction']} peak ({p['giga_ops']:.0f} {unit}, {p['threads']} threads) "
                    f"| {p['share']:.0%} |")  # fmt: skip
    return rows


def fma_share(summary: dict[str, Any]) -> str:
    """`41.2 (27% of vfmadd231ps zmm)`: the model GFLOPS and its share of the float32 FMA peak, for a table cell."""
    fma = next((p for p in summary["peaks"] if p["operands"] == "float32"), None)
    return f"{summary['model_gflops']:.1f}" + (f" ({fma['share']:.0%} of {fma['instruction']})" if fma else "")


def flops_basis(model: str, threads: int | None) -> dict[str, Any]:
    """What a run's model GFLOPS are computed from: the model's matmul parameters (from its config) and this
    machine's arithmetic peaks on `threads` threads (the server's; default torch's own count), probed now, before
    any request (the server idle)."""
    import torch

    body, head = matmul_params(model)
    if threads:
        torch.set_num_threads(threads)
    return {"body": body, "head": head, "peaks": [vars(p) for p in compute_peaks()]}


def run_flops(basis: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """A serve run's model GFLOPS and shares, from its completed requests' tokens over its duration."""
    peaks = [Peak(**p) for p in basis["peaks"]]
    return flops_summary(basis["body"], basis["head"], summary["total_input_tokens"], summary["total_output_tokens"],
                         summary["requests_completed"], summary["duration_s"], peaks)  # fmt: skip


FORMULA = (
    "model GFLOPS = 2 x (layer linear parameters x (prompt tokens + generated tokens - requests) + LM head "
    "parameters x generated tokens) / duration; attention's products are left out; each peak: the best of 3 runs of "
    "`tokenmill.bench.flops` (independent chains of one instruction on torch's threads, a multiply-add = 2)"
)
