"""Progress bars: on stderr while a terminal watches, silent otherwise (pipes, logs, these tests)."""

from __future__ import annotations

import io
import sys

import pytest

from tokenmill import progress as p


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_silent_without_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    assert not p.shown()  # pytest captures stderr: not a terminal
    with p.progress("loading", total=3) as advance:
        for _ in range(3):
            advance()
    assert capsys.readouterr() == ("", "")


def test_a_bar_on_a_terminal_unless_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert p.shown()
    with p.progress("loading weights", total=2) as advance:
        advance()
        advance()
    assert "loading weights" in tty.getvalue()
    monkeypatch.setenv("TOKENMILL_NO_PROGRESS", "1")
    assert not p.shown()
