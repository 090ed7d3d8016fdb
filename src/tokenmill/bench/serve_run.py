"""`tokenmill bench serve`'s entry: the chosen workload (or each in turn for `all`) against `--url`, then against each
`--server-peers` server. The streaming workloads run in serve.py; `agent` (agent.py), `embed` (embed.py) and `switch`
(switch.py) have their own drivers."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenmill.bench.agent import run_agent
from tokenmill.bench.embed import run_embed
from tokenmill.bench.flops import flops_basis
from tokenmill.bench.mixed import run_mixed
from tokenmill.bench.serve import WORKLOADS, parse_goodput, run_workload
from tokenmill.bench.serve_peers import parse_peers, peer_args, side_by_side
from tokenmill.bench.switch import run_switch

OWN_DRIVERS = ("agent", "embed", "switch")


def run_serve(args: argparse.Namespace) -> Path:
    """The run folder (the last one), or with peers the side-by-side table."""
    parse_goodput(args.goodput)  # fail fast on a bad spec
    peers = parse_peers(args.server_peers)
    args.flops_basis = flops_basis(args.flops_model, args.probe_threads) if args.flops_model else None
    skipped = ("custom", *OWN_DRIVERS)  # (not in `all`: their own flags)
    names = [w for w in WORKLOADS if w not in skipped] if args.workload == "all" else [args.workload]
    runs = [_run(args, w) for w in names]
    for label, url, model in peers:
        runs += [_run(peer_args(args, label, url, model), w) for w in names]
    return side_by_side(runs, Path(args.output_dir)) if peers else runs[-1]


def _run(args: argparse.Namespace, workload: str) -> Path:
    if workload == "agent":
        return Path(run_agent(args))
    if workload == "embed":
        return Path(run_embed(args))
    if workload == "switch":
        return run_switch(args)
    if args.embed_rate:  # the workload alone, then with embedding requests beside it
        return run_mixed(args, workload)
    return run_workload(args, workload)
