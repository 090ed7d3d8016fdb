"""Weight-only quantization and --compile, held to the issue's bars on the demo model's held-out text.

tests/data/demo_val.txt is Shakespeare the demo model never trained on (the held-out tail of nine works, see
scripts/train_demo_model.py). The reference is the same model in bfloat16 without quantization.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.loading import LoadedModel, load
from tokenmill.quality import Score, compare, score

VAL_TEXT = (Path(__file__).resolve().parent.parent / "data" / "demo_val.txt").read_text()
QUALITY: dict[str, dict[str, float]] = {}  # printed in the closing note / docs


@pytest.fixture(scope="module")
def reference() -> tuple[LoadedModel, Score]:
    loaded = load(EngineConfig(dtype="bfloat16"))
    return loaded, score(loaded, VAL_TEXT)


def test_int8_agrees_with_bf16(reference: tuple[LoadedModel, Score]) -> None:
    loaded = load(EngineConfig(dtype="bfloat16", quantization="int8"))
    assert loaded.kernels == {"int8": len([m for m in loaded.model.modules() if hasattr(m, "qweight")])}
    q = QUALITY["int8"] = compare(reference[1], score(loaded, VAL_TEXT))
    assert q["positions"] > 5000
    assert q["top1_agreement"] >= 0.99, q
    assert abs(q["perplexity_change"]) <= 0.01, q


def test_int4_stays_close_to_bf16(reference: tuple[LoadedModel, Score]) -> None:
    loaded = load(EngineConfig(dtype="bfloat16", quantization="int4"))
    q = QUALITY["int4"] = compare(reference[1], score(loaded, VAL_TEXT))
    # 4 bits cost more than 8: a looser bar, still far from a broken model (unigram perplexity is ~544)
    assert q["top1_agreement"] >= 0.9, q
    assert abs(q["perplexity_change"]) <= 0.05, q


def test_packed_weights_change_nothing(reference: tuple[LoadedModel, Score]) -> None:
    packed = load(EngineConfig(dtype="bfloat16", pack_weights=True))
    assert reference[0].kernels == {} and packed.kernels.get("packed", 0) > 0
    ours = score(packed, VAL_TEXT)
    assert torch.equal(ours.top1, reference[1].top1)
    assert abs(ours.perplexity / reference[1].perplexity - 1) < 1e-3
