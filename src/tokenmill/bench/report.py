"""`tokenmill bench report RUN_DIR...`: one markdown table and one PNG comparing finished runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _load(run_dir: Path) -> dict[str, Any]:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    summary = json.loads((run_dir / "summary" / "summary.json").read_text())
    return {"dir": run_dir, "manifest": manifest, "summary": summary}


def _numbers(summary: Any) -> dict[str, float]:
    """The scalar figures of a summary (nested dicts flattened; lists of rows summarised by their first row)."""
    out: dict[str, float] = {}

    def walk(d: Any, prefix: str) -> None:
        if isinstance(d, dict):
            for k, v in d.items():
                walk(v, f"{prefix}{k}.")
        elif isinstance(d, int | float) and not isinstance(d, bool):
            out[prefix.rstrip(".")] = float(d)

    walk(summary if isinstance(summary, dict) else {}, "")
    return out


def build_report(run_dirs: list[Path], out_dir: Path) -> Path:
    runs = [_load(d) for d in run_dirs]
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        "# tokenmill benchmark report\n",
        "| run | workload | backend | model | headline |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        m = r["manifest"]
        h = m.get("headline") or {}
        value = f"{h.get('value', float('nan')):.2f} {h.get('unit', '')}".strip()
        lines.append(
            f"| {m['id']} | {m['workload']} | {m.get('backend', '-')} | {Path(str(m.get('model', '-'))).name} "
            f"| {h.get('name', '-')}: {value} |"
        )
    shared = set.intersection(*(set(_numbers(r["summary"])) for r in runs)) if runs else set()
    if len(runs) > 1 and shared:
        keys = sorted(shared)[:12]
        lines += [
            "",
            "| figure | " + " | ".join(r["manifest"]["id"] for r in runs) + " |",
            "|---" * (len(runs) + 1) + "|",
        ]
        for k in keys:
            lines.append(f"| {k} | " + " | ".join(f"{_numbers(r['summary'])[k]:.3g}" for r in runs) + " |")
    for r in runs:
        lines += ["", f"## {r['manifest']['id']}", "", (r["dir"] / "report.md").read_text().strip()]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines) + "\n")
    _plot(runs, out_dir / "headlines.png")
    return report


def _label(manifest: dict[str, Any]) -> str:
    """What tells runs apart on a plot: backend, then workload and (serve) concurrency."""
    conc = (manifest.get("config") or {}).get("max_concurrency")
    return f"{manifest.get('backend') or manifest['id']}\n{manifest.get('workload', '')}{f' c{conc}' if conc else ''}"


def _plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4, 1.5 * len(runs)), 3.5))
    labels = [_label(r["manifest"]) for r in runs]
    values = [(r["manifest"].get("headline") or {}).get("value", 0.0) for r in runs]
    ax.bar(labels, values)
    ax.set_ylabel(", ".join(sorted({(r["manifest"].get("headline") or {}).get("name", "") for r in runs})))
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_report_parser(sub: Any) -> None:
    p = sub.add_parser("report", help="a markdown table and PNG plots comparing runs")
    p.add_argument("runs", nargs="+", help="run folders")
    p.add_argument("--out", default=None, help="where to write report.md and plots (default: bench-results/report)")


def run_report(args: argparse.Namespace) -> Path:
    dirs = [Path(d) for d in args.runs]
    missing = [str(d) for d in dirs if not (d / "manifest.json").is_file()]
    if missing:
        raise ValueError(f"not a benchmark run folder (no manifest.json): {', '.join(missing)}")
    out = Path(args.out) if args.out else dirs[0].parent / "report"
    path = build_report(dirs, out)
    print(path.read_text())
    return path
