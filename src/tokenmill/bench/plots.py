"""Small matplotlib helpers shared by the bench subcommands (Agg backend: files only, no screen)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def cdf_plot(path: Path, series: dict[str, Sequence[float]], xlabel: str, title: str) -> None:
    """One empirical CDF line per named series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, values in series.items():
        xs = sorted(values)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
