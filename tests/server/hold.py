"""The test's side of the engine's hold hook (src/tokenmill/fault_hooks.py): a request whose prompt starts with
TOKENMILL_TEST_HOLD_TOKEN takes two steps, then the engine stops before its next step until the test releases it
(`Hold.release()`) or anything asks the engine to abort. While it is held, `held` exists in the folder, so a test
waits for that instead of racing the CPU. A module's server runs with it when the module sets HOLD_TOKEN.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

POLL_S = 0.002


class Hold:
    """The test's side: the folder the server was told about."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def wait_held(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not (self.folder / "held").exists():
            assert time.monotonic() < deadline, f"the engine was not held within {timeout} s"
            time.sleep(POLL_S)

    def release(self) -> None:
        """End the hold, if the engine is held (a hold that begins later deletes a release left behind)."""
        if self.is_held:
            (self.folder / "release").touch()

    @contextlib.contextmanager
    def releasing(self) -> Iterator[None]:
        """Release every hold that begins while the block runs: for a test whose requests need not stop midway."""
        done = threading.Event()

        def release_each() -> None:
            while not done.wait(POLL_S):
                self.release()

        worker = threading.Thread(target=release_each, daemon=True)
        worker.start()
        try:
            yield
        finally:
            done.set()
            worker.join()

    @property
    def is_held(self) -> bool:
        return (self.folder / "held").exists()


def hold_env(token: int, folder: Path) -> dict[str, str]:
    return {"TOKENMILL_TEST_HOLD_TOKEN": str(token), "TOKENMILL_TEST_HOLD_DIR": str(folder)}
