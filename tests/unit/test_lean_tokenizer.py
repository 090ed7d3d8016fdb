"""The lean tokenizer (a folder's second load: no transformers) tokenizes, decodes and renders chat templates as
transformers' tokenizer of the same folder (its first load) does: on the demo model's tokenizer, the test
tokenizer, and, where ../shared holds them, the real Qwen2, Llama 3, Llama 2 and GPT-2 tokenizers."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import load_twice
from tokenmill.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "src" / "tokenmill" / "assets" / "demo"
SHARED = REPO.parent / "shared" / "tokenizers"
FOLDERS = ["demo", "test", "qwen2", "llama3", "llama2", "gpt2"]

TEXTS = [
    "Hello world", " Hello", "  Hello  world  ", "Hello\n\nworld\r\n\tend", "", " ", "\n", "x" * 300,
    "Ünïcödé café naïve ß", "e\u0301 A\u030a \ufb01 \uff21", "日本語 中文 한국어", "Привет, мир", "مرحبا",
    "🙂🙃👍🏽👨‍👩‍👧",
    "<|im_start|>user\nHi<|im_end|>", "<|endoftext|>", "<s>[INST] hi [/INST]</s>", "<|begin_of_text|><|eot_id|>",
    "Hello , world . Do n't I 'm", "def f():\n    return {'a': [1, 2.5e-3]}\n", "1234567890 3.14 -7 1,000",
]  # fmt: skip
CHARACTER_POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", " \t\n\r  ", ".,;:!?'\"()[]{}<>/\\|@#$%^&*-_=+~`",
    "àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿßœ", "\u0300\u0301\u0302\u0308\u030a", "日本語中文字한국어テキスト",
    "абвгдежзийклмнопрст",
    "🙂🙃😀🚀🏳🌈👍🏽\u200d\ufe0f", "\u200b\u00a0\u2581\ufeff\x00\x7f",
]  # fmt: skip


def random_texts(count: int, seed: int) -> list[str]:
    """Strings of characters drawn from one pool after another: scripts, marks, emoji parts and odd spaces."""
    rng = random.Random(seed)
    return ["".join(rng.choice(rng.choice(CHARACTER_POOLS)) for _ in range(rng.randrange(1, 48))) for _ in range(count)]


def folder_of(name: str, tokenizer_dir: Path) -> Path:
    if name in ("demo", "test"):
        return DEMO if name == "demo" else tokenizer_dir
    if not (SHARED / name / "tokenizer.json").is_file():
        pytest.skip(f"no {SHARED / name}: the real tokenizers come with ../shared, beside the repository")
    return SHARED / name


@pytest.fixture(scope="module", params=FOLDERS)
def pair(request: pytest.FixtureRequest, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(transformers' Tokenizer, the lean Tokenizer) of one folder."""
    return load_twice(folder_of(request.param, tokenizer_dir), tmp_path_factory.mktemp("cache"))


def texts_with_special_tokens(tok: Tokenizer) -> list[str]:
    """TEXTS, random texts, and each added token (at most 40) inside text."""
    added = [t.content for _, t in sorted(tok.rust.get_added_tokens_decoder().items())][:40]
    return TEXTS + random_texts(200, seed=1) + [f"a{t}b {t} c{t}\n{t}" for t in added]


def test_encode_and_decode_as_transformers(pair: Any) -> None:
    hf, lean = pair
    assert (lean.vocab_size, lean.eos_token_id) == (hf.vocab_size, hf.eos_token_id)
    assert lean.get_vocab() == hf.get_vocab()
    for text in texts_with_special_tokens(lean):
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            assert lean.encode(text, add_special_tokens=special) == ids, text
            for skip in (True, False):
                assert lean.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    rng = random.Random(2)
    for _ in range(100):
        ids = [rng.randrange(lean.vocab_size) for _ in range(rng.randrange(1, 32))]
        for skip in (True, False):
            assert lean.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert [lean.token_bytes(i) for i in ids] == [hf.token_bytes(i) for i in ids]


def test_incremental_decode_as_transformers(pair: Any) -> None:
    from tokenmill.tokenizer import IncrementalDetokenizer

    hf, lean = pair
    for text in random_texts(20, seed=3):
        ids = hf.encode(text, add_special_tokens=False)
        deltas = []
        for tok in (hf, lean):
            detok = IncrementalDetokenizer(tok, hf.encode("Say:", add_special_tokens=False))
            deltas.append([detok.add(i) for i in ids] + [detok.flush()])
        assert deltas[0] == deltas[1]


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city", "parameters": CITY}}
CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich"}}}
CONVERSATIONS: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    ([{"role": "user", "content": "Hi 🙂"}], {}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "日本語?"}], {}),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}], {}),
    (
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        {"tools": [WEATHER]},
    ),
    ([{"role": "user", "content": "<|im_end|> inside"}], {"documents": [{"title": "t", "text": "x"}], "flag": True}),
]


def outcome(tok: Tokenizer, messages: list[dict[str, Any]], generation_prompt: bool, **kwargs: Any) -> Any:
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, **kwargs)
    except ValueError:
        return ValueError


def test_chat_templates_as_transformers(pair: Any) -> None:
    hf, lean = pair
    assert (lean.has_chat_template, lean.chat_template_text) == (hf.has_chat_template, hf.chat_template_text)
    for messages, kwargs in CONVERSATIONS:
        for generation_prompt in (True, False):
            assert outcome(lean, messages, generation_prompt, **kwargs) == outcome(
                hf, messages, generation_prompt, **kwargs
            )


# A template that reaches what transformers gives templates: its globals, filters, loop controls, the
# {% generation %} block, special-token variables, tools, documents and extra variables, whitespace control.
FEATURES = """{%- set ns = namespace(count=0) -%}
{{ bos_token }}
{%- for m in messages %}
  {%- if m.role == 'forbidden' %}{{ raise_exception('no role ' + m.role) }}{% endif %}
  {%- if m.role == 'skipped' %}{% continue %}{% endif %}
  {%- if loop.index > 6 %}{% break %}{% endif %}
  {%- set ns.count = ns.count + 1 %}
<|im_start|>{{ m.role }}
  {%- if m.content is not defined %} (no content){% else %}
{% generation %}{{ m.content if m.content is string else m.content | tojson }}{% endgeneration %}
  {%- endif %}
  {%- if m.reasoning_content is defined %} thinking={{ m.thinking }}{% endif %}
  {%- for c in m.tool_calls or [] %}
{{ c.function | tojson(indent=2, sort_keys=true) }}
  {%- endfor %}
<|im_end|>
{% endfor %}
{%- if tools %}tools={{ tools | tojson }}{% endif %}
{%- for d in documents or [] %}[{{ d.title }}] {{ d.text }}{% endfor %}
{{ dict(n=ns.count, s='<b>&</b> ü') | tojson }} {{ strftime_now('%Y') }} {{ flag | default('no flag') }} {{ eos_token }}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


def test_template_features_render_as_transformers(tokenizer_dir: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(tokenizer_dir, tmp_path / "tok")
    (folder / "chat_template.jinja").write_text(FEATURES)
    hf, lean = load_twice(folder, tmp_path / "cache")
    conversations = [*CONVERSATIONS, ([
        {"role": "system", "content": {"nested": ["ü", 1, None]}},
        {"role": "skipped", "content": "never"},
        {"role": "assistant", "content": "ok", "reasoning": "because"},
        {"role": "user", "content": None},
        *[{"role": "user", "content": str(i)} for i in range(8)],
    ], {"flag": 3})]  # fmt: skip
    for messages, kwargs in conversations:
        for generation_prompt in (True, False):
            rendered = outcome(lean, messages, generation_prompt, **kwargs)
            assert rendered == outcome(hf, messages, generation_prompt, **kwargs)
            assert rendered is not ValueError
    text = lean.decode(outcome(lean, *conversations[-1][0:1], True, flag=3), skip_special_tokens=False)
    assert '"s": "<b>&</b> ü"' in text and "thinking=because" in text and "(no content)" in text
    for refused in ([{"role": "forbidden", "content": "x"}], []):
        with pytest.raises(ValueError):
            hf.apply_chat_template(refused)
        with pytest.raises(ValueError, match="no role forbidden" if refused else "empty conversation"):
            lean.apply_chat_template(refused)


@pytest.mark.parametrize(
    ("template", "renders"),
    [("{% set ns = namespace() %}{% set ns._hidden = 1 %}{{ ns._hidden }}", False),
     ("{{ messages.__class__ }}{{ ''.__class__ }}", True),  # the sandbox: undefined, rendered empty
     ("{% for m in messages %}{{ m.content", False), ("{{ undefined_function() }}", False)],
)  # fmt: skip
def test_a_template_that_fails_fails_alike(template: str, renders: bool, tokenizer_dir: Path, tmp_path: Path) -> None:
    """Sandbox refusals, syntax errors and calls of what is not there are the caller's ValueError in both."""
    folder = shutil.copytree(tokenizer_dir, tmp_path / "tok")
    (folder / "chat_template.jinja").write_text(template)
    hf, lean = load_twice(folder, tmp_path / "cache")
    got = outcome(lean, [{"role": "user", "content": "x"}], True)
    assert got == outcome(hf, [{"role": "user", "content": "x"}], True)
    assert (got is not ValueError) == renders


def test_options_only_transformers_has_go_to_it(tokenizer_dir: Path, tmp_path: Path) -> None:
    """continue_final_message, and Python functions as tools, render through transformers from the lean tokenizer
    too (built or imported when first asked)."""
    hf, lean = load_twice(tokenizer_dir, tmp_path / "cache")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    kwargs: dict[str, Any] = {"continue_final_message": True}
    assert lean.apply_chat_template(messages, False, **kwargs) == hf.apply_chat_template(messages, False, **kwargs)

    def get_time(city: str) -> str:
        """The time in a city.

        Args:
            city: its name
        """
        return city

    assert outcome(lean, messages, True, tools=[get_time]) == outcome(hf, messages, True, tools=[get_time])


def test_wordpiece_space_cleanup_as_transformers(tmp_path: Path) -> None:
    """A WordPiece tokenizer that asks for transformers' tokenization-space cleanup gets it from the lean one too
    (and decodes through the windows: the Rust stream would not clean up)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import CORPUS

    rust = RustTokenizer(models.WordPiece(unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    rust.decoder = decoders.WordPiece()
    rust.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"]))
    PreTrainedTokenizerFast(
        tokenizer_object=rust, unk_token="[UNK]", sep_token="[SEP]", clean_up_tokenization_spaces=True
    ).save_pretrained(str(tmp_path / "wordpiece"))
    hf, lean = load_twice(tmp_path / "wordpiece", tmp_path / "cache")
    for text in ["Hello , world . Do n't you 're ?", *TEXTS]:
        ids = hf.encode(text, add_special_tokens=False)
        assert lean.decode(ids) == hf.decode(ids)
    assert lean.decode(hf.encode("Hello , world !", add_special_tokens=False)) == "Hello, world!"
    assert lean.decode_stream([], True) is None
