"""Server test fixtures: the tiny checkpoint, one module-scoped server, and the offline engine for expectations."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.server.helpers import Server, running
from tokenmill import LLM


@pytest.fixture(scope="session")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("qwen2", initializer_range=0.1)  # max_position_embeddings=512


@pytest.fixture(scope="module")
def server(
    request: pytest.FixtureRequest, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """One server per module; a module may set SERVER_FLAGS (extra CLI flags), SERVER_ENV and SERVED_MODEL_NAME."""
    flags = getattr(request.module, "SERVER_FLAGS", ())
    name = getattr(request.module, "SERVED_MODEL_NAME", None)
    env = getattr(request.module, "SERVER_ENV", None)
    with running(checkpoint, tmp_path_factory.mktemp("server"), *flags, served_name=name, env=env) as s:
        yield s


@pytest.fixture(scope="session")
def llm(checkpoint: Path) -> LLM:
    return LLM(str(checkpoint), dtype="float32")
