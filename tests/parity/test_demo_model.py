"""The built-in demo model: loads in tokenmill and transformers alike, and its greedy text is pinned.

The golden test is the llama2.c habit: any engine change that alters results, however slightly, shows here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.assembly.model import DEMO_MODEL
from tokenmill.attention import causal

DRAFT_MODEL = DEMO_MODEL.parent / "demo-draft"
GOLDEN_PROMPT = "ROMEO:"
GOLDEN_TEXT = (
    "\nI am not a man, and I am a man.\n\n[Exeunt.]\n\nSCENE II. A Room in the Castle.\n\n[Enter CAPULET and CAPULET"
)
SHAKESPEARE = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer"


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM(dtype="float32")  # no model: the built-in demo


def _logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    model = llm.loaded.model
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), *causal(len(ids)))
        return model.compute_logits(hidden)


@pytest.mark.parametrize("folder", [DEMO_MODEL, DRAFT_MODEL], ids=["demo", "draft"])
def test_logits_match_transformers(folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(str(folder)).encode(SHAKESPEARE)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    llm = LLM(str(folder), dtype="float32")
    assert llm.tokenizer.encode(SHAKESPEARE) == ids
    assert (_logits(llm, ids) - ref).abs().max().item() < 1e-4


def test_default_model_is_the_demo(demo: LLM) -> None:
    assert demo.loaded.path == DEMO_MODEL
    assert demo.loaded.config.architecture == "LlamaForCausalLM"
    assert {0, 2} <= demo.loaded.eos_token_ids  # <|endoftext|> and <|im_end|> from generation_config.json


def test_golden_greedy_text(demo: LLM) -> None:
    out = demo.generate(GOLDEN_PROMPT, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert out.text == GOLDEN_TEXT


def test_speaks_english_not_noise(demo: LLM) -> None:
    """A sampled continuation is mostly common English words (random weights would give byte soup)."""
    common = {"the", "and", "i", "to", "of", "a", "my", "you", "that", "is", "in", "not", "me", "it", "with"}
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=120, seed=7, ignore_eos=True)
    words = demo.generate("KING HENRY:", params)[0].outputs[0].text.lower().split()
    assert len(words) > 40
    assert sum(w.strip(".,;:!?'") in common for w in words) / len(words) > 0.15


def test_chat_turn_ends_with_im_end(demo: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=200)
    out = demo.chat([{"role": "user", "content": "Good morrow, sir. How fares the king?"}], params)[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.token_ids[-1] == 2  # <|im_end|>
