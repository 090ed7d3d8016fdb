"""The README's Python snippets run as written, extracted from the README itself so that they cannot drift:
the OpenAI client one against a real `tokenmill serve` of the built-in model (its port swapped for a free one),
the offline one in this process."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.helpers import Server, running
from tokenmill.assembly.model import DEMO_MODEL

README = Path(__file__).resolve().parents[2] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(DEMO_MODEL, tmp_path_factory.mktemp("readme"), served_name="tokenmill-demo") as s:
        yield s


def test_the_readme_has_its_snippets() -> None:
    assert len(SNIPPETS) >= 2 and any("OpenAI(" in s for s in SNIPPETS) and any("LLM(" in s for s in SNIPPETS)


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_each_snippet_runs_as_written(index: int, demo_server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    code = SNIPPETS[index].replace("http://127.0.0.1:8000", demo_server.url)
    exec(compile(code, f"README.md snippet {index}", "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out.strip()  # every snippet prints what it made
