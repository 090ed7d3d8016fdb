"""The lean tokenizer: a tokenizer folder read without transformers. The Rust `tokenizers` library loads
tokenizer.json; tokenizer_config.json (with special_tokens_map.json and the chat template files, where transformers
reads them) gives the special tokens, the chat templates and the decode options. It follows transformers 5's
`TokenizersBackend` (tokenization_utils_tokenizers.py) and `PreTrainedTokenizerBase` (tokenization_utils_base.py);
where a tokenizer class of transformers changes more on load, `verdict` notices and keeps transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenmill.tokenizer import chat_template

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# apply_chat_template's own arguments that the lean renderer leaves to transformers
TRANSFORMERS_ONLY = frozenset({"continue_final_message", "sanitize_control_tokens", "return_assistant_tokens_mask"})
# ... and those that only matter when it tokenizes (ours never asks it to)
TOKENIZING_ONLY = frozenset(
    {"tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "tokenizer_kwargs"}
)


class LeanTokenizer:
    """`tokenizer_json`: the Rust tokenizer to load, where it is not the folder's own (transformers' tokenizer class
    rebuilt it on load: `verdict` keeps that one)."""

    name = "lean"

    def __init__(self, folder: Path, tokenizer_json: Path | None = None) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.folder = folder
        config = read_config(folder)
        self.rust = RustTokenizer.from_file(str(tokenizer_json or folder / "tokenizer.json"))
        self.rust.no_truncation()  # transformers encodes without either unless asked
        self.rust.no_padding()
        self.rust.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self.special_tokens_map, self._extra_special = special_tokens(config)
        self.chat_template = chat_templates(folder, config)
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        # transformers skips the cleanup (meant for WordPiece) on a BPE unless told it really wants it
        self._cleans_up = self.clean_up_tokenization_spaces and (
            type(self.rust.model).__name__ != "BPE"
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"))
        )
        self._transformers: Any = None

    @property
    def vocab_size(self) -> int:
        return int(self.rust.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens_map.get("eos_token")
        return None if eos is None else self.token_to_id(eos)

    @property
    def all_special_ids(self) -> list[int | None]:
        tokens = dict.fromkeys([*self.special_tokens_map.values(), *self._extra_special])  # in order, once each
        return [self.token_to_id(t) for t in tokens]

    def token_to_id(self, token: str) -> int | None:
        """A token's id; one missing from the vocabulary reads as the unknown token's, as in transformers."""
        found = self.rust.token_to_id(token)
        if found is None and (unk := self.special_tokens_map.get("unk_token")) is not None:
            found = self.rust.token_to_id(unk)
        return None if found is None else int(found)

    def id_to_token(self, token_id: int) -> str | None:
        piece = self.rust.id_to_token(token_id)
        return None if piece is None else str(piece)

    def get_vocab(self) -> dict[str, int]:
        return dict(self.rust.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.rust.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        text = str(self.rust.decode(token_ids, skip_special_tokens=skip_special_tokens))
        return clean_up_tokenization(text) if self._cleans_up else text

    def render_chat(self, messages: list[Any], add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        """The conversation's text through its chat template (jinja2's TemplateError where the template fails)."""
        if TRANSFORMERS_ONLY & kwargs.keys():  # options of transformers' own, rarely asked for: its tokenizer
            return str(self.transformers().apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
            ))  # fmt: skip
        variables = {k: v for k, v in kwargs.items() if k not in TOKENIZING_ONLY}
        name, tools, documents = (variables.pop(k, None) for k in ("chat_template", "tools", "documents"))
        template = chat_template.pick_template(self.chat_template, name, tools)
        variables = {**self.special_tokens_map, **variables}
        return chat_template.render(template, messages, variables, tools, documents, add_generation_prompt)

    def transformers(self) -> Any:
        """transformers' tokenizer of the same folder, built on first use."""
        if self._transformers is None:
            from transformers import AutoTokenizer

            self._transformers = AutoTokenizer.from_pretrained(str(self.folder))
        return self._transformers


def read_config(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json, with special_tokens_map.json's tokens where transformers still reads that file (a
    config without `added_tokens_decoder`)."""
    path = folder / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    legacy = folder / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and legacy.is_file():
        for key, value in json.loads(legacy.read_text(encoding="utf-8")).items():
            if key == "extra_special_tokens" and isinstance(value, list):
                config[key] = [*(config.get(key) or []), *(v for v in value if v not in (config.get(key) or []))]
            else:
                config[key] = value
    return config


def _token_text(value: Any) -> str | None:
    """A special token as the config writes it: its text, or an AddedToken's fields."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def special_tokens(config: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """(the named special tokens, bos_token etc. and a model's own `*_token`s, as the chat template sees them;
    the unnamed extra special tokens)."""
    named = {k: t for k in NAMED_SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
    for key, value in config.items():  # a model's own named tokens: image_token=..., a string or an AddedToken
        is_token = isinstance(value, str) or (isinstance(value, dict) and value.get("__type") == "AddedToken")
        if key.endswith("_token") and key not in NAMED_SPECIAL_TOKENS and is_token:
            named[key] = str(_token_text(value))
    extra = config.get("extra_special_tokens") or []
    if isinstance(extra, dict):
        named.update({k: t for k, v in extra.items() if (t := _token_text(v)) is not None})
        extra = []
    return named, [t for v in extra if (t := _token_text(v)) is not None]


def chat_templates(folder: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """chat_template.jinja and additional_chat_templates/*.jinja where present (they take priority), else the
    config's `chat_template` (one, or a list of named ones)."""
    found: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        found["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for path in extra.glob("*.jinja"):
            found[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if list(found) == ["default"]:
        return found["default"]
    if found:
        return found
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    return template if isinstance(template, str | dict) else None


def clean_up_tokenization(text: str) -> str:
    """transformers' cleanup of spaces a WordPiece decode leaves before punctuation and contractions."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                           (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):  # fmt: skip
        text = text.replace(spaced, joined)
    return text
