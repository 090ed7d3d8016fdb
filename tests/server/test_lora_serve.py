"""LoRA adapters over HTTP: a real server started with two adapters (`--lora-modules`), driven by the openai client.

Each adapter and the base model answer as the offline engine does with the same adapter; adapters load and unload at
run time (vLLM's endpoints); bad input is one clear 4xx naming what exists, and the server serves on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.lora_adapters import make_adapter
from tests.server.helpers import Server, running
from tests.server.hold import Hold, hold_env
from tokenmill import LLM, SamplingParams

pytest.importorskip("peft", reason="peft (the dev extra) makes the adapters")

HOLD_TOKEN = 8  # a prompt starting with it is held mid-request (tests/server/hold.py); no text prompt here does
PROMPT = "The quick brown fox"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    return {
        "sql": make_adapter(checkpoint, folder / "sql", ALL, 8, 16, seed=1),
        "chat": make_adapter(checkpoint, folder / "chat", ["q_proj", "v_proj"], 4, 8, seed=2),
        "late": make_adapter(checkpoint, folder / "late", ["o_proj", "down_proj"], 8, 8, seed=3),
        "wide": make_adapter(checkpoint, folder / "wide", ["q_proj"], 16, 16, seed=4),  # above --max-lora-rank 8
    }


@pytest.fixture(scope="module")
def hold(tmp_path_factory: pytest.TempPathFactory) -> Hold:
    return Hold(tmp_path_factory.mktemp("hold"))


@pytest.fixture(scope="module")
def server(
    checkpoint: Path, adapters: dict[str, Path], hold: Hold, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    modules = [f"{name}={adapters[name]}" for name in ("sql", "chat")]
    with running(checkpoint, tmp_path_factory.mktemp("server"), "--lora-modules", *modules, "--max-lora-rank", "8",
                 served_name="base", env=hold_env(HOLD_TOKEN, hold.folder)) as s:  # fmt: skip
        yield s


@pytest.fixture(scope="module")
def offline(checkpoint: Path, adapters: dict[str, Path]) -> Callable[[str | None], str]:
    """The offline engine's greedy text for PROMPT with an adapter (None: the base model)."""
    llm = LLM(str(checkpoint), dtype="float32", lora_modules={n: str(adapters[n]) for n in ("sql", "chat", "late")})

    def text(lora: str | None) -> str:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        return llm.generate([PROMPT], params, lora_request=lora)[0].outputs[0].text

    return text


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _complete(server: Server, model: str) -> openai.types.Completion:
    return _client(server).completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True})  # fmt: skip


def _load(server: Server, name: str, path: Path | str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      timeout=60)  # fmt: skip


def _unload(server: Server, name: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    return str(response.json()["error"]["message"])


def test_models_lists_the_adapters_with_the_base_as_parent(server: Server, adapters: dict[str, Path]) -> None:
    cards = {m.id: m for m in _client(server).models.list().data}
    assert set(cards) >= {"base", "sql", "chat"}
    assert cards["sql"].model_extra is not None and cards["sql"].model_extra["parent"] == "base"
    assert cards["chat"].model_extra is not None and cards["chat"].model_extra["root"] == str(adapters["chat"])
    assert cards["base"].model_extra is not None and cards["base"].model_extra["status"] == "loaded"
    assert _client(server).models.retrieve("sql").id == "sql"


def test_each_adapter_and_the_base_answer_as_the_offline_engine(
    server: Server, offline: Callable[[str | None], str]
) -> None:
    texts = {}
    for model, lora in (("base", None), ("sql", "sql"), ("chat", "chat")):
        out = _complete(server, model)
        assert out.model == model
        texts[model] = out.choices[0].text
        assert texts[model] == offline(lora)
    assert len(set(texts.values())) == 3, "each adapter must change the completion"


def test_chat_names_the_adapter_as_its_model(server: Server) -> None:
    out = _client(server).chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4, temperature=0)  # fmt: skip
    assert out.model == "chat" and out.choices[0].finish_reason in ("stop", "length")


def test_responses_and_messages_take_an_adapter_as_their_model(server: Server) -> None:
    response = _client(server).responses.create(model="sql", input="hi", max_output_tokens=4, temperature=0)
    assert response.model == "sql"
    r = httpx.post(f"{server.url}/v1/messages", json={"model": "chat", "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert r.status_code == 200 and r.json()["model"] == "chat", r.text


def test_an_unknown_model_is_404_naming_what_is_served(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        _complete(server, "nope")
    assert "base, sql, chat" in str(e.value)


def test_load_use_and_unload_at_run_time(
    server: Server, adapters: dict[str, Path], offline: Callable[[str | None], str]
) -> None:
    assert _load(server, "late", adapters["late"]).status_code == 200
    out = _complete(server, "late")
    assert out.model == "late" and out.choices[0].text == offline("late")
    assert "late" in {m.id for m in _client(server).models.list().data}
    assert _unload(server, "late").status_code == 200
    assert "late" not in {m.id for m in _client(server).models.list().data}
    with pytest.raises(openai.NotFoundError):
        _complete(server, "late")


@pytest.mark.parametrize(
    ("case", "status", "needle"),
    [
        ("taken", 400, "already loaded"),
        ("missing", 400, "is not a folder"),
        ("corrupt", 400, "not a readable safetensors"),
        ("bad-json", 400, "not valid JSON"),
        ("rank", 400, "exceeds --max-lora-rank 8"),
        ("other-base", 400, "another base model"),
        ("dora", 400, "use_dora=True is not supported"),
    ],
)
def test_a_bad_load_is_a_clear_4xx_and_harms_nothing(
    server: Server, adapters: dict[str, Path], make_checkpoint: Callable[..., Path], tmp_path: Path, case: str,
    status: int, needle: str,
) -> None:  # fmt: skip
    path: Path = adapters["sql"]
    if case in ("corrupt", "bad-json", "dora"):
        path = tmp_path / case
        path.mkdir()
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            (path / f).write_bytes((adapters["chat"] / f).read_bytes())
        if case == "corrupt":
            (path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
        elif case == "bad-json":
            (path / "adapter_config.json").write_text("{")
        else:
            config = json.loads((path / "adapter_config.json").read_text())
            (path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    elif case == "missing":
        path = tmp_path / "nowhere"
    elif case == "rank":
        path = adapters["wide"]
    elif case == "other-base":
        other = make_checkpoint("qwen2", hidden_size=32, initializer_range=0.1)
        path = make_adapter(other, tmp_path / "other", ["q_proj"], 4, 8)
    name = "sql" if case == "taken" else f"new-{case}"
    assert needle in _error(_load(server, name, path), status)
    assert name == "sql" or name not in {m.id for m in _client(server).models.list().data}
    assert _complete(server, "sql").model == "sql"  # the server serves on


def test_unloading_an_unknown_adapter_is_404(server: Server) -> None:
    assert "loaded: sql, chat" in _error(_unload(server, "ghost"), 404)


def test_unloading_an_adapter_in_use_is_refused_with_409(server: Server, hold: Hold) -> None:
    """A request runs with "chat" and is held mid-way: unloading "chat" is refused (not waited for); once the
    request ends, the same unload succeeds."""
    result: dict[str, int] = {}

    def held_request() -> None:
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": "chat", "prompt": [HOLD_TOKEN, 5, 6], "max_tokens": 6, "ignore_eos": True},
            timeout=120,
        )
        result["status"] = r.status_code

    thread = threading.Thread(target=held_request)
    thread.start()
    try:
        hold.wait_held()
        assert "is in use by unfinished requests" in _error(_unload(server, "chat"), 409)
    finally:
        hold.release()
        thread.join(timeout=120)
    assert result["status"] == 200
    assert _unload(server, "chat").status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(server, "chat")


def test_adapters_refuse_embeddings_by_name(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": "sql", "input": "hi"})
    assert "applies to text generation only" in _error(r, 400)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--lora-modules", "x=/nonexistent/adapter"], "x=/nonexistent/adapter: /nonexistent/adapter does not exist"),
        (["--lora-modules", "no-equals-sign"], "is not NAME=PATH"),
        (["--enable-lora", "--tensor-parallel-size", "2"], "not supported with tensor_parallel_size > 1"),
        (["--enable-lora", "--data-parallel-size", "2"], "do not run with --data-parallel-size > 1"),
    ],
)
def test_bad_lora_flags_are_one_line(checkpoint: Path, flags: list[str], needle: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "tokenmill", "serve", str(checkpoint), *flags], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
