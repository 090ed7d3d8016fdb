"""A GGUF's byte-level BPE tokenizer (`tokenizer.ggml.model` "gpt2": Qwen2/Qwen3, Llama 3, GPT-2, gpt-oss files), built
straight from the file's metadata with the Rust `tokenizers` library: no transformers import, no per-token Python
conversion beyond reading the strings. It is the tokenizer the model's own tokenizer.json describes (and
transformers' GGUF conversion builds): the file's tokens and merges, the split regex its `tokenizer.ggml.pre`
names, the normalizer and BOS handling of that family, control tokens as special added tokens and user-defined
ones as plain added tokens.

Only pairs of (architecture, pre-tokenizer) whose result is tested against transformers are built here
(tests/unit/test_gguf_tokenizer.py): anything else returns None and takes transformers' conversion (tokenizer/gguf.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.tokenizer.backend import quick_json

Metadata = Callable[[str], Any]  # a GGUF metadata key -> its value (lists for arrays), None where absent

REVISION = 2  # raise it when what this builds changes: the folders built before are then built again

# llama.cpp's split regexes (the models' tokenizer.json spell them so too)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # single digits
# o200k's (tiktoken's GPT-4o split; llama.cpp's "gpt-4o"): words cut at a lower-to-upper case change, contractions
# kept with their word, a slash kept with the newlines after punctuation
_O200K_UPPER, _O200K_LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_O200K_UPPER}*{_O200K_LOWER}+{_CONTRACTION}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_O200K_UPPER}+{_O200K_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CONTROL, USER_DEFINED = 3, 4  # gguf.TokenType


@dataclass(frozen=True)
class Family:
    split: str | None  # None: GPT-2's own split (ByteLevel's regex)
    nfc: bool  # Qwen2's tokenizer normalizes to NFC
    ignore_merges: bool  # Llama 3's BPE takes a whole word found in the vocabulary without merging


QWEN2 = Family(QWEN2_SPLIT, nfc=True, ignore_merges=False)
LLAMA3 = Family(LLAMA3_SPLIT, nfc=False, ignore_merges=True)
GPT2 = Family(None, nfc=False, ignore_merges=False)
GPT4O = Family(GPT4O_SPLIT, nfc=False, ignore_merges=False)  # gpt-oss's o200k_harmony
# (architecture, tokenizer.ggml.pre) -> family; the pre names are llama.cpp's
FAMILIES = {
    **{(arch, pre): QWEN2 for arch in ("qwen2", "qwen3") for pre in ("qwen2", "deepseek-r1-qwen")},
    **{("llama", pre): LLAMA3 for pre in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe")},
    **{(arch, pre): GPT2 for arch in ("gpt2", "gpt-oss") for pre in ("gpt-2", "default")},
    ("gpt-oss", "gpt-4o"): GPT4O,  # the released gpt-oss files'
}


@dataclass(frozen=True)
class BuiltTokenizer:
    tokenizer_json: str
    config: dict[str, Any]  # tokenizer_config.json
    chat_template: str | None


def build(meta: Metadata) -> BuiltTokenizer | None:
    """The tokenizer of the file whose metadata `meta` reads (the weights layer reads the file: GGUFCheckpoint), or
    None where this module does not build its kind (transformers then does)."""
    if meta("tokenizer.ggml.model") != "gpt2":
        return None
    import numpy as np  # (here: a server's front loads the kept folder, and numpy would cost it 14 MB resident)

    family = FAMILIES.get((meta("general.architecture"), meta("tokenizer.ggml.pre") or "default"))
    merges: list[str] | None = meta("tokenizer.ggml.merges")
    if family is None or merges is None:
        return None
    tokens: list[str] = meta("tokenizer.ggml.tokens")
    types = np.asarray(meta("tokenizer.ggml.token_type") or [], dtype=np.int64)
    named = {name: _token(meta, tokens, f"tokenizer.ggml.{key}")
             for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                               ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}  # fmt: skip
    add_bos, add_eos = (bool(meta(f"tokenizer.ggml.add_{k}_token") or False) for k in ("bos", "eos"))
    rust = _rust_tokenizer(tokens, merges, types, family)
    _post_process(rust, named, add_bos, add_eos)
    config: dict[str, Any] = {**named, "add_bos_token": add_bos, "add_eos_token": add_eos,
                              "clean_up_tokenization_spaces": False, "tokenizer_class": "PreTrainedTokenizerFast",
                              "built_by": f"tokenmill gguf_bpe {REVISION}"}  # fmt: skip
    template = meta("tokenizer.chat_template")
    return BuiltTokenizer(quick_json(rust.to_str()), config, template if isinstance(template, str) else None)


def _rust_tokenizer(tokens: list[str], merges: list[str], types: Any, family: Family) -> Any:
    import numpy as np
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    # llama.cpp writes every token in the byte alphabet already (as tokenizer.json does)
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    rust = Tokenizer(models.BPE(vocab, pairs, ignore_merges=family.ignore_merges))  # type: ignore[arg-type]
    if family.nfc:
        rust.normalizer = normalizers.NFC()
    if family.split is None:
        rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        rust.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(family.split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    rust.decoder = decoders.ByteLevel()
    kinds = np.asarray(types)
    control = [tokens[i] for i in np.flatnonzero(kinds == CONTROL)]
    user = [tokens[i] for i in np.flatnonzero(kinds == USER_DEFINED)]
    rust.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    rust.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return rust


def _post_process(rust: Any, named: dict[str, str | None], add_bos: bool, add_eos: bool) -> None:
    """BOS/EOS around a sequence, where the file asks for them (Llama 3: BOS)."""
    from tokenizers import processors

    ends = {"bos": named["bos_token"] if add_bos else None, "eos": named["eos_token"] if add_eos else None}
    specials = [(t, rust.token_to_id(t)) for t in dict.fromkeys(v for v in ends.values() if v is not None)]
    before = f"{ends['bos']}:0 " if ends["bos"] else ""
    after = f" {ends['eos']}:0" if ends["eos"] else ""
    pair_after = f" {ends['eos']}:1" if ends["eos"] else ""
    rust.post_processor = processors.TemplateProcessing(
        single=f"{before}$A:0{after}",
        pair=f"{before}$A:0{after} {before.replace(':0', ':1')}$B:1{pair_after}",
        special_tokens=specials,
    )


def _token(meta: Metadata, tokens: list[str], key: str) -> str | None:
    index = meta(key)
    return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None
