"""Hooks that the engine's tests drive through the environment, so that a test of a real server can make one request
fail, or hold it open past any deadline, on a CPU of any speed. Inert unless a variable is set.

- `TOKENMILL_TEST_FAULT_TOKEN=ID`: a step that computes a sequence whose first token is ID raises `InjectedFault`,
  as a kernel failing on one request's input would; with `TOKENMILL_TEST_FAULT_FATAL=1` it raises
  `InjectedFatalFault`, which the engine loop does not survive. In-process tests may also set `fault_token` or
  `fault_request` (a sequence id that raises alike).
- `TOKENMILL_TEST_STEP_DELAY_S=S`: every step first sleeps S seconds (a lower bound on how long a request takes).
- `TOKENMILL_TEST_HOLD_TOKEN=ID` with `TOKENMILL_TEST_HOLD_DIR=DIR`: a request whose prompt starts with ID takes
  `HOLD_AFTER_STEPS` steps (its first tokens are out), then the engine stops before its next step until `DIR/release`
  exists, the engine is asked to abort anything (`release()`: the abort then finds the request unfinished), or
  `HOLD_TIMEOUT_S` pass. While it waits, `DIR/held` exists. Each such request is held once.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from tokenmill.types import ModelInput

HOLD_AFTER_STEPS = 2
HOLD_TIMEOUT_S = 120.0
POLL_S = 0.002


class InjectedFault(RuntimeError):
    """A failure the test hook caused, confined to the requests holding the fault token."""


class InjectedFatalFault(BaseException):
    """A failure the test hook caused that the engine loop must not survive."""


class StepHooks:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        """The hooks `env` (the process's environment by default) sets; StepHooks({}) has none."""
        env = os.environ if env is None else env
        fault, hold = env.get("TOKENMILL_TEST_FAULT_TOKEN", ""), env.get("TOKENMILL_TEST_HOLD_TOKEN", "")
        self.fault_token: int | None = int(fault) if fault.isdigit() else None
        self.fault_fatal = env.get("TOKENMILL_TEST_FAULT_FATAL") == "1"
        self.fault_request: str | None = None
        self.step_delay_s = float(env.get("TOKENMILL_TEST_STEP_DELAY_S") or 0)
        self.hold_token: int | None = int(hold) if hold.isdigit() else None
        self.hold_dir = Path(env.get("TOKENMILL_TEST_HOLD_DIR") or ".")
        self._steps_to_hold: int | None = None  # steps until the hold, counted from a held request's first
        self._released = threading.Event()

    def before_step(self, batch: ModelInput) -> None:
        """Run before a step computes anything: sleep, hold, or raise, as the environment says."""
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if self.hold_token is not None:
            self._count_hold(batch)
        for s in batch.sequences:
            first = s.token_ids[0] if s.start == 0 and s.token_ids else None
            if (self.fault_token is not None and first == self.fault_token) or s.request_id == self.fault_request:
                raise (InjectedFatalFault if self.fault_fatal else InjectedFault)(f"injected fault in {s.request_id}")

    def release(self) -> None:
        """End a hold now (any thread): the engine was asked to abort."""
        self._released.set()

    def _count_hold(self, batch: ModelInput) -> None:
        if self._steps_to_hold is not None:
            self._steps_to_hold -= 1
            if self._steps_to_hold == 0:
                self._steps_to_hold = None
                self._wait()
        if any(s.start == 0 and s.token_ids and s.token_ids[0] == self.hold_token for s in batch.sequences):
            self._steps_to_hold = HOLD_AFTER_STEPS

    def _wait(self) -> None:
        held, release = self.hold_dir / "held", self.hold_dir / "release"
        release.unlink(missing_ok=True)  # one left from an earlier hold
        self._released.clear()
        held.touch()
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        try:
            while not (release.exists() or self._released.is_set() or time.monotonic() > deadline):
                self._released.wait(POLL_S)
        finally:
            release.unlink(missing_ok=True)
            held.unlink(missing_ok=True)
