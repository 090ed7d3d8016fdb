"""A GGUF's byte-level BPE tokenizer built from its metadata (tokenizer/gguf_bpe.py) behaves as the model's own
tokenizer folder under transformers: Qwen2's, Llama 3's, GPT-2's and gpt-oss's (o200k) split and normalizer, BOS,
special and added tokens, decode and chat template (`probes.differences`). Made from the tiny trained tokenizer in
every family, and from the real Qwen2, Llama 3 and GPT-2 tokenizers where ../shared holds them. The first start
builds it without importing transformers; later starts read the kept folder."""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.unit.test_tokenizer_verdict import load_elsewhere
from tokenmill.tokenizer import Tokenizer, gguf_bpe, probes
from tokenmill.tokenizer.lean import LeanTokenizer
from tokenmill.weights.gguf_checkpoint import GGUFCheckpoint

SHARED = Path(__file__).resolve().parents[3] / "shared" / "tokenizers"
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


def _styled(tokenizer_dir: Path, out: Path, arch: str) -> Path:
    """The tiny tokenizer as Llama 3 shapes its own (Llama 3's split, whole words found in the vocabulary taken
    without merging, BOS before every sequence), Qwen2 (Qwen2's split, NFC) or gpt-oss (o200k's split); GPT-2's as
    it is."""
    if arch == "gpt2":
        return tokenizer_dir
    shutil.copytree(tokenizer_dir, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    split = {"llama": gguf_bpe.LLAMA3_SPLIT, "gpt-oss": gguf_bpe.GPT4O_SPLIT}.get(arch, gguf_bpe.QWEN2_SPLIT)
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ]}  # fmt: skip
    if arch not in ("llama", "gpt-oss"):
        spec["normalizer"] = {"type": "NFC"}
    elif arch == "llama":
        spec["model"]["ignore_merges"] = True
        bos = next(t for t in spec["added_tokens"] if t["content"] == "<|endoftext|>")
        spec["post_processor"] = _bos_template(bos["content"], bos["id"])
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


def _bos_template(bos: str, bos_id: int) -> dict[str, object]:
    special = [{"SpecialToken": {"id": bos, "type_id": 0}}, {"SpecialToken": {"id": bos, "type_id": 1}}]
    a, b = {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}
    return {"type": "TemplateProcessing", "single": [special[0], a], "pair": [special[0], a, special[1], b],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}  # fmt: skip


def _exported(tokenizer: Path, arch: str, out: Path) -> tuple[Path, Path]:
    """(a tiny `arch` checkpoint folder with `tokenizer`, its f32 GGUF)."""
    from transformers import AutoTokenizer

    from tokenmill.bench.gguf_export import export_gguf
    from tokenmill.make_model import hf_config, write_checkpoint

    size = len(AutoTokenizer.from_pretrained(str(tokenizer)))
    folder = write_checkpoint(hf_config(arch, vocab_size=size, **SMALL), tokenizer, out / "hf")
    return folder, export_gguf(folder, out / "model.gguf", "f32", name="tiny-random")


# text that o200k splits unlike Llama 3: case changes inside a word, contractions, a slash after punctuation
O200K_TEXTS = ["HelloWorld CamelCaseWORDS iPhone", "it's DON'T we'LL", "a+/b, (x)/\n/y\r\n", "12345 3.14 x  y\t\n z",
               "ÉCOLE élève Straße 日本語 🙂", "<|im_start|>user\nHello<|im_end|>"]  # fmt: skip


def test_gpt_oss_files_split_as_o200k(make_checkpoint: Callable[..., Path], tokenizer_dir: Path,
                                      tmp_path: Path) -> None:  # fmt: skip
    """A `gpt-oss` file with llama.cpp's `gpt-4o` pre-tokenizer (the released files'): o200k's split, no
    normalizer, merges as ranked; the same tokens as the folder under transformers, and as llama.cpp's own reading
    of the file where llama-cpp-python is installed."""
    from tests.parity.test_gpt_oss import GPT_OSS, write_gguf
    from tokenmill.make_model import hf_config, write_checkpoint

    tok = _styled(tokenizer_dir, tmp_path / "tok", "gpt-oss")
    config = hf_config("gpt_oss", **{**SMALL, "vocab_size": 384, "max_position_embeddings": 512, **GPT_OSS})
    folder = write_checkpoint(config, tok, tmp_path / "hf")
    path, _ = write_gguf(folder, tmp_path / "gpt-oss.gguf", mxfp4_experts=False)
    assert GGUFCheckpoint(path).metadata("tokenizer.ggml.pre") == "gpt-4o"
    _assert_same_as_the_folder(folder, path, tmp_path / "built")
    built = LeanTokenizer(tmp_path / "built")
    pieces = [p for p, _ in built.rust.pre_tokenizer.pre_tokenize_str("HelloWorld it's a/\n")]
    assert pieces == ["Hello", "World", "Ġit's", "Ġa", "/Ċ"], pieces  # o200k's split, not Llama 3's
    if importlib.util.find_spec("llama_cpp") is not None:
        import llama_cpp

        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        for text in O200K_TEXTS:
            assert llm.tokenize(text.encode(), add_bos=False, special=True) == built.encode(text, False), text


def _built(gguf_path: Path, out: Path) -> LeanTokenizer:
    built = gguf_bpe.build(GGUFCheckpoint(gguf_path).metadata)
    assert built is not None, "a byte-level BPE file of a family gguf_bpe builds"
    out.mkdir()
    (out / "tokenizer.json").write_text(built.tokenizer_json)
    (out / "tokenizer_config.json").write_text(json.dumps(built.config))
    if built.chat_template is not None:
        (out / "chat_template.jinja").write_text(built.chat_template)
    return LeanTokenizer(out)


def _assert_same_as_the_folder(folder: Path, gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    assert probes.differences(AutoTokenizer.from_pretrained(str(folder)), _built(gguf_path, out)) is None


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "gpt2"])
def test_the_tiny_tokenizer_in_every_family(arch: str, tokenizer_dir: Path, tmp_path: Path) -> None:
    folder, path = _exported(_styled(tokenizer_dir, tmp_path / "tok", arch), arch, tmp_path)
    pre = GGUFCheckpoint(path).metadata("tokenizer.ggml.pre")
    assert pre == {"qwen2": "qwen2", "qwen3": "qwen2", "llama": "llama-bpe", "gpt2": "gpt-2"}[arch]
    _assert_same_as_the_folder(folder, path, tmp_path / "built")
    if arch == "llama":  # the file asks for BOS, and the built tokenizer adds it
        built = LeanTokenizer(tmp_path / "built")
        assert built.encode("Hello", True)[0] == built.token_to_id("<|endoftext|>")
        assert built.encode("Hello", True)[1:] == built.encode("Hello", False)


@pytest.mark.parametrize(("name", "arch"), [("qwen2", "qwen2"), ("llama3", "llama"), ("gpt2", "gpt2")])
def test_the_real_tokenizers(name: str, arch: str, tmp_path: Path) -> None:
    if not (SHARED / name / "tokenizer.json").is_file():
        pytest.skip(f"no {SHARED / name}: the real tokenizers come with ../shared, beside the repository")
    folder, path = _exported(SHARED / name, arch, tmp_path)
    _assert_same_as_the_folder(folder, path, tmp_path / "built")


def test_the_kept_tokenizer_json_is_the_quick_form_of_the_same_tokenizer(tokenizer_dir: Path, tmp_path: Path) -> None:
    """The kept tokenizer.json writes its merges as "a b" strings, which `tokenizers` reads faster than the [a, b]
    pairs it writes itself (quick_json); read back, it is the same tokenizer. A merge whose part holds a
    space keeps the pairs: a string could not say where it splits."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models

    from tokenmill.tokenizer.backend import quick_json

    _, path = _exported(_styled(tokenizer_dir, tmp_path / "tok", "qwen2"), "qwen2", tmp_path)
    built = gguf_bpe.build(GGUFCheckpoint(path).metadata)
    assert built is not None
    merges = json.loads(built.tokenizer_json)["model"]["merges"]
    assert merges and all(isinstance(m, str) and m.count(" ") == 1 for m in merges)
    pairs = RustTokenizer.from_str(built.tokenizer_json).to_str()  # `tokenizers` writes the pairs form again
    assert isinstance(json.loads(pairs)["model"]["merges"][0], list)
    assert RustTokenizer.from_str(quick_json(pairs)).to_str() == pairs
    spaced = RustTokenizer(models.BPE({"a": 0, " ": 1, "a ": 2, "b": 3, "ab": 4}, [("a", " "), ("a", "b")])).to_str()
    assert json.loads(quick_json(spaced))["model"]["merges"] == [["a", " "], ["a", "b"]]
    assert RustTokenizer.from_str(quick_json(spaced)).to_str() == spaced


def _load_front_elsewhere(path: Path, cache: Path) -> list[str]:
    """A fresh Python loads the model's front (config and tokenizer) as the server does: [the tokenizer's backend,
    whether transformers got imported]."""
    import os
    import subprocess
    import sys

    code = ("import sys; from tokenmill.assembly.model import load_front; from tokenmill.config import EngineConfig; "
            "tok = load_front(EngineConfig(model=sys.argv[1])).tokenizer; "
            "print(tok.backend.name, 'transformers' in sys.modules)")  # fmt: skip
    env = {**os.environ, "TOKENMILL_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_other_kinds_are_left_to_transformers(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """A llama file with GPT-2's split is no family gguf_bpe knows: None, and transformers builds it."""
    from tokenmill.bench.gguf_export import export_gguf

    path = export_gguf(make_checkpoint("llama"), tmp_path / "tiny.gguf", "f32", name="tiny-random")
    assert gguf_bpe.build(GGUFCheckpoint(path).metadata) is None
    assert load_elsewhere(path, tmp_path / "cache", "llama") == ["transformers", "True"]


def test_the_first_start_needs_no_transformers_and_the_second_reads_the_kept_folder(
    make_checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenmill.bench.gguf_export import export_gguf

    path = export_gguf(make_checkpoint("qwen2"), tmp_path / "tiny.gguf", "f32", name="tiny-random")
    cache = tmp_path / "cache"
    assert _load_front_elsewhere(path, cache) == ["lean", "False"]
    (kept,) = (cache / "gguf-tokenizers").iterdir()
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(cache))
    monkeypatch.setattr(gguf_bpe, "build", lambda _: pytest.fail("built again although a kept folder exists"))
    second = Tokenizer(path, "qwen2", GGUFCheckpoint(path).metadata)
    assert second.backend.name == "lean"
    assert Path(second.backend.folder) == kept  # type: ignore[attr-defined]


def test_a_server_front_reads_the_kept_folder_without_numpy_or_torch(make_checkpoint: Callable[..., Path],
                                                                     tmp_path: Path) -> None:  # fmt: skip
    """Once the tokenizer of a GGUF is kept, the server's front (engine/process_start.load_tokenizer) loads it
    without importing numpy or torch: each would stay resident in the front for nothing (numpy: 14 MB)."""
    import os
    import subprocess
    import sys

    from tokenmill.bench.gguf_export import export_gguf

    path = export_gguf(make_checkpoint("qwen2"), tmp_path / "tiny.gguf", "f32", name="tiny-random")
    code = ("import sys; from pathlib import Path; from tokenmill.engine.process_start import load_tokenizer; "
            "tok = load_tokenizer(Path(sys.argv[1])); "
            "print(tok.backend.name, 'numpy' in sys.modules, 'torch' in sys.modules)")  # fmt: skip
    env = {**os.environ, "TOKENMILL_CACHE_DIR": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True,
                           timeout=300) for _ in range(2)]  # fmt: skip
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    assert runs[0].stdout.split()[0] == "lean"  # the first built it from the metadata (numpy may come then)
    assert runs[1].stdout.split() == ["lean", "False", "False"]


def test_a_damaged_kept_folder_is_built_again(make_checkpoint: Callable[..., Path], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from tokenmill.bench.gguf_export import export_gguf

    path = export_gguf(make_checkpoint("qwen2"), tmp_path / "tiny.gguf", "f32", name="tiny-random")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    first = Tokenizer(path, "qwen2", GGUFCheckpoint(path).metadata)
    (kept,) = (tmp_path / "cache" / "gguf-tokenizers").iterdir()
    (kept / "tokenizer.json").write_text("{ not json")
    again = Tokenizer(path, "qwen2", GGUFCheckpoint(path).metadata)
    assert again.backend.name == "lean"
    assert again.encode("Hello world! ünï") == first.encode("Hello world! ünï")
    assert json.loads((kept / "tokenizer.json").read_text())["model"]["type"] == "BPE"


def test_an_unwritable_cache_still_gives_the_tokenizer(make_checkpoint: Callable[..., Path], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from tokenmill.bench.gguf_export import export_gguf

    path = export_gguf(make_checkpoint("qwen2"), tmp_path / "tiny.gguf", "f32", name="tiny-random")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(blocked))
    tok = Tokenizer(path, "qwen2", GGUFCheckpoint(path).metadata)
    assert tok.backend.name == "lean"
    assert tok.decode(tok.encode("Hello world")) == "Hello world"
