"""Incremental detokenization (multi-byte UTF-8 safe) and stop-string handling with streaming hold-back."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import load_twice
from tokenmill.engine.output_processor import OutputProcessor, SequenceText
from tokenmill.outputs import RequestMetrics
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer
from tokenmill.types import Request

TEXTS = [
    "café 日本語 🙂 naïve",
    "Hello world! Ünïcödé: café, naïve, 日本語, emoji 🙂🙂 and ß must round-trip through bytes.",
    "🙂日本語🙂 ß",
]


@pytest.fixture(scope="module", params=["transformers", "lean"])
def tok(request: pytest.FixtureRequest, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The test tokenizer through transformers (a folder's first load) and the lean tokenizer (the next)."""
    first, second = load_twice(tokenizer_dir, tmp_path_factory.mktemp("cache"))
    return first if request.param == "transformers" else second


def byte_ids(tok: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte (the byte-level alphabet), the worst case for multi-byte characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_char = dict(zip(bs, map(chr, cs)))
    ids = [tok.token_to_id(byte_char[b]) for b in text.encode()]
    assert all(isinstance(i, int) for i in ids)  # every byte has its own token
    return list(ids)


def stream(tok: Tokenizer, ids: list[int], prompt: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    return [detok.add(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("split", ["bpe", "bytes"])
def test_deltas_concatenate_to_full_decode(tok: Tokenizer, text: str, split: str) -> None:
    ids = tok.encode(text, add_special_tokens=False) if split == "bpe" else byte_ids(tok, text)
    assert tok.decode(ids) == text
    prompt = tok.encode("The quick brown fox ", add_special_tokens=False)
    deltas = stream(tok, ids, prompt)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[-1] == ""  # nothing left to flush for complete text


def test_multibyte_char_emitted_only_when_complete(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [])
    ids = byte_ids(tok, "a🙂b")  # 1 + 4 + 1 bytes
    assert [detok.add(i) for i in ids] == ["a", "", "", "", "🙂", "b"]
    assert detok.text == "a🙂b"


def test_flush_releases_incomplete_tail_once(tok: Tokenizer) -> None:
    ids = byte_ids(tok, "ok 日")[:-1]  # the last character lacks its final byte
    detok = IncrementalDetokenizer(tok, [])
    emitted = "".join(detok.add(i) for i in ids)
    assert emitted == "ok "
    rest = detok.flush()
    assert rest and "\ufffd" in rest
    assert emitted + rest == tok.decode(ids)
    assert detok.flush() == ""


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    end = tok.token_to_id("<|im_end|>")
    assert end is not None
    ids = [*tok.encode("Hi", add_special_tokens=False), end, *tok.encode(" there", add_special_tokens=False)]
    skipped = IncrementalDetokenizer(tok, [])
    assert "".join(skipped.add(i) for i in ids) + skipped.flush() == "Hi there"
    kept = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(kept.add(i) for i in ids) + kept.flush() == "Hi<|im_end|> there"


def windows_only(tok: Tokenizer, ids: list[int], prompt: list[int], **kwargs: bool) -> list[str]:
    """stream(), decoded by the Python windows alone (no Rust DecodeStream)."""
    detok = IncrementalDetokenizer(tok, prompt, **kwargs)
    detok.stream = None
    return [detok.add(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("skip", [True, False])
def test_the_rust_stream_emits_what_the_windows_emit(tok: Tokenizer, skip: bool) -> None:
    """Where the tokenizer has a Rust backend each token goes through its DecodeStream: token by token the same
    deltas as the windows, over text, its bytes one token each, and random ids (special tokens among them)."""
    rng = random.Random(0)
    prompt = tok.encode("The quick brown fox ", add_special_tokens=False)
    cases = [tok.encode(t, add_special_tokens=False) for t in TEXTS] + [byte_ids(tok, t) for t in TEXTS]
    cases += [[rng.randrange(tok.vocab_size) for _ in range(64)] for _ in range(20)]
    for ids in cases:
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        assert detok.stream is not None
        deltas = [detok.add(i) for i in ids] + [detok.flush()]
        assert detok.stream is not None  # the stream took every token
        assert deltas == windows_only(tok, ids, prompt, skip_special_tokens=skip)


class Refusing:
    """A DecodeStream that refuses its `at`-th token, as the Rust one refuses a window whose prefix changed."""

    def __init__(self, stream: Any, at: int) -> None:
        self.stream, self.at = stream, at

    def step(self, rust: Any, token_id: int) -> str | None:
        self.at -= 1
        if self.at < 0:
            raise Exception("InvalidPrefix")
        return self.stream.step(rust, token_id)  # type: ignore[no-any-return]


@pytest.mark.parametrize("at", [0, 3, 9])
def test_a_refused_window_goes_on_with_the_windows(tok: Tokenizer, at: int) -> None:
    ids = byte_ids(tok, TEXTS[1])
    prompt = tok.encode("Say:", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok.stream is not None
    detok.stream = (detok.stream[0], Refusing(detok.stream[1], at))
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert detok.stream is None
    assert deltas == windows_only(tok, ids, prompt) and "".join(deltas) == TEXTS[1]


def test_space_cleanup_keeps_the_windows(tokenizer_dir: Path, tmp_path: Path) -> None:
    """transformers may clean up tokenization spaces after decoding where a tokenizer asks for it (transformers 5
    does so for WordPiece only); the Rust stream would not, so such a tokenizer decodes through the windows, and
    the deltas join to its decode."""
    folder = shutil.copytree(tokenizer_dir, tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    for tok in load_twice(folder, tmp_path / "cache"):
        ids = tok.encode("Hello , world . Do n't", add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, [])
        assert detok.stream is None
        assert "".join([detok.add(i) for i in ids] + [detok.flush()]) == tok.decode(ids)


def make_request(tok: Tokenizer, **params: object) -> Request:
    return Request(
        request_id="r0",
        parent_id="r0",
        index=0,
        prompt_token_ids=tok.encode("Say:", add_special_tokens=False),
        params=SamplingParams(**params),  # type: ignore[arg-type]
        max_tokens=64,
        eos_token_ids=frozenset(),
        metrics=RequestMetrics(arrival_time=0.0),
    )


def run_stream(tok: Tokenizer, text: str, **params: object) -> tuple[SequenceText, str | None, list[str]]:
    """Feed `text` token by token, taking a streaming delta after each; stop at the first stop string."""
    req = make_request(tok, **params)
    seq = SequenceText(tok, req.prompt_token_ids, req.params)
    streamed: list[str] = []
    stop = None
    for i in tok.encode(text, add_special_tokens=False):
        stop = seq.add(i, check_stops=True)
        if stop is not None:
            break
        streamed.append(seq.take_delta(finished=False))
    if stop is None:
        seq.finish()
    streamed.append(seq.take_delta(finished=True))
    return seq, stop, streamed


TEXT = "Hello world! The quick brown fox jumps over the lazy dog."


@pytest.mark.parametrize("stop", ["The q", "fox", "!", "e lazy d", "日本"])
def test_stop_string_truncates_and_streams_no_part_of_it(tok: Tokenizer, stop: str) -> None:
    text = TEXT.replace("lazy dog", "lazy dog 日本語") if stop == "日本" else TEXT
    seq, got, streamed = run_stream(tok, text, stop=[stop, "never here"])
    assert got == stop
    assert seq.text == text[: text.index(stop)]
    partial = ""
    for delta in streamed[:-1]:
        partial += delta
        assert seq.text.startswith(partial)  # nothing streamed that the stop later removed
    assert "".join(streamed) == seq.text


def test_include_stop_str_in_output(tok: Tokenizer) -> None:
    seq, got, streamed = run_stream(tok, TEXT, stop=["The q"], include_stop_str_in_output=True)
    assert got == "The q"
    assert seq.text == "Hello world! The q"
    assert "".join(streamed) == seq.text


def test_hold_back_released_when_prefix_is_not_a_stop(tok: Tokenizer) -> None:
    text = "Hello world! The quick brown fox"
    seq, got, streamed = run_stream(tok, text, stop=["The cat", "fox!"])
    assert got is None and seq.text == text
    assert "".join(streamed[:-1]) == text[: len(text) - (len("The cat") - 1)]  # the held-back tail
    assert streamed[-1] == text[-(len("The cat") - 1) :]
    assert "".join(streamed) == text


def test_no_stops_streams_everything_immediately(tok: Tokenizer) -> None:
    text = "café 日本語 🙂 naïve"
    seq, got, streamed = run_stream(tok, text)
    assert got is None and seq.text == text
    assert "".join(streamed[:-1]) == text and streamed[-1] == ""


def test_stop_ignored_while_check_disabled(tok: Tokenizer) -> None:
    req = make_request(tok, stop=["world"])
    seq = SequenceText(tok, req.prompt_token_ids, req.params)
    ids = tok.encode("Hello world! The end", add_special_tokens=False)
    assert all(seq.add(i, check_stops=False) is None for i in ids)
    assert seq.text == "Hello world! The end"


def test_earliest_stop_wins_within_one_delta(tok: Tokenizer) -> None:
    first = tok.encode("Hello", add_special_tokens=False)[0]
    piece = tok.decode([first])
    assert piece == "Hel"  # one token holding both stop strings
    req = make_request(tok, stop=["l", "e"])
    seq = SequenceText(tok, req.prompt_token_ids, req.params)
    got = seq.add(first, check_stops=True)
    assert got == "e"
    assert seq.text == "H"


def test_a_stop_string_in_text_held_back_at_the_end_still_stops(tok: Tokenizer) -> None:
    """A token that ends in part of a character (its text held back until the character completes) may carry a
    stop string before that part. When the sequence ends on it, by its length limit, the held-back text is
    checked too: the string stops it (reason and cut), rather than reaching the output."""
    partial = [
        (i, text)
        for i in range(tok.vocab_size)
        if len(text := tok.decode([i], skip_special_tokens=False)) > 1 and text.endswith("\ufffd") and text[0].isalpha()
    ]
    if not partial:
        pytest.skip("this tokenizer has no token that ends in part of a character after a letter")
    token, text = partial[0]
    req = make_request(tok, stop=[text[0]])
    req.max_tokens = 1
    processor = OutputProcessor(tok)
    processor.add_request(None, [req])
    req.output_token_ids.append(token)
    req.finish_reason = "length"  # what the core sets on the last token allowed
    hit = processor.detokenize(req.parent_id, 0)
    assert hit is not None and (hit.num_tokens, hit.stop) == (1, text[0])


def test_each_tokens_own_bytes_and_top_logprobs_that_decode_alike(tok: Tokenizer) -> None:
    """A token's bytes (chat logprobs' `bytes`) are its own, part of a character included, so a text's tokens give
    back its bytes; tokens that decode alike (parts of characters all read U+FFFD) share one key of a completion's
    top_logprobs, which keeps the likeliest value."""
    from tokenmill.server.logprobs import _top_by_text

    text = "Say: wörld — ünïcode ✓ 日本語"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    partial = [i for i in range(tok.vocab_size) if tok.decode([i], skip_special_tokens=False) == "\ufffd"][:2]
    assert len(partial) == 2, "the test tokenizer has byte tokens"
    a, b = partial
    assert tok.token_bytes(a) != tok.token_bytes(b) and len(tok.token_bytes(a)) == 1
    alike = _top_by_text(tok, {a: -0.1, b: -2.5}, 2, a)
    assert alike == _top_by_text(tok, {b: -2.5, a: -0.1}, 2, b) == {"\ufffd": -0.1}


def test_logprobs_json_has_no_infinity_or_nan(tok: Tokenizer) -> None:
    """A logit the model set to -inf has logprob -inf, and a broken model's NaN gives NaN: JSON holds neither (a
    non-streaming response would fail to encode, a stream would send invalid JSON), so both read vLLM's -9999."""
    import json

    from tokenmill.server.logprobs import chat_logprobs, completion_logprobs

    entries = [{5: -0.5, 6: float("-inf")}, {7: float("nan"), 8: -1.0}]
    completion, _ = completion_logprobs(tok, [6, 7], list(entries), 2)
    chat = chat_logprobs(tok, [6, 7], entries, 2)
    for body in (completion, chat):
        json.dumps(body, allow_nan=False)  # raises on inf or NaN
    assert completion["token_logprobs"] == [-9999.0, -9999.0]
    assert [[t["logprob"] for t in c["top_logprobs"]] for c in chat["content"]] == [[-0.5, -9999.0], [-1.0, -9999.0]]
