"""`tokenmill bench probe`: the machine's ceilings on torch's threads, the same probes the benches judge runs by:
the memory's read bandwidth (bandwidth.py) and each arithmetic peak the kernels can probe here (flops.py)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tokenmill.bench.arg_types import positive_float, positive_int


def run_probe(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from tokenmill import kernels
    from tokenmill.bench.bandwidth import read_bandwidth_gb_s
    from tokenmill.bench.flops import compute_peaks

    if args.threads:
        torch.set_num_threads(args.threads)
    status = kernels.status()
    result: dict[str, Any] = {
        "cpu": status["cpu"],
        "kernels": status["kernels"],
        "threads": torch.get_num_threads(),
        "read_bandwidth_gb_per_sec": read_bandwidth_gb_s(args.megabytes, args.repeats),
        "peaks": [vars(p) for p in compute_peaks(args.repeats, args.seconds)],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    print(f"{result['cpu']}: {result['kernels']} kernels, {result['threads']} threads (best of {args.repeats})")
    print(f"  memory read bandwidth: {result['read_bandwidth_gb_per_sec']:.1f} GB/s")
    for p in result["peaks"]:
        unit = "GFLOPS" if "float" in p["operands"] else "GOPS"
        print(f"  {p['instruction']:<18} {p['giga_ops']:9.1f} {unit}  ({p['operands']}; a multiply-add = 2)")
    if not result["peaks"]:
        print("  no arithmetic peak: the compiled kernels are not available here (pure-torch path)")
    return result


def add_probe_parser(sub: Any) -> None:
    p = sub.add_parser("probe", help="the memory read bandwidth and the arithmetic peaks of torch's threads")
    p.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own count)")
    p.add_argument("--repeats", type=positive_int, default=3, help="runs of each probe; the best is reported")
    p.add_argument("--seconds", type=positive_float, default=0.2, help="length of one run of an arithmetic probe")
    p.add_argument("--megabytes", type=positive_int, default=1024, help="the bandwidth probe's buffer")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
