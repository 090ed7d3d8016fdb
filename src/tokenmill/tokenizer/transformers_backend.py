"""A transformers tokenizer behind the interface `Tokenizer` uses: for folders the lean tokenizer does not match
(its verdict says so), tokenizers with no tokenizer.json, the first load of a folder, and a GGUF whose tokenizer
could not be cached."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TransformersTokenizer:
    name = "transformers"

    def __init__(self, hf: Any) -> None:
        self.hf = hf

    @classmethod
    def load(cls, folder: Path) -> TransformersTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(folder)))

    @property
    def rust(self) -> Any:
        """The Rust `tokenizers.Tokenizer` it runs on (None for a slow, pure-Python tokenizer)."""
        from tokenizers import Tokenizer as RustTokenizer

        rust = getattr(self.hf, "_tokenizer", None)
        return rust if isinstance(rust, RustTokenizer) else None

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.hf.eos_token_id
        return eos if isinstance(eos, int) else None

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        return getattr(self.hf, "chat_template", None)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self.hf.special_tokens_map)

    @property
    def all_special_ids(self) -> list[int | None]:
        return list(self.hf.all_special_ids)

    @property
    def clean_up_tokenization_spaces(self) -> bool:
        return bool(getattr(self.hf, "clean_up_tokenization_spaces", False))

    def token_to_id(self, token: str) -> int | None:
        found = self.hf.convert_tokens_to_ids(token)
        return found if isinstance(found, int) else None

    def id_to_token(self, token_id: int) -> str | None:
        piece = self.hf.convert_ids_to_tokens(token_id)
        return piece if isinstance(piece, str) else None

    def get_vocab(self) -> dict[str, int]:
        return dict(self.hf.get_vocab())

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return str(self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def render_chat(self, messages: list[Any], add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        return str(
            self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
        )
