"""A test-side launcher that can hold the engine of a real server mid-request, so a test never races the CPU.

`python tests/server/hold.py tokenmill serve ...` (helpers' `launch(..., launcher=HOLD_LAUNCHER)`) runs the
server as `python -m tokenmill` does, with one thing added (nothing changes in the engine's source): a request
whose prompt starts with the token id in TOKENMILL_TEST_HOLD_TOKEN takes HOLD_STEPS engine steps, then the
engine stops before its next step (every request waits with it) until either
- the test creates `release` in TOKENMILL_TEST_HOLD_DIR (`Hold.release()`), or
- anyone asks the engine to abort (a client that went away, the end of a grace period): the abort then lands
  while the held request is still unfinished, however fast the CPU.
While the engine is held, `held` exists in that folder (`Hold.wait_held()`). A hold ends after HOLD_TIMEOUT_S
seconds in any case, so a failing test cannot hang the server. Each request with the token is held once.

The hook wraps `ModelRunner.check_fault`, the runner's existing test hook that every step (tensor-parallel rank
0's too) calls before any work, and `AsyncEngine.abort` / `abort_all`. An engine-side hook of this kind
(see the report that added this file) would let these tests drop the wrapper.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

HOLD_STEPS = 2  # steps the held request gets first (its prefill, one decode): its first tokens are out
HOLD_TIMEOUT_S = 120.0
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

    @property
    def is_held(self) -> bool:
        return (self.folder / "held").exists()


def hold_env(token: int, folder: Path) -> dict[str, str]:
    return {"TOKENMILL_TEST_HOLD_TOKEN": str(token), "TOKENMILL_TEST_HOLD_DIR": str(folder)}


HOLD_LAUNCHER = [sys.executable, str(Path(__file__).resolve())]


def _install() -> None:
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.runner import ModelRunner

    token = int(os.environ["TOKENMILL_TEST_HOLD_TOKEN"])
    folder = Path(os.environ["TOKENMILL_TEST_HOLD_DIR"])
    aborted = threading.Event()
    steps: list[int] = []  # steps since a held request's prefill; empty: none to hold

    def wait() -> None:
        held, release = folder / "held", folder / "release"
        release.unlink(missing_ok=True)  # a release left over from an earlier hold
        aborted.clear()
        held.touch()
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        try:
            while not (release.exists() or aborted.is_set() or time.monotonic() > deadline):
                time.sleep(POLL_S)
        finally:
            release.unlink(missing_ok=True)
            held.unlink(missing_ok=True)

    original_check = ModelRunner.check_fault

    def check_fault(self: ModelRunner, batch) -> None:  # type: ignore[no-untyped-def]
        original_check(self, batch)
        if steps:
            steps[0] += 1
            if steps[0] >= HOLD_STEPS:
                steps.clear()
                wait()
        if any(s.start == 0 and s.token_ids and s.token_ids[0] == token for s in batch.sequences):
            steps[:] = [0]

    def with_release(method):  # type: ignore[no-untyped-def]
        def wrapped(self, *args):  # type: ignore[no-untyped-def]
            method(self, *args)  # queued first: the held step ends, then the loop applies it
            aborted.set()

        return wrapped

    ModelRunner.check_fault = check_fault  # type: ignore[method-assign]
    AsyncEngine.abort = with_release(AsyncEngine.abort)  # type: ignore[method-assign]
    AsyncEngine.abort_all = with_release(AsyncEngine.abort_all)  # type: ignore[method-assign]


if __name__ == "__main__":
    import runpy

    sys.path.pop(0)  # this folder: `tests/server` must not shadow anything
    if "TOKENMILL_TEST_HOLD_TOKEN" in os.environ:
        _install()
    sys.argv = [sys.argv[1], *sys.argv[2:]]  # `tokenmill serve ...` -> as `python -m tokenmill serve ...` sees it
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
