"""A GGUF file (llama.cpp's format) as a checkpoint: its metadata as a Hugging Face config, its tensors under HF
names, read memory-mapped by our own parser (`gguf_reader`: the `gguf` package's reader takes seconds on a large
vocabulary) and dequantized, where needed, by the `gguf` package.

- Architectures: `GGUF_ARCHS`. The config is built from `{arch}.*` metadata (llama.cpp's keys) and the tensor
  table (no `output.weight`: tied embeddings; `attn_q.bias`: attention biases; `rope_freqs`: llama3 RoPE;
  `rope_factors_long/short`: Phi-3's LongRoPE). `attention.sliding_window` gives the `llama` arch (Mistral v0.1)
  and `phi3` a window in every layer (0: none, as Phi-4's files say). A `gpt-oss` file's window holds in every other
  layer from the first, as llama.cpp runs it.
- Tensors: F32, F16 and BF16 load as they are. Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q4_1 (the Q4_K_M,
  Q5_K_M and Q6_K mixes), IQ4_NL, IQ4_XS and MXFP4 (gpt-oss's experts) arrive as `RawBlocks`, their rows of ggml
  blocks in the map itself, which the loader repacks into the kernel formats in one pass, without re-quantizing
  (kernels/raw_blocks.py).
  The other ggml types in `DEQUANTIZED` (Q2_K, Q3_K) are dequantized with a one-line notice (and the loader
  dequantizes, exactly, an MXFP4 tensor whose scales the panels' fp16 cannot hold).
- llama.cpp's `llama` arch rotates interleaved pairs where HF rotates halves, and its converter permutes the Q/K
  rows for that; they are permuted back here. The other archs rotate halves, as HF does. `phi3` keeps q|k|v and
  gate|up fused, as HF's Phi-3 does. RoPE over part of the head (Phi-4-mini) is refused.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenmill.errors import ModelLoadError
from tokenmill.kernels.raw_blocks import GGUF_BLOCK_TYPES, RawBlocks
from tokenmill.weights.gguf_names import gguf_experts, gguf_to_hf, hf_expert_name
from tokenmill.weights.gguf_vocab import check_vocabulary

if TYPE_CHECKING:
    from tokenmill.weights.gguf_reader import GGUFTensor

# GGUF `general.architecture` -> the HF architecture whose model code runs it
GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "gpt2": "GPT2LMHeadModel", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
              "qwen3moe": "Qwen3MoeForCausalLM", "gpt-oss": "GptOssForCausalLM"}  # fmt: skip
# llama.cpp's expert_gating_func values: the router's softmax is the one these families use
_SOFTMAX_GATING = 1
WINDOWED = ("llama", "phi3")  # archs whose `attention.sliding_window` holds in every layer
# llama.cpp's gemma3 constants that its files do not carry: the sliding layers' RoPE base, and (unless the file
# says) one global layer in every 6
GEMMA3_LOCAL_ROPE_BASE, GEMMA3_PATTERN = 10000.0, 6
DENSE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
DEQUANTIZED = ("Q2_K", "Q3_K")
_IGNORED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")  # config, not weights


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


class GGUFCheckpoint:
    """One GGUF file, opened (memory-mapped) and checked: architecture, tensor types, tensor sizes."""

    def __init__(self, path: Path) -> None:
        from tokenmill.weights.gguf_reader import GGUFError, GGUFFile

        self.path = path
        try:  # the reader checks every offset, each tensor's bytes included, against the file's size
            self.reader = GGUFFile(path)
        except (GGUFError, OSError) as e:
            raise ModelLoadError(f"{path} is not a GGUF file, or is truncated or corrupt ({_first_line(e)})") from None
        self.arch = str(self._field("general.architecture", ""))
        if self.arch not in GGUF_ARCHS:
            raise ModelLoadError(f"GGUF architecture {self.arch!r} in {path} is not supported; supported: "
                                 f"{', '.join(GGUF_ARCHS)}")  # fmt: skip
        self.tensors = {t.name: t for t in self.reader.tensors}
        supported = (*DENSE, *GGUF_BLOCK_TYPES, *DEQUANTIZED)
        for t in self.reader.tensors:
            kind = t.tensor_type.name
            if kind not in supported:
                raise ModelLoadError(f"{path}: tensor {t.name} is {kind}, a type tokenmill does not load; "
                                     f"supported: {', '.join(supported)}")  # fmt: skip

    def metadata(self, key: str) -> Any:
        """One metadata key's value (a list for an array), None where the file has no such key."""
        return self._field(key)

    def _field(self, key: str, default: Any = None) -> Any:
        from tokenmill.weights.gguf_reader import GGUFError

        f = self.reader.fields.get(key)
        try:
            return default if f is None else f.contents()
        except GGUFError as e:  # a string array's item that is not UTF-8 (decoded only now)
            raise ModelLoadError(f"{self.path} is corrupt ({_first_line(e)})") from None

    def _meta(self, key: str, default: Any = None) -> Any:
        """`{arch}.key`, required unless a default is given."""
        value = self._field(f"{self.arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{self.path} lacks the metadata key {self.arch}.{key}")
        if isinstance(value, list):  # per-layer values (llama.cpp allows them): only uniform ones are supported
            if len(set(value)) != 1:
                raise ModelLoadError(f"{self.path}: per-layer {self.arch}.{key} values are not supported")
            value = value[0]
        return value

    def _count(self, key: str, default: Any = None, low: int = 1) -> int:
        """`{arch}.key` as a whole number >= low (a count or a length): one line naming the key where it is not."""
        value = self._meta(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < low:
            raise ModelLoadError(f"{self.path}: {self.arch}.{key} is {value!r}; allowed an integer >= {low}")
        return int(value)

    def _positive(self, key: str, default: Any = None) -> float:
        """`{arch}.key` as a finite number > 0 (an epsilon, a RoPE base or factor): one line naming the key where
        it is not (a RoPE base of 0 made every logit NaN)."""
        value = self._meta(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise ModelLoadError(f"{self.path}: {self.arch}.{key} is {value!r}; allowed a finite number > 0")
        return float(value)

    @property
    def dtype(self) -> str:
        """The compute dtype "auto" means: float32 for an all-F32 file, else bfloat16."""
        kinds = {t.tensor_type.name for t in self.reader.tensors if len(t.shape) > 1}
        return "float32" if kinds <= {"F32"} else "bfloat16"

    def block_formats(self) -> set[str]:
        """The kernel formats the file's block tensors load as."""
        kinds = GGUF_BLOCK_TYPES
        return {kinds[t.tensor_type.name] for t in self.reader.tensors if t.tensor_type.name in kinds}

    def check_tokenizer(self, vocab_size: int) -> None:
        """ModelLoadError where the tokenizer metadata cannot describe the embedding's `vocab_size` rows of tokens
        (gguf_vocab.py): before a tokenizer is built from it."""
        check_vocabulary(self.reader.fields, self.path, vocab_size)

    def hf_config(self) -> dict[str, Any]:
        embd = self.tensors.get("token_embd.weight")
        if embd is None:
            raise ModelLoadError(f"{self.path} has no token_embd.weight tensor")
        if len(embd.shape) != 2:
            raise ModelLoadError(f"{self.path}: token_embd.weight has shape {list(embd.shape)}; allowed [hidden, "
                                 "vocab]")  # fmt: skip
        vocab = int(embd.shape[1])  # ggml order: [hidden, vocab]
        hidden, heads = self._count("embedding_length"), self._count("attention.head_count")
        eos = [self._field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        common = {
            "architectures": [GGUF_ARCHS[self.arch]],
            "model_type": self.arch,
            "vocab_size": vocab,
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": list(dict.fromkeys(int(e) for e in eos if e is not None)),
            "torch_dtype": self.dtype,
        }
        if self.arch == "gpt2":
            return {**common, "n_embd": hidden, "n_head": heads, "n_layer": self._count("block_count"),
                    "n_positions": self._count("context_length"),
                    "n_inner": self._count("feed_forward_length"),
                    "layer_norm_epsilon": self._positive("attention.layer_norm_epsilon"),
                    "activation_function": "gelu_new", "tie_word_embeddings": True}  # fmt: skip
        head_dim = self._count("attention.key_length", hidden // heads)
        config = {
            **common,
            "hidden_size": hidden,
            "num_hidden_layers": self._count("block_count"),
            "intermediate_size": self._count("feed_forward_length"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._count("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "rms_norm_eps": self._positive("attention.layer_norm_rms_epsilon"),
            "max_position_embeddings": self._count("context_length"),
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "rope_parameters": self._rope(head_dim),
        }
        rotated = self._count("rope.dimension_count", head_dim)
        if rotated != head_dim:
            raise ModelLoadError(
                f"{self.path}: RoPE over {rotated} of each head's {head_dim} dimensions (rope.dimension_count) is "
                "not supported; supported: RoPE over the whole head"
            )
        window = self._count("attention.sliding_window", 0, low=0) if self.arch in WINDOWED else 0
        if window:  # (ModelConfig drops a window no shorter than the context)
            config["sliding_window"] = window
        if self.arch == "gpt-oss":
            return self._gpt_oss(config)
        if self._count("expert_count", 0, low=0):
            return self._experts(config)
        return self._gemma3(config) if self.arch == "gemma3" else config

    def _experts(self, config: dict[str, Any]) -> dict[str, Any]:
        """A mixture of experts (qwen3moe; a `llama` file with experts is Mixtral), as llama.cpp runs the file: a
        softmax router whose top-k weights are renormalised (unless `expert_weights_norm` says otherwise), and
        experts in the layers whose router (`ffn_gate_inp`) the file holds."""
        if self.arch not in ("qwen3moe", "llama"):
            raise ModelLoadError(f"{self.path}: experts in a GGUF {self.arch} file are not supported; supported: "
                                 "qwen3moe, and llama files with experts (Mixtral)")  # fmt: skip
        shared, gating = self._count("expert_shared_count", 0, low=0), self._count("expert_gating_func", 1, low=0)
        if shared or gating != _SOFTMAX_GATING:
            what = f"{shared} shared experts" if shared else f"router gating function {gating}"
            raise ModelLoadError(f"{self.path}: a mixture of experts with {what} is not supported; supported: a "
                                 "softmax router over routed experts only")  # fmt: skip
        n = config["num_hidden_layers"]
        moe = {
            "num_experts": self._count("expert_count", low=0),
            "num_experts_per_tok": self._count("expert_used_count"),
            "moe_intermediate_size": self._count("expert_feed_forward_length", config["intermediate_size"]),
            "norm_topk_prob": bool(self._meta("expert_weights_norm", True)),
            "mlp_only_layers": [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" not in self.tensors],
        }
        if self.arch == "llama":
            return {**config, **moe, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
        return {**config, **moe, "model_type": "qwen3_moe"}  # (transformers' name, which picks its tokenizer class)

    def _gpt_oss(self, config: dict[str, Any]) -> dict[str, Any]:
        """gpt-oss as llama.cpp runs the file: windows in every other layer from the first, and what its files do not
        carry taken as transformers' GptOssConfig has it (YaRN's betas 32 and 1, untruncated; the SwiGLU's 1.702 and
        7.0)."""
        rope = {**config["rope_parameters"], "truncate": False,
                "beta_fast": self._positive("rope.scaling.yarn_beta_fast", 32.0),
                "beta_slow": self._positive("rope.scaling.yarn_beta_slow", 1.0)}  # fmt: skip
        n = config["num_hidden_layers"]
        return {**config, "model_type": "gpt_oss", "rope_parameters": rope,
                "num_local_experts": self._count("expert_count", low=0),
                "num_experts_per_tok": self._count("expert_used_count"),
                "intermediate_size": self._count("expert_feed_forward_length", config["intermediate_size"]),
                "sliding_window": self._count("attention.sliding_window", low=0),
                "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]}  # fmt: skip

    def _gemma3(self, config: dict[str, Any]) -> dict[str, Any]:
        """Gemma 3's own fields, as llama.cpp runs the file: the window, one global layer in `pattern`, the local
        RoPE base, and attention scaled by head_dim ** -0.5 (by (hidden / heads) ** -0.5 for the 62-layer 27B)."""
        hidden, heads, head_dim = config["hidden_size"], config["num_attention_heads"], config["head_dim"]
        scalar = hidden // heads if config["num_hidden_layers"] == 62 else head_dim
        pattern = self._field(f"{self.arch}.attention.sliding_window_pattern", GEMMA3_PATTERN)
        n = config["num_hidden_layers"]
        if isinstance(pattern, list):  # newer files: a flag per layer, true where it slides
            sliding = [bool(x) for x in pattern]
        elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
            sliding = [(i + 1) % pattern != 0 for i in range(n)]
        else:
            raise ModelLoadError(f"{self.path}: {self.arch}.attention.sliding_window_pattern is {pattern!r}; allowed "
                                 "an integer >= 1 or a flag per layer")  # fmt: skip
        return {**config, "model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
                "sliding_window": self._count("attention.sliding_window", low=0),
                "layer_types": ["sliding_attention" if x else "full_attention" for x in sliding],
                "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE, "query_pre_attn_scalar": scalar}  # fmt: skip

    def _rope(self, head_dim: int) -> dict[str, Any]:
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self._positive("rope.freq_base", 10000.0)}
        kind = str(self._meta("rope.scaling.type", "none"))
        if kind == "linear":
            rope.update(rope_type="linear", factor=self._positive("rope.scaling.factor"))
        elif kind == "yarn":
            rope.update(
                rope_type="yarn",
                factor=self._positive("rope.scaling.factor"),
                original_max_position_embeddings=self._count("rope.scaling.original_context_length"),
            )
        elif kind != "none":
            raise ModelLoadError(f"{self.path}: RoPE scaling {kind!r} is not supported (none, linear, yarn)")
        freqs = self.tensors.get("rope_freqs.weight")
        if freqs is not None:  # llama3 scaling, stored as the divisor of each frequency
            if rope["rope_type"] != "default":
                raise ModelLoadError(f"{self.path}: rope_freqs together with {kind} scaling is not supported")
            rope.update(rope_type="freq_factors", freq_factors=self._factors(freqs, head_dim))
        if "rope_factors_long.weight" in self.tensors or "rope_factors_short.weight" in self.tensors:
            return self._longrope(rope, head_dim)
        return rope

    def _longrope(self, rope: dict[str, Any], head_dim: int) -> dict[str, Any]:
        """Phi-3 128k / Phi-3.5's LongRoPE: each frequency's divisor, the short ones up to the original context and
        the long ones past it, and the cos/sin scale llama.cpp applies (`attn_factor`)."""
        long, short = (self.tensors.get(f"rope_factors_{k}.weight") for k in ("long", "short"))
        if long is None or short is None or rope["rope_type"] != "default":
            what = "only one of its factor tensors" if long is None or short is None else f"{rope['rope_type']} RoPE"
            raise ModelLoadError(f"{self.path}: LongRoPE with {what} is not supported; supported: rope_factors_long "
                                 "and rope_factors_short together, with no other RoPE scaling")  # fmt: skip
        rope.update(
            rope_type="longrope",
            long_factor=self._factors(long, head_dim),
            short_factor=self._factors(short, head_dim),
            original_max_position_embeddings=self._count("rope.scaling.original_context_length"),
        )
        scale = self._field(f"{self.arch}.rope.scaling.attn_factor")
        if scale is not None:  # (else the model derives HF's default from the two context lengths)
            rope["attention_factor"] = float(scale)
        return rope

    def _factors(self, t: GGUFTensor, head_dim: int) -> list[float]:
        """A RoPE factor tensor's values, one per frequency (head_dim / 2)."""
        values = [float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1)]
        if len(values) != head_dim // 2:
            raise ModelLoadError(f"{self.path}: {t.name} holds {len(values)} values; head_dim {head_dim} needs "
                                 f"{head_dim // 2}")  # fmt: skip
        return values

    def iter_tensors(self, hf_config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor | RawBlocks, str]]:
        """(HF name, tensor or blocks, file) for every model tensor, Q/K rows un-permuted for the llama arch."""
        dequantized: dict[str, int] = {}
        for t in self.reader.tensors:
            if t.name in _IGNORED:
                continue
            experts = gguf_experts(t.name)
            if experts is not None:
                yield from self._experts_of(t, *experts, dequantized)
                self.reader.release(t)
                continue
            name = gguf_to_hf(self.arch, t.name)
            if name is None:
                raise ModelLoadError(f"unexpected tensor {t.name!r} in {self.path} for GGUF arch {self.arch}")
            value = self._value(t, dequantized)
            if self.arch == "gemma3" and t.name.endswith("norm.weight"):  # llama.cpp stores Gemma's norms as 1 + w
                value = value.float() - 1.0 if isinstance(value, torch.Tensor) else value
            if self.arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias", "attn_k.weight",
                                                          "attn_k.bias")):  # fmt: skip
                heads = hf_config["num_attention_heads" if ".attn_q." in t.name else "num_key_value_heads"]
                value = _unpermute(value, heads)
            yield name, value, str(self.path)
            # packed or copied by now, or (q, k, gate: until their fused partners come) held as a view, whose
            # later read maps the pages again: they need not stay in this process's memory meanwhile
            self.reader.release(t)
        for t in self.reader.tensors:  # a shard held for its fused partners was read (packed) after its release
            self.reader.release(t)
        if dequantized:
            kinds = ", ".join(f"{n} {k}" for k, n in sorted(dequantized.items()))
            print(f"tokenmill: {self.path.name}: {kinds} tensor(s) have no tokenmill kernel and were dequantized "
                  "(to the model dtype)", file=sys.stderr, flush=True)  # fmt: skip

    def copy_out(self, model: torch.nn.Module) -> None:
        """After loading: every parameter still lying in the file's read-only map (a dense tensor kept as it came,
        as a BF16 file's token embedding, or a linear no kernel packs) gets a copy of its own, so nothing can write
        to the map. Only those are copied: the dense weights the packed cache held were never read."""
        copies: dict[int, torch.nn.Parameter] = {}  # a tied weight stays one parameter
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is None or p.device.type != "cpu" or not self.reader.maps(p.untyped_storage().data_ptr()):
                    continue
                if id(p) not in copies:
                    copies[id(p)] = torch.nn.Parameter(p.detach().clone(), requires_grad=False)
                module._parameters[name] = copies[id(p)]

    def _experts_of(
        self, t: GGUFTensor, layer: int, proj: str, expert: int | None, kind: str, dequantized: dict[str, int]
    ) -> Iterator[tuple[str, torch.Tensor | RawBlocks, str]]:
        """Each expert's weight in a layer's [E, rows, cols] expert tensor (its rows where they lie in the map), or
        the one expert an older file's tensor holds; gpt-oss's biases, [E, rows], row by row."""
        value = self._value(t, dequantized)
        if expert is not None:
            yield hf_expert_name(layer, proj, expert, kind), value, str(self.path)
            return
        dims = 2 if kind == "bias" else 3
        experts = int(t.shape[-1]) if len(t.shape) == dims else 0  # ggml order: [cols, rows, experts]
        if not experts:
            what = "an expert bias is 2-D" if kind == "bias" else "an expert tensor is 3-D"
            raise ModelLoadError(f"{self.path}: {t.name} has shape {list(t.shape)}; {what}")
        rows = value.shape[0] // experts if dims == 3 else 1
        for e in range(experts):
            part: torch.Tensor | RawBlocks
            if isinstance(value, torch.Tensor):
                part = value[e] if dims == 2 else value[e * rows : (e + 1) * rows]
            else:
                part = value.row_range(e * rows, (e + 1) * rows)
            yield hf_expert_name(layer, proj, e, kind), part, str(self.path)

    def _value(self, t: GGUFTensor, dequantized: dict[str, int]) -> torch.Tensor | RawBlocks:
        """The tensor in torch order, [rows, cols] (a 3-D one's leading dimensions folded into its rows)."""
        kind, shape = t.tensor_type.name, [int(n) for n in reversed(t.shape)]
        shape = [int(np.prod(shape[:-1])), shape[-1]] if len(shape) > 2 else shape
        if kind in GGUF_BLOCK_TYPES:  # read from the map in place: the loader repacks them in one pass
            return RawBlocks(GGUF_BLOCK_TYPES[kind], _torch_bytes(t.data).view(shape[0], -1), shape[1])
        if kind in DENSE:  # the map too: a weight the packed cache holds is never read (`copy_out`: the kept ones)
            return _torch_bytes(t.data).view(DENSE[kind]).view(shape)
        import gguf

        dequantized[kind] = dequantized.get(kind, 0) + 1
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).view(shape)


def _torch_bytes(data: np.ndarray) -> torch.Tensor:
    """A tensor's bytes where they lie in the read-only map, [bytes] uint8, for readers only (torch warns that it
    cannot write there: a write would end the process)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(data).view(np.uint8)).view(-1)


def _unpermute(value: torch.Tensor | RawBlocks, heads: int) -> torch.Tensor | RawBlocks:
    """Undo convert_hf_to_gguf's Q/K permutation: per head, rows [x0, y0, x1, y1, ...] -> [x0, x1, ..., y0, y1, ...]."""
    rows = value.shape[0]
    index = torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    return value[index] if isinstance(value, torch.Tensor) else value.rows(index)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
