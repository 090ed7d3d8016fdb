"""`tokenmill bench <latency|throughput|serve|compare|sweep|report|probe|start>`: parsers and dispatch."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenmill.errors import TokenmillError

SUBCOMMANDS = ("latency", "throughput", "serve", "compare", "sweep", "report", "probe", "start")
BENCH_HELP = "measure: latency, throughput, serve, compare, sweep, report, probe, start"


def add_bench_parser(sub: Any, engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    bench = sub.add_parser("bench", help=BENCH_HELP)
    bsub = bench.add_subparsers(dest="bench_command", required=True, parser_class=type(bench))
    from tokenmill.bench.compare import add_compare_parser
    from tokenmill.bench.latency import add_latency_parser
    from tokenmill.bench.throughput import add_throughput_parser

    add_latency_parser(bsub, engine_args)
    add_throughput_parser(bsub, engine_args)
    add_compare_parser(bsub)
    from tokenmill.bench.report import add_report_parser
    from tokenmill.bench.sweep import add_sweep_parser

    add_sweep_parser(bsub, engine_args)
    add_report_parser(bsub)
    from tokenmill.bench.serve_args import add_serve_parser

    add_serve_parser(bsub)
    from tokenmill.bench.probe import add_probe_parser

    add_probe_parser(bsub)
    from tokenmill.bench.start import add_start_parser

    add_start_parser(bsub)


def require_bench_extra() -> None:
    """Every bench mode draws plots: say how to install matplotlib (the `bench` extra) in one line."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise TokenmillError(
            "tokenmill bench draws its plots with matplotlib, which is not installed: pip install 'tokenmill[bench]'"
        ) from None


def run_bench(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> Path | None:
    if args.bench_command == "probe":  # prints, draws nothing: no matplotlib needed
        from tokenmill.bench.probe import run_probe

        run_probe(args)
        return None
    if args.bench_command == "start":  # prints, draws nothing
        from tokenmill.bench.start import run_start

        run_start(args)
        return None
    require_bench_extra()
    if args.bench_command == "latency":
        from tokenmill.bench.latency import run_latency

        return run_latency(args, engine_kwargs)
    if args.bench_command == "throughput":
        from tokenmill.bench.throughput import run_throughput

        return run_throughput(args, engine_kwargs)
    if args.bench_command == "serve":
        from tokenmill.bench.serve_run import run_serve

        return run_serve(args)
    if args.bench_command == "compare":
        from tokenmill.bench.compare import run_compare

        return run_compare(args)
    if args.bench_command == "sweep":
        from tokenmill.bench.sweep import run_sweep

        return run_sweep(args, engine_kwargs)
    if args.bench_command == "report":
        from tokenmill.bench.report import run_report

        return run_report(args)
    raise ValueError(f"bench {args.bench_command!r} is unknown; allowed: {', '.join(SUBCOMMANDS)}")
