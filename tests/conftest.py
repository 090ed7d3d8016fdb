"""Shared fixtures: a tiny byte-level BPE tokenizer and tiny random checkpoints, all made inside the tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session", autouse=True)
def _run_caches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The run's packed weights, converted tokenizers and tokenizer verdicts (of checkpoints that live in temporary
    folders) go to a cache folder of the run's own, gone with it; they piled up in ~/.cache/tokenmill (282 stale
    packed entries, 3 GB, on a developer's machine). The compiled kernels stay shared: the folder links to them.
    Servers and scripts the tests start inherit the variable; a test that sets its own still wins."""
    from tokenmill.kernels.build import cache_root as kernels_folder

    kernels = kernels_folder()  # (read before the variable changes)
    kernels.mkdir(parents=True, exist_ok=True)
    root = tmp_path_factory.mktemp("tokenmill-cache")
    (root / "kernels").symlink_to(kernels, target_is_directory=True)
    before = os.environ.get("TOKENMILL_CACHE_DIR")
    os.environ["TOKENMILL_CACHE_DIR"] = str(root)
    yield
    if before is None:
        os.environ.pop("TOKENMILL_CACHE_DIR", None)
    else:
        os.environ["TOKENMILL_CACHE_DIR"] = before


CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "To be, or not to be, that is the question.",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and symbols {} [] () <> = + - * / are tokens too.",
    "Ünïcödé: café, naïve, 日本語, emoji 🙂 and ß must round-trip through bytes.",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out: Path, vocab_size: int = 384) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return out


def load_twice(source: Path, cache_dir: Path, model_type: str | None = None) -> tuple[Any, Any]:
    """`source`'s Tokenizer loaded twice with the cache `cache_dir`: the first load through transformers (it compares
    the lean tokenizer with it), the second the lean one, where the comparison found no difference."""
    from tokenmill.tokenizer import Tokenizer

    with pytest.MonkeyPatch.context() as env:
        env.setenv("TOKENMILL_CACHE_DIR", str(cache_dir))
        first, second = Tokenizer(source, model_type), Tokenizer(source, model_type)
    assert (first.backend.name, second.backend.name) == ("transformers", "lean")
    return first, second


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


TINY = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=384, max_position_embeddings=512,
)  # fmt: skip


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Callable[..., Path]:
    """make_checkpoint(arch, dtype="float32", seed=0, **config_overrides) -> folder (cached per arguments)."""
    from tokenmill.make_model import hf_config, write_checkpoint

    cache: dict[str, Path] = {}

    def make(arch: str, dtype: str = "float32", seed: int = 0, **overrides: Any) -> Path:
        key = repr((arch, dtype, seed, sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt-{arch}")
            write_checkpoint(hf_config(arch, **{**TINY, **overrides}), tokenizer_dir, out, dtype, seed)
            cache[key] = out
        return cache[key]

    return make


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device", default="cpu", help="where the parity and engine tests run: cpu (default), cuda, cuda:N"
    )


def pytest_configure(config: pytest.Config) -> None:
    import torch

    from tests import target

    device = config.getoption("--device")
    if device != "cpu" and not (device.startswith("cuda") and torch.cuda.is_available()):
        raise pytest.UsageError(f"--device {device}: this PyTorch sees no such device; allowed: cpu, or cuda on a GPU")
    target.DEVICE = device
    _prebuild_kernel_variants(config)


# Building a kernel variant takes a minute, on one core (one translation unit); the tests need every variant the CPU
# runs, and each built the first time a test asked for it, while the other core waited. One background process builds
# them in turn from the start instead: a test that needs a variant the builder is still making waits on the build's
# lock (kernels/build.py) and then loads it. TOKENMILL_TEST_PREBUILD=0 turns it off.
_PREBUILD = """
import sys
from tokenmill.kernels import build
for level in sys.argv[1:]:
    try:
        build.load(level)
    except Exception:
        pass
"""


def _prebuild_kernel_variants(config: pytest.Config) -> None:
    import os
    import subprocess
    import sys

    if os.environ.get("TOKENMILL_TEST_PREBUILD", "1") == "0":
        return
    from tests.unit.conftest import kernel_levels

    levels = kernel_levels()
    config._tokenmill_prebuild = subprocess.Popen(  # type: ignore[attr-defined]
        [sys.executable, "-c", _PREBUILD, *levels], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    builder = getattr(config, "_tokenmill_prebuild", None)
    if builder is not None and builder.poll() is None:
        builder.terminate()
        builder.wait(timeout=30)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print the parity table (family x config -> max |logit diff|) when parity tests ran."""
    try:
        from tests.parity.test_models import PARITY_TABLE
    except ImportError:
        return
    if not PARITY_TABLE:
        return
    columns = sorted({c for row in PARITY_TABLE.values() for c in row})
    terminalreporter.write_sep("=", "parity vs transformers: max |logit diff|")
    terminalreporter.write_line("| config | " + " | ".join(columns) + " |")
    terminalreporter.write_line("|---" * (len(columns) + 1) + "|")
    for name, row in PARITY_TABLE.items():
        cells = " | ".join(f"{row[c]:.2e}" if c in row else "-" for c in columns)
        terminalreporter.write_line(f"| {name} | {cells} |")
