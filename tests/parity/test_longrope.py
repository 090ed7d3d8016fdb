"""Phi-3's LongRoPE against transformers on both sides of `original_max_position_embeddings` (here 32).

HF's model picks the factors by the length of a forward: a prompt longer than the original context is rotated by
the long factors from position 0, and so are the tokens after it; a shorter sequence that grows past the length is
computed again with the long factors throughout (HF's Phi-3 `generate` drops its cache there). A long prompt's rows
must come out the same through chunked prefill, a prefix cache shared with a shorter prompt of the same first
tokens, one-token prefill chunks beside a decoding row, decode runs, speculation and the decode stack.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import target
from tests.parity.test_models import LONGROPE, SPREAD
from tokenmill import LLM, SamplingParams

ORIGINAL = 32


@pytest.fixture(scope="module")
def phi3(make_checkpoint: Callable[..., Path]) -> tuple[Path, Any]:
    from transformers import AutoModelForCausalLM

    folder = make_checkpoint("phi3", **SPREAD, rope_scaling=LONGROPE, original_max_position_embeddings=ORIGINAL)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to(target.DEVICE).eval()
    hf.generation_config.eos_token_id = None  # `generate` makes every token asked for (the tiny tokenizer's EOS is 0)
    return folder, hf


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 380, (n,), generator=g).tolist()


def _hf_greedy(hf: Any, ids: list[int], n: int) -> list[int]:
    """HF's greedy tokens with every step's forward over the whole sequence (no cache): the factors its model picks
    by a forward's length, without `generate`'s cache drop at the switch, which transformers 5.17 got wrong (it
    dropped the cache but still fed only the last token: another token at the switch on any device)."""
    with torch.no_grad():
        out = hf.generate(target.ids_tensor([ids]), max_new_tokens=n, do_sample=False, use_cache=False)
    return out[0, len(ids) :].tolist()


def test_a_prompt_past_the_original_length_matches_transformers(phi3: tuple[Path, Any]) -> None:
    """Prompt logprobs (every position, from 0) and greedy tokens of prompts of 33 and 50 tokens."""
    folder, hf = phi3
    llm = LLM(str(folder), dtype="float32", device=target.DEVICE)
    for n in (ORIGINAL + 1, 50):
        ids = _prompt(n, n)
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=12, ignore_eos=True, temperature=0,
                                                                        prompt_logprobs=1))[0]  # fmt: skip
        assert out.outputs[0].token_ids == _hf_greedy(hf, ids, 12)
        with torch.no_grad():
            ref = hf(target.ids_tensor([ids])).logits[0].float().cpu().log_softmax(-1)  # [n, V]
        assert out.prompt_logprobs is not None
        diffs = [abs(entry[ids[p + 1]] - ref[p, ids[p + 1]].item()) for p, entry in enumerate(out.prompt_logprobs[1:])
                 if entry is not None]  # fmt: skip
        assert len(diffs) == n - 1 and max(diffs) < 1e-4


@pytest.mark.parametrize(
    "switches",
    [
        dict(max_num_batched_tokens=8),  # chunks below and across the original length
        dict(max_num_batched_tokens=2, max_num_seqs=2),  # one-token chunks beside a decoding row
        dict(num_scheduler_steps=1, enable_prefix_caching=False),
        dict(cpu_kernels=False),  # the modules alone: no decode stack
    ],
)
def test_long_and_short_prompts_of_the_same_first_tokens_in_one_engine(
    phi3: tuple[Path, Any], switches: dict[str, Any]
) -> None:
    """A short prompt (20 tokens, short factors) and a long one (45 tokens) that starts with the same 20. Both at once
    in a fresh engine (the long one's chunks beside the short one's decoding rows), then in another the short one
    first, filling the prefix cache: the long one must not take its blocks, whose keys the short factors rotated.
    Every output is transformers' greedy."""
    folder, hf = phi3
    short = _prompt(20, 1)
    long = short + _prompt(25, 2)
    want = {len(ids): _hf_greedy(hf, ids, 10) for ids in (short, long)}
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0)
    for batches in (([short, long], [long, short]), ([short], [long], [short, long])):
        llm = LLM(str(folder), dtype="float32", device=target.DEVICE, **switches)
        for batch in batches:
            outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params)
            assert [o.outputs[0].token_ids for o in outs] == [want[len(ids)] for ids in batch]


@pytest.mark.parametrize(
    "switches",
    [
        {},
        dict(num_scheduler_steps=8),  # decode runs: none may step past the switch
        dict(speculative_model="ngram", num_speculative_tokens=5, num_scheduler_steps=1),  # nor a verify row
        dict(speculative_model="itself", num_speculative_tokens=5, num_scheduler_steps=1),  # (every draft kept)
        dict(max_num_batched_tokens=8, cpu_kernels=False),
    ],
)
def test_a_sequence_that_grows_past_the_original_length_matches_transformers_generate(
    phi3: tuple[Path, Any], switches: dict[str, Any]
) -> None:
    """transformers' Phi-3 `generate` computes a sequence again, with the long factors throughout, once it grows
    past the original length (its prepare_inputs_for_generation drops the cache there); so do we. Prompts of 20, 31
    and 32 tokens (the last switches after its first token), of a repeated 7-token pattern (prompt lookup finds
    drafts), each alone (a decode run takes one to four sequences), then together with two of them again (prefix
    hits)."""
    folder, hf = phi3
    pattern = _prompt(7, 3)
    prompts = [(pattern * 5)[:n] for n in (20, ORIGINAL - 1, ORIGINAL)]
    want = [_hf_greedy(hf, ids, 24) for ids in prompts]
    if switches.get("speculative_model") == "itself":
        switches = {**switches, "speculative_model": str(folder)}
    llm = LLM(str(folder), dtype="float32", device=target.DEVICE, **switches)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for ids, tokens in zip(prompts, want):
        assert llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids == tokens
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts + prompts[:2]], params)
    assert [o.outputs[0].token_ids for o in outs] == want + want[:2]


def test_the_rotary_embedding_takes_a_long_prompts_positions_as_minus_one_minus_p(phi3: tuple[Path, Any]) -> None:
    """-1 - p is position p rotated by the long factors, from the tables' path on the CPU and from the computed path
    that a GPU takes (no host sync there: CUDA graphs capture it); p >= 0 reads the tables as before."""
    from transformers import AutoConfig

    from tokenmill.model_config import ModelConfig
    from tokenmill.models.rope import RotaryEmbedding, long_below

    folder, _ = phi3
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(str(folder)).to_dict())
    rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)
    p = torch.arange(0, 48)  # [T]
    short_then_long = rotary(p, torch.float32)  # the per-position rule
    all_long = rotary(-1 - p, torch.float32)
    assert torch.equal(all_long[0][ORIGINAL:], short_then_long[0][ORIGINAL:])  # past the length: the same rows
    assert not torch.allclose(all_long[0][1:ORIGINAL], short_then_long[0][1:ORIGINAL])  # below: the long factors
    computed = rotary._compute(*long_below(torch.cat([p[:10], -1 - p[10:]])))  # the device path's
    assert torch.equal(computed[0][10:], all_long[0][10:]) and torch.equal(computed[1][:10], short_then_long[1][:10])
