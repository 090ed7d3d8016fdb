"""A GGUF's tokenizer metadata checked before anything is built from it: the lists that describe each token agree in
length, the special token ids lie in the vocabulary, and the embedding has a row for every token. Mismatched lists
loaded before and tokenized wrongly with no error (a short `token_type` turned control tokens into text; a short
`scores` split words into letters; an embedding shorter than the vocabulary failed every later request)."""

from __future__ import annotations

from pathlib import Path

from gguf import GGUFValueType

from tokenmill.errors import ModelLoadError
from tokenmill.weights.gguf_reader import GGUFField

MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}  # tokenizer.ggml.model values the loaders build
PER_TOKEN = ("tokenizer.ggml.token_type", "tokenizer.ggml.scores")
IDS = ("bos", "eos", "eot", "eom", "unknown", "padding", "seperator", "cls", "mask")


def check_vocabulary(fields: dict[str, GGUFField], path: Path, rows: int) -> None:
    """ModelLoadError, in one line naming the key, where the tokenizer metadata cannot describe `rows` embedding
    rows' tokens (fewer rows than tokens is an error; more is the usual padding)."""
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None or tokens.type != GGUFValueType.ARRAY or tokens.item_type != GGUFValueType.STRING:
        raise ModelLoadError(f"{path} lacks tokenizer.ggml.tokens, an array of strings (the vocabulary)")
    n = tokens.count
    model = fields.get("tokenizer.ggml.model")
    kind = model.contents() if model is not None else None
    if kind not in MODELS:
        raise ModelLoadError(f"{path}: tokenizer.ggml.model is {kind!r}; supported: "
                             + ", ".join(f"{k} ({v})" for k, v in MODELS.items()))  # fmt: skip
    needs = {"gpt2": "tokenizer.ggml.merges", "llama": "tokenizer.ggml.scores"}[kind]
    if needs not in fields:
        raise ModelLoadError(f"{path}: a {MODELS[kind]} tokenizer needs {needs}, which the file lacks")
    for key in PER_TOKEN:
        f = fields.get(key)
        if f is not None and (f.type != GGUFValueType.ARRAY or f.count != n):
            raise ModelLoadError(f"{path}: {key} holds {f.count} entries for the {n} tokens of tokenizer.ggml.tokens")
    for name in IDS:
        f = fields.get(f"tokenizer.ggml.{name}_token_id")
        value = f.contents() if f is not None else None
        if value is not None and (not isinstance(value, int) or not 0 <= value < n):
            raise ModelLoadError(f"{path}: tokenizer.ggml.{name}_token_id is {value!r}; allowed an id in [0, {n - 1}]")
    if n > rows:
        raise ModelLoadError(f"{path}: {n} tokens (tokenizer.ggml.tokens) for {rows} rows of token_embd.weight: "
                             "every token needs a row")  # fmt: skip
