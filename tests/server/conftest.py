"""Server test fixtures: the tiny checkpoint, one module-scoped server, and the offline engine for expectations."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.server.helpers import Server, running
from tests.server.hold import Hold, hold_env
from tokenmill import LLM


@pytest.fixture(scope="session")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("qwen2", initializer_range=0.1)  # max_position_embeddings=512


@pytest.fixture(scope="module")
def server(
    request: pytest.FixtureRequest, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """One server per module; a module may set SERVER_FLAGS (extra CLI flags), SERVER_ENV and SERVED_MODEL_NAME,
    and HOLD_TOKEN: the engine holds a request whose prompt starts with that token id (fault_hooks.py; the module's
    tests use the `hold` fixture)."""
    flags = getattr(request.module, "SERVER_FLAGS", ())
    name = getattr(request.module, "SERVED_MODEL_NAME", None)
    env = getattr(request.module, "SERVER_ENV", None)
    token = getattr(request.module, "HOLD_TOKEN", None)
    if token is not None:
        env = {**(env or {}), **hold_env(token, request.getfixturevalue("hold").folder)}
    folder = tmp_path_factory.mktemp("server")
    with running(checkpoint, folder, *flags, served_name=name, env=env) as s:
        yield s


@pytest.fixture(scope="module")
def hold(tmp_path_factory: pytest.TempPathFactory) -> Hold:
    """The test's handle on the module server's hold (tests/server/hold.py; the module sets HOLD_TOKEN)."""
    return Hold(tmp_path_factory.mktemp("hold"))


@pytest.fixture(scope="session")
def llm(checkpoint: Path) -> LLM:
    return LLM(str(checkpoint), dtype="float32")
