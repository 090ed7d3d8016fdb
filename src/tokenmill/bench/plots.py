"""Small matplotlib helpers shared by the bench subcommands (Agg backend: files only, no screen)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def cdf_plot(
    path: Path, series: dict[str, Sequence[float]], xlabel: str, title: str, ylabel: str = "fraction of requests"
) -> None:
    """One empirical CDF line per series; a legend when the series have names; "no data" when all are empty."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, values in series.items():
        xs = sorted(values)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name or None)
    if not any(series.values()):
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(True, alpha=0.3)
    if any(name for name, values in series.items() if values):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
