"""The verdict cache that picks a folder's tokenizer: a folder's first load compares the lean tokenizer with
transformers' and records the verdict; the next loads the lean one without importing transformers (a GGUF's from its
second start), or keeps transformers where they differ; a damaged, missing or unwritable cache changes nothing but
the speed."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import load_twice
from tokenmill.tokenizer import Tokenizer
from tokenmill.tokenizer.verdict import entry_of

SRC = Path(__file__).resolve().parents[2] / "src"
TEXTS = ["Hello world! ünï 日本語 🙂", "e\u0301 A\u030a", "<|im_start|>user\nHi<|im_end|>", "  spaced  out \n"]
LOAD = "import sys; from tokenmill.tokenizer import Tokenizer; tok = Tokenizer(*sys.argv[1:]); " \
       "print(tok.backend.name, 'transformers' in sys.modules)"  # fmt: skip


def load_elsewhere(source: Path, cache: Path, *args: str) -> list[str]:
    """A fresh Python loads `source`'s tokenizer: [its backend's name, whether transformers got imported]."""
    env = {
        **os.environ,
        "TOKENMILL_CACHE_DIR": str(cache),
        "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    done = subprocess.run([sys.executable, "-c", LOAD, str(source), *args], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def with_config(tokenizer_dir: Path, out: Path, **changes: object) -> Path:
    """A copy of the test tokenizer whose tokenizer_config.json has `changes`."""
    folder = shutil.copytree(tokenizer_dir, out)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **changes}))
    return folder


def test_the_second_load_imports_no_transformers(tokenizer_dir: Path, tmp_path: Path) -> None:
    assert load_elsewhere(tokenizer_dir, tmp_path) == ["transformers", "True"]  # compares, and records
    assert load_elsewhere(tokenizer_dir, tmp_path) == ["lean", "False"]
    (entry,) = (p for p in (tmp_path / "tokenizer-verdicts").glob("*.json") if not p.name.endswith(".tokenizer.json"))
    assert json.loads(entry.read_text())["verdict"] == "same"


def test_a_folder_whose_files_change_is_compared_again(tokenizer_dir: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(tokenizer_dir, tmp_path / "tok")
    load_twice(folder, tmp_path / "cache")
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    first, second = load_twice(folder, tmp_path / "cache")
    assert first.apply_chat_template([{"role": "user", "content": "Hi"}]) == first.encode("Hi", False)
    assert second.chat_template_text == "{{ messages[0]['content'] }}"


def test_a_class_that_tokenizes_its_own_way_keeps_transformers(
    tokenizer_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """transformers' CodeGenTokenizer decodes in Python of its own: the verdict is "differs", logged with why, and
    every load goes through transformers."""
    folder = with_config(tokenizer_dir, tmp_path / "codegen", tokenizer_class="CodeGenTokenizer")
    with caplog.at_level(logging.INFO, logger="tokenmill.tokenizer"), pytest.MonkeyPatch.context() as env:
        env.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
        loads = [Tokenizer(folder) for _ in range(2)]
        record = json.loads(entry_of(folder).read_text())
    assert [t.backend.name for t in loads] == ["transformers", "transformers"]
    assert record["verdict"] == "differs" and "CodeGenTokenizer overrides decode" in record["reason"]
    assert "transformers' (the lean one differs: CodeGenTokenizer overrides decode)" in caplog.text
    assert load_elsewhere(folder, tmp_path / "cache") == ["transformers", "True"]


def test_a_class_default_the_files_lack_keeps_transformers(tokenizer_dir: Path, tmp_path: Path) -> None:
    """GPT2Tokenizer sets unk_token when the config names none: the special tokens differ, so transformers."""
    folder = with_config(tokenizer_dir, tmp_path / "gpt2", tokenizer_class="GPT2Tokenizer")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
        assert [Tokenizer(folder).backend.name for _ in range(2)] == ["transformers", "transformers"]
        assert "special tokens" in json.loads(entry_of(folder).read_text())["reason"]


def test_a_tokenizer_transformers_rebuilds_loads_the_rebuilt_one(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Qwen2Tokenizer rebuilds the Rust tokenizer on load (an NFC normalizer, its own split pattern): the rebuilt
    one is kept beside the verdict, and the lean tokenizer encodes as transformers does, NFC included; a damaged
    copy of it means comparing again."""
    folder = with_config(tokenizer_dir, tmp_path / "qwen2", tokenizer_class="Qwen2Tokenizer", unk_token=None)
    hf, lean = load_twice(folder, tmp_path / "cache")
    for text in TEXTS:
        assert lean.encode(text) == hf.encode(text)
    assert hf.encode("e\u0301") == hf.encode("\u00e9")  # the premise: transformers' class normalizes to NFC
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
        kept = entry_of(folder).with_name(entry_of(folder).stem + ".tokenizer.json")
        kept.write_text(kept.read_text()[:1000])
        assert [Tokenizer(folder).backend.name for _ in range(2)] == ["transformers", "lean"]


def test_a_folder_with_pair_merges_keeps_a_quick_copy_of_them(tokenizer_dir: Path, tmp_path: Path) -> None:
    """`tokenizers` writes merges as [a, b] pairs and reads them faster as "a b" strings (backend.quick_json): a
    folder judged alike keeps that form beside its verdict, and the lean tokenizer, reading it, tokenizes as
    transformers does."""
    assert isinstance(json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["merges"][0], list)
    hf, lean = load_twice(tokenizer_dir, tmp_path / "cache")
    assert lean.backend.name == "lean"
    for text in TEXTS:
        assert lean.encode(text) == hf.encode(text)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
        entry = entry_of(tokenizer_dir)
    kept = entry.with_name(json.loads(entry.read_text())["tokenizer_json"])
    merges = json.loads(kept.read_text(encoding="utf-8"))["model"]["merges"]
    assert merges and all(isinstance(m, str) for m in merges)


@pytest.mark.parametrize("damage", ["garbage", "empty", "not a verdict", "deleted"])
def test_a_damaged_or_missing_verdict_is_compared_again(tokenizer_dir: Path, tmp_path: Path, damage: str) -> None:
    load_twice(tokenizer_dir, tmp_path)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
        entry = entry_of(tokenizer_dir)
        if damage == "deleted":
            entry.unlink()
        else:
            entry.write_text({"garbage": "{\x00 not json", "empty": "", "not a verdict": '{"verdict": 1}'}[damage])
        first, second = Tokenizer(tokenizer_dir), Tokenizer(tokenizer_dir)
    assert (first.backend.name, second.backend.name) == ("transformers", "lean")
    assert first.encode(TEXTS[0]) == second.encode(TEXTS[0])


def test_an_unwritable_cache_means_transformers(tokenizer_dir: Path, tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TOKENMILL_CACHE_DIR", str(blocked / "cache"))  # under a file: nothing can be created
        loads = [Tokenizer(tokenizer_dir) for _ in range(2)]
    assert [t.backend.name for t in loads] == ["transformers", "transformers"]
    assert loads[0].encode(TEXTS[0]) == loads[1].encode(TEXTS[0])


def test_a_folder_without_tokenizer_json_keeps_transformers(tokenizer_dir: Path, tmp_path: Path) -> None:
    """A slow tokenizer (vocab.json + merges.txt, no tokenizer.json) loads through transformers every time."""
    from transformers import GPT2Tokenizer

    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]
    folder = tmp_path / "slow"
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps(vocab["vocab"]))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in vocab["merges"]) + "\n")
    GPT2Tokenizer(str(folder / "vocab.json"), str(folder / "merges.txt")).save_pretrained(str(folder))
    (folder / "tokenizer.json").unlink(missing_ok=True)
    assert load_elsewhere(folder, tmp_path / "cache") == ["transformers", "True"]
    assert load_elsewhere(folder, tmp_path / "cache") == ["transformers", "True"]


def test_a_gguf_tokenizer_loads_lean_from_its_second_start(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """A file whose tokenizer gguf_bpe does not build (a llama file with GPT-2's split): the first start builds it
    with transformers, keeps it as a folder and compares the lean tokenizer with it; the second start imports no
    transformers, and tokenizes as the first."""
    from tokenmill.bench.gguf_export import export_gguf

    path = export_gguf(make_checkpoint("llama"), tmp_path / "tiny.gguf", "f32", name="tiny-random")
    first, second = load_twice(path, tmp_path / "cache", "llama")
    for text in TEXTS:
        assert second.encode(text) == first.encode(text)
    messages = [{"role": "user", "content": "Hello"}]
    assert second.apply_chat_template(messages) == first.apply_chat_template(messages)
    assert load_elsewhere(path, tmp_path / "cache", "llama") == ["lean", "False"]
