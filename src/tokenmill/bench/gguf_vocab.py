"""A Hugging Face tokenizer as GGUF metadata, as llama.cpp's `convert_hf_to_gguf.py` writes it (the GGUF export's
vocabulary: bench/gguf_export.py).

- byte-level BPE -> `tokenizer.ggml.model = "gpt2"` with tokens, token types and merges, and `tokenizer.ggml.pre`
  chosen from the pre-tokenizer's split regex, so llama.cpp splits text as HF does;
- SentencePiece-style BPE with byte fallback (Llama 2) -> `"llama"` with scores from the merge ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenmill.tokenizer.gguf_bpe import GPT4O_SPLIT, LLAMA3_SPLIT, QWEN2_SPLIT

# GPT-2's own split (also what `ByteLevel(use_regex=True)` applies); Llama 3's, Qwen2's and o200k's are the
# tokenizer's own (tokenizer/gguf_bpe.py), which reads them back from the names written here
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_SPLIT_REGEX_TO_PRE = {_GPT2_REGEX: "gpt-2", LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2", GPT4O_SPLIT: "gpt-4o"}


def write_vocab(writer: Any, hf_dir: Path, config: dict[str, Any]) -> None:
    """Tokens, types, merges or scores, special ids, as the tokenizer transformers loads (AutoTokenizer) has them.

    The effective tokenizer can differ from tokenizer.json: transformers 5 gives `model_type: qwen2` checkpoints
    Qwen2's split regex and NFC whatever tokenizer.json says, and tokenmill tokenizes through AutoTokenizer too.
    """
    import gguf
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(hf_dir))
    except Exception as e:
        raise ValueError(f"cannot load the tokenizer of {hf_dir}: {e}") from e
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"{hf_dir} has no fast (tokenizers) tokenizer, which the GGUF export reads")
    spec = json.loads(tok.backend_tokenizer.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer model {model.get('type')!r} is not supported by the GGUF export (BPE only)")
    n_vocab = config["vocab_size"]
    vocab: dict[str, int] = tok.get_vocab()
    if max(vocab.values()) >= n_vocab:
        raise ValueError(f"the tokenizer has ids up to {max(vocab.values())} but vocab_size is {n_vocab}")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    added = {t["id"] for t in spec.get("added_tokens", [])}
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [gguf.TokenType.UNUSED] * n_vocab
    normal = gguf.TokenType.NORMAL
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = gguf.TokenType.CONTROL if i in special else gguf.TokenType.USER_DEFINED if i in added else normal
    if model.get("byte_fallback"):  # SentencePiece-style BPE (Llama 2): llama.cpp's SPM tokenizer merges by score
        pre = spec.get("pre_tokenizer") or {}
        if pre.get("type") != "Metaspace":
            raise ValueError("unsupported SentencePiece-style tokenizer (expected a Metaspace pre-tokenizer)")
        for i, text in enumerate(tokens):
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                types[i] = gguf.TokenType.BYTE
        if tok.unk_token_id is not None:
            types[tok.unk_token_id] = gguf.TokenType.UNKNOWN
        # a merge's result scores -rank (earlier merges win, as in HF); unmergeable multi-char tokens never win
        rank = {m.replace(" ", ""): r for r, m in reversed(list(enumerate(merges)))}
        scores = [0.0 if types[i] != normal or len(t) == 1 else -float(rank.get(t, 1e9)) for i, t in enumerate(tokens)]
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_scores(scores)
        writer.add_add_space_prefix(pre.get("prepend_scheme", "always") != "never")
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(_bpe_pre_tokenizer(spec))
        writer.add_token_merges(merges)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    _write_special_tokens(writer, config, tok)


def _bpe_pre_tokenizer(spec: dict[str, Any]) -> str:
    """llama.cpp's name for the byte-level BPE pre-tokenizer in tokenizer.json (how text is split before BPE)."""
    pre, norm = spec.get("pre_tokenizer") or {}, spec.get("normalizer")
    if norm is not None and norm.get("type") != "NFC":
        raise ValueError(f"tokenizer normalizer {norm.get('type')!r} is not supported by the GGUF export")
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    regex = None
    for step in steps:
        if step.get("type") == "ByteLevel":
            if step.get("add_prefix_space"):
                raise ValueError("ByteLevel add_prefix_space=True has no llama.cpp equivalent")
            regex = _GPT2_REGEX if step.get("use_regex", True) and regex is None else regex
        elif step.get("type") == "Split" and regex is None and not step.get("invert"):
            regex = step.get("pattern", {}).get("Regex")
        else:
            raise ValueError(f"pre-tokenizer step {step.get('type')!r} is not supported by the GGUF export")
    if regex not in _SPLIT_REGEX_TO_PRE:
        raise ValueError(
            f"byte-level BPE split regex {regex!r} matches none that llama.cpp knows here "
            f"({', '.join(sorted(set(_SPLIT_REGEX_TO_PRE.values())))})"
        )
    return _SPLIT_REGEX_TO_PRE[regex]


def _write_special_tokens(writer: Any, config: dict[str, Any], tok: Any) -> None:
    """bos/eos/pad/unk ids (config.json's first, as generation uses them), whether HF adds BOS/EOS, chat template."""
    for kind, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                      ("pad", writer.add_pad_token_id), ("unk", writer.add_unk_token_id)):  # fmt: skip
        tid = config.get(f"{kind}_token_id")
        tid = tid[0] if isinstance(tid, list) and tid else tid
        tid = tid if isinstance(tid, int) else getattr(tok, f"{kind}_token_id", None)
        if isinstance(tid, int):
            add(tid)
    plain, full = tok("a", add_special_tokens=False)["input_ids"], tok("a", add_special_tokens=True)["input_ids"]
    writer.add_add_bos_token(len(full) > len(plain) and full[0] != plain[0])
    writer.add_add_eos_token(len(full) > len(plain) and full[-1] != plain[-1])
    if isinstance(tok.chat_template, str):
        writer.add_chat_template(tok.chat_template)
