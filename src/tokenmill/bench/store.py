"""One self-contained folder per benchmark run, plus a row per run in `index.csv`:

bench-results/
  index.csv
  <workload>_<YYYYmmdd_HHMMSS>/
    manifest.json            command, git commit, config, model + dtype, machine, library versions, warmup
    raw/trials.json|csv      one row per request / trial
    summary/summary.json|csv headline figures
    plots/*.png
    report.md
"""

from __future__ import annotations

import csv
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

INDEX_FIELDS = ["id", "time", "workload", "model", "backend", "headline", "value", "unit", "path"]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_facts() -> dict[str, Any]:
    """What a reader needs to judge the numbers: the machine and the library versions."""
    import psutil

    facts: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
    }
    # NOTE: versions from the installed metadata: importing llama_cpp would load (or fail to load) its library
    for lib, dist in (("torch", "torch"), ("transformers", "transformers"), ("tokenmill", "tokenmill"),
                      ("llama_cpp", "llama_cpp_python")):  # fmt: skip
        try:
            facts[f"{lib}_version"] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            facts[f"{lib}_version"] = None
    try:
        import torch

        facts["torch_threads"] = torch.get_num_threads()
        facts["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return facts


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in row.items()})


@dataclass
class Run:
    """A run folder being filled. Create with `Run.create`, then `save_raw`, `save_summary`, `finish`."""

    root: Path
    path: Path
    workload: str
    manifest: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(cls, output_dir: str | Path, workload: str, config: dict[str, Any]) -> Run:
        root = Path(output_dir)
        stamp = time.strftime("%Y%m%d_%H%M%S")
        path = root / f"{workload}_{stamp}"
        suffix = 1
        while path.exists():  # two runs in the same second
            suffix += 1
            path = root / f"{workload}_{stamp}_{suffix}"
        for sub in ("raw", "summary", "plots"):
            (path / sub).mkdir(parents=True, exist_ok=True)
        manifest = {
            "id": path.name,
            "workload": workload,
            "command": " ".join(sys.argv),
            "git_commit": _git_commit(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": config,
            "machine": machine_facts(),
        }
        run = cls(root, path, workload, manifest)
        run._write_manifest()
        return run

    def _write_manifest(self) -> None:
        (self.path / "manifest.json").write_text(json.dumps(self.manifest, indent=2, default=str))

    def save_raw(self, rows: list[dict[str, Any]]) -> None:
        (self.path / "raw" / "trials.json").write_text(json.dumps(rows, indent=1, default=str))
        if rows:
            _write_rows(self.path / "raw" / "trials.csv", rows)

    def save_summary(self, summary: dict[str, Any] | list[dict[str, Any]]) -> None:
        (self.path / "summary" / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        rows = summary if isinstance(summary, list) else [_flatten(summary)]
        if rows:
            _write_rows(self.path / "summary" / "summary.csv", [_flatten(r) for r in rows])

    def plot_path(self, name: str) -> Path:
        return self.path / "plots" / name

    def finish(self, report_md: str, headline: tuple[str, float, str], model: str, backend: str, **extra: Any) -> Path:
        """Write report.md, close the manifest and append one row to index.csv."""
        (self.path / "report.md").write_text(report_md)
        name, value, unit = headline
        self.manifest.update(
            finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            model=model,
            backend=backend,
            headline={"name": name, "value": value, "unit": unit},
            **extra,
        )
        self._write_manifest()
        index = self.root / "index.csv"
        new = not index.exists()
        with index.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=INDEX_FIELDS)
            if new:
                writer.writeheader()
            writer.writerow(
                {
                    "id": self.path.name,
                    "time": self.manifest["started"],
                    "workload": self.workload,
                    "model": model,
                    "backend": backend,
                    "headline": name,
                    "value": round(value, 4),
                    "unit": unit,
                    "path": str(self.path),
                }
            )
        return self.path


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{key}."))
        else:
            flat[key] = v
    return flat
