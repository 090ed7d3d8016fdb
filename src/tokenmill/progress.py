"""Progress for long commands (model loading, make-model, bench runs): a rich bar on stderr while a person
watches, nothing when stderr is not a terminal (logs, pipes, tests) or TOKENMILL_NO_PROGRESS is set.

    with progress("loading weights", total=None) as advance:
        for tensor in tensors:
            ...
            advance()
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def shown() -> bool:
    return sys.stderr.isatty() and not os.environ.get("TOKENMILL_NO_PROGRESS")


@contextmanager
def progress(description: str, total: int | None = None) -> Iterator[Callable[..., None]]:
    """A bar (or, without a total, a spinner and a count) that `advance(n=1)` moves; removed when done."""
    if not shown():
        yield lambda n=1: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn()]  # fmt: skip
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)
