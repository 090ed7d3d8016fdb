"""Does the lean tokenizer behave as transformers' tokenizer of the same folder? `differences` answers with the
first difference found (None: none), probing what `Tokenizer` exposes: the vocabulary and special tokens, encode
and decode over texts chosen to reach normalizers, pre-tokenizers, added and special tokens and byte fallback,
decode of sampled ids, and the chat template over a few conversations."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

TEXTS = [
    "Hello world", "Hello, world! How are you?", " leading space", "  two leading spaces", "trailing space ",
    "tabs\tand\nnewlines\n\n\r\nand CRLF", "   \n  ", "", " ", "a", "A.B.C. e.g. i.e. U.S.A.",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -42 1,000,000 0x1F 1e-9",
    "Ünïcödé: café naïve façade Ångström ß ẞ", "e\u0301 vs é; A\u030a vs Å; ﬁ ligature; Ｆｕｌｌ width",  # NFD, NFKC
    "日本語のテキスト、中文文本，한국어 텍스트", "Русский текст и ελληνικά", "עברית ועربية", "हिन्दी और தமிழ்",
    "emoji 🙂🙃 👨‍👩‍👧‍👦 🏳️‍🌈 👍🏽 🇯🇵", "zero\u200bwidth\u200djoiner\ufeffbom", "\x00\x01 control \x7f",
    "def f(x):\n    return x ** 2  # square\n", "<html><body class=\"x\">&amp;</body></html>",
    "{\"key\": [1, 2, {\"nested\": null}], 'single': true}", "Hello , world . Do n't I 'm you 're we 've it 's",
    "can't won't shouldn't y'all o'clock", "UPPER lower MiXeD camelCase snake_case kebab-case",
    "....!!!???,,,;;;:::---___***", "a" * 200, "word " * 50, "🙂" * 20, "\u2581 sentencepiece\u2581marks",
    "<0xE3> <unk> <s> </s> [CLS] [SEP] [MASK] <pad> <|endoftext|> <|im_start|> <|im_end|>",
    "The quick brown fox jumps over the lazy dog. " * 3,
]  # fmt: skip

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "A city's name"}},
            "required": ["city"],
        },
    },
}
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi! ünï 🙂 <b>&</b>"}], {}),
    (
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "  And 3+3?\n"},
        ],
        {},
    ),
    (
        [
            {"role": "system", "content": "Use tools when they help."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [TOOL_CALL],
            },
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp_c": 18}'},
        ],
        {"tools": [WEATHER_TOOL]},
    ),
    ([{"role": "user", "content": "Hi"}], {"documents": [{"title": "Doc", "text": "Some text."}], "extra": 1}),
]


def differences(hf: Any, lean: Any) -> str | None:
    """`hf`: transformers' tokenizer; `lean`: a LeanTokenizer of the same folder. The first difference, in words."""
    from transformers import PreTrainedTokenizerFast  # transformers 5's TokenizersBackend, under its older name

    if not isinstance(hf, PreTrainedTokenizerFast):
        return f"transformers loads it as {type(hf).__name__}, not a tokenizers-backed class"
    overridden = [m for m in _PYTHON_SIDE if getattr(type(hf), m) is not getattr(PreTrainedTokenizerFast, m)]
    if overridden:
        return f"{type(hf).__name__} overrides {', '.join(overridden)}"
    for check in (_attributes, _encodings, _decodings, _chats):
        if (found := next(check(hf, lean), None)) is not None:
            return found
    return None


# What transformers runs in Python around the Rust tokenizer: a class that replaces any of it tokenizes its own way
_PYTHON_SIDE = ("encode", "decode", "_decode", "_encode_plus", "__call__", "tokenize", "convert_tokens_to_string",
                "convert_ids_to_tokens", "_convert_token_to_id_with_added_voc", "clean_up_tokenization",
                "apply_chat_template", "get_chat_template", "get_vocab", "__len__")  # fmt: skip


def _attributes(hf: Any, lean: Any) -> Iterator[str]:
    eos = hf.eos_token_id if isinstance(hf.eos_token_id, int) else None
    pairs = [
        ("vocabulary size", len(hf), lean.vocab_size),
        ("eos id", eos, lean.eos_token_id),
        ("special tokens", dict(hf.special_tokens_map), lean.special_tokens_map),
        ("special ids", list(hf.all_special_ids), lean.all_special_ids),
        ("chat template", hf.chat_template, lean.chat_template),
        ("clean_up_tokenization_spaces", bool(hf.clean_up_tokenization_spaces), lean.clean_up_tokenization_spaces),
    ]
    yield from (f"{what}: {_short(a)} vs {_short(b)}" for what, a, b in pairs if a != b)
    if hf.get_vocab() != lean.get_vocab():
        yield "the vocabularies differ"


def _probe_texts(lean: Any) -> list[str]:
    """TEXTS, and each added token (the first and last 64) inside text, touching words and between spaces."""
    added = [t.content for _, t in sorted(lean.rust.get_added_tokens_decoder().items())]
    tokens = list(dict.fromkeys([*lean.special_tokens_map.values(), *added[:64], *added[-64:]]))
    return TEXTS + [f"x{t}y {t} z\n{t}{t}" for t in tokens] + [" ".join(tokens)]


def _encodings(hf: Any, lean: Any) -> Iterator[str]:
    for text in _probe_texts(lean):
        for special in (True, False):
            a, b = list(hf.encode(text, add_special_tokens=special)), lean.encode(text, special)
            if a != b:
                yield f"encode({text!r}, add_special_tokens={special}): {_short(a)} vs {_short(b)}"


def _decodings(hf: Any, lean: Any) -> Iterator[str]:
    rng = random.Random(0)
    size = lean.vocab_size
    added = sorted(lean.rust.get_added_tokens_decoder())
    cases = [lean.encode(text, True) for text in _probe_texts(lean)]
    cases += [list(range(min(size, 300))), list(range(max(0, size - 300), size)), added]
    cases += [[rng.randrange(size) for _ in range(24)] for _ in range(200)]
    for ids in cases:
        for skip in (True, False):
            a, b = hf.decode(ids, skip_special_tokens=skip), lean.decode(ids, skip)
            if a != b:
                yield f"decode({_short(ids)}, skip_special_tokens={skip}): {_short(a)} vs {_short(b)}"


def _chats(hf: Any, lean: Any) -> Iterator[str]:
    if not hf.chat_template and not lean.chat_template:
        return
    for messages, kwargs in CONVERSATIONS:
        for generation_prompt in (True, False):
            a = _outcome(hf.apply_chat_template, messages, add_generation_prompt=generation_prompt, tokenize=False,
                         **kwargs)  # fmt: skip
            b = _outcome(lean.render_chat, messages, generation_prompt, dict(kwargs))
            if a != b:
                yield f"chat template on {_short(messages)}: {_short(a)} vs {_short(b)}"
            elif isinstance(a, str) and hf.encode(a, add_special_tokens=False) != lean.encode(a, False):
                yield f"encode of the chat template's text {_short(a)}"


def _outcome(render: Callable[..., Any], *args: Any, **kwargs: Any) -> str | type:
    """The rendered text, or the kind of error (a template that fails for both fails alike)."""
    from jinja2 import TemplateError

    try:
        return str(render(*args, **kwargs))
    except (TemplateError, ValueError, TypeError):
        return Exception


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
