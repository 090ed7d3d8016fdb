"""`tokenmill serve model.gguf`: a Q8_0 GGUF (exported here from the tiny checkpoint) served to the official
`openai` client, completions and chat, streaming and not, equal to the offline engine on the same file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.server.helpers import Server, offline, offline_chat, running
from tokenmill import LLM
from tokenmill.bench.gguf_export import export_gguf

MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def gguf_file(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_gguf(checkpoint, tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf", "q8_0")


@pytest.fixture(scope="module")
def gguf_server(gguf_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(gguf_file, tmp_path_factory.mktemp("server")) as s:
        yield s


def test_a_q8_0_gguf_serves_to_the_openai_client(gguf_server: Server, gguf_file: Path) -> None:
    client = openai.OpenAI(base_url=f"{gguf_server.url}/v1", api_key="x", timeout=60, max_retries=0)
    assert [m.id for m in client.models.list().data] == [gguf_server.model]
    llm = LLM(str(gguf_file), dtype="float32")
    assert llm.loaded.kernels.get("q8_0")  # the file's blocks, in the int8 kernels

    want = offline(llm, "To be, or not to be", 12)
    got = client.completions.create(model=gguf_server.model, prompt="To be, or not to be", max_tokens=12,
                                    temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert got.choices[0].text == want.text

    chat_want = offline_chat(llm, MESSAGES, 10)
    stream = client.chat.completions.create(model=gguf_server.model, messages=MESSAGES, max_tokens=10,  # type: ignore[arg-type]
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat_want.text  # the chat template stored in the GGUF
