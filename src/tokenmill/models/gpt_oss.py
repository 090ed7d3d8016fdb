"""gpt-oss (`GptOssForCausalLM`): a Llama-shaped decoder with mixture-of-experts MLPs in every layer, and its quirks
(HF's modeling_gpt_oss, which the parity tests check):
- attention sinks: a learned logit per head joins each softmax's denominator (the KV backends take them:
  attention/sinks.py, and the CPU kernels' decode and prefill attention);
- sliding-window layers (128 positions) alternating with full ones (`layer_types`), one RoPE for both: YaRN;
- biases on q/k/v/o, on the router and on each expert's two linears;
- the router's softmax is over its top k logits (not all E), in the model's dtype;
- the experts' clamped SwiGLU: gate clamped above at `limit`, up to [-limit, limit], out = (up + 1) * gate * sigmoid
  (alpha * gate). The checkpoint interleaves gate and up columns ([..., ::2], [..., 1::2]); loading splits them into
  our [gate | up] rows, so an expert is a `GatedMLP` with biases and this activation;
- experts stored stacked ([E, D, 2I] and [E, I, D], transposed), or in MXFP4 blocks as the released checkpoints ship
  them (`quantization_config.quant_method: mxfp4`, kernels/mxfp4.py): on the CPU kept as blocks in the kernels'
  MXFP4 format (a 20B checkpoint in ~13 GB, not 42 GB of bf16), elsewhere dequantized exactly.

On the CPU kernels the router runs in ops/route.h and each layer's experts in one call (linear/experts.h, with the
biases and the clamped SwiGLU); decode steps run in the decode stack (stack/stack.h, stack/moe.h: the sinks, the
windows, the biased router and experts) with the modules' bits. Tensor parallelism refuses the family.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.kernels import Kernels, mxfp4
from tokenmill.kernels.kformats import MXFP4ScaleError
from tokenmill.kernels.raw_blocks import RawBlocks
from tokenmill.model_config import ModelConfig, MoEConfig
from tokenmill.models.family import ModelFamily
from tokenmill.models.layers import Attention, GatedMLP, _fused
from tokenmill.models.moe import MoECausalLM, Router, SparseMoE

SLIDING, FULL = "sliding_attention", "full_attention"
# GptOssConfig's defaults, for a config.json that leaves them out
DEFAULTS: dict[str, Any] = dict(head_dim=64, rms_norm_eps=1e-5, sliding_window=128, attention_bias=True,
                                swiglu_alpha=1.702, swiglu_limit=7.0, rope_theta=150000.0)  # fmt: skip
YARN = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=4096)  # fmt: skip


class GptOssAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads))  # [H]


class BiasedRouter(Router):
    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__(hidden_size, num_experts)
        self.bias = nn.Parameter(torch.empty(num_experts))  # [E]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, E]
        return F.linear(x, self.weight, self.bias)


class ClampedSwiGLU(GatedMLP):
    """An expert: gate_up_proj's rows are [gate | up] (the checkpoint's interleaved columns, split at load)."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig) -> None:
        super().__init__(cfg, moe.intermediate_size)
        assert moe.clamped_swiglu is not None
        self.alpha, self.limit = moe.clamped_swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if isinstance(ops := _fused(self.ops, gate_up), Kernels):  # the CPU kernels' (the one-call experts' too)
            return self.down_proj(ops.clamped_swiglu(gate_up, self.alpha, self.limit))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [T, I] each
        gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class GptOssMoE(SparseMoE):
    """Routed as transformers' GptOssTopKRouter: the top k biased logits, then their softmax in the model's dtype
    (`MoEConfig.softmax_after_top_k`; SparseMoE.route, ops/route.h)."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig) -> None:
        super().__init__(cfg, moe)
        self.gate = BiasedRouter(cfg.hidden_size, moe.num_experts)
        self.experts = nn.ModuleList(ClampedSwiGLU(cfg, moe) for _ in range(moe.num_experts))


class GptOssForCausalLM(MoECausalLM):
    hf_part_renames = (("router", "gate"),)

    def build_decoder(self, cfg: ModelConfig) -> None:
        super().build_decoder(cfg)
        assert cfg.moe is not None
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = GptOssAttention(cfg, i)
            layer.mlp = GptOssMoE(cfg, cfg.moe)

    @classmethod
    def hf_tensors(cls, tensors: Iterable[Any]) -> Iterator[Any]:
        """The experts' stacked tensors as each expert's: `experts.gate_up_proj` [E, D, 2I] (or its MXFP4 `_blocks`
        and `_scales`, [E, 2I, D/32, 16] and [E, 2I, D/32]) -> `experts.{e}.gate_proj` / `up_proj` [I, D], and
        `down_proj` likewise; biases [E, 2I] / [E, D] split the same way. Other tensors pass as they are."""
        held: dict[str, torch.Tensor] = {}  # an MXFP4 weight's blocks or scales, until the other half comes
        for name, tensor, where in tensors:
            stem, _, part = name.rpartition(".experts.")
            if not stem or part not in EXPERT_PARTS:
                yield name, tensor, where
                continue
            base, scales = part.removesuffix("_blocks").removesuffix("_scales"), None
            if base != part:  # MXFP4: dequantized expert by expert once both halves are in
                other = f"{stem}.experts.{base}{'_scales' if part.endswith('_blocks') else '_blocks'}"
                if other not in held:
                    held[name] = tensor
                    continue
                tensor, scales = (tensor, held.pop(other)) if part.endswith("_blocks") else (held.pop(other), tensor)
            yield from _per_expert(f"{stem}.experts", base, _experts(name, tensor, scales), where)
        if held:
            raise ModelLoadError(f"MXFP4 tensor(s) {', '.join(held)} came without their blocks or scales")


EXPERT_PARTS = {f"{p}{s}" for p in ("gate_up_proj", "down_proj") for s in ("", "_bias", "_blocks", "_scales")}


def _experts(name: str, tensor: torch.Tensor, scales: torch.Tensor | None) -> Iterator[torch.Tensor | RawBlocks]:
    """Each expert's [out, in] weight or [out] bias from a stacked one: [E, in, out] (transposed), [E, out], or MXFP4
    blocks [E, out, in/32, 16] with their scales [E, out, in/32], one expert at a time: as blocks for the kernels'
    MXFP4 format, or dequantized where a scale is one its panels cannot hold."""
    for e in range(tensor.shape[0]):
        if scales is None:
            yield tensor[e] if tensor.dim() == 2 else tensor[e].t()
            continue
        try:
            try:
                yield mxfp4.raw_blocks(tensor[e], scales[e])
            except MXFP4ScaleError:
                yield mxfp4.dequantize(tensor[e], scales[e])
        except (ValueError, IndexError, RuntimeError) as err:
            raise ModelLoadError(f"{name}: {err}") from None


def _per_expert(
    stem: str, base: str, experts: Iterator[torch.Tensor | RawBlocks], where: str
) -> Iterator[tuple[str, torch.Tensor | RawBlocks, str]]:
    """HF's per-expert names for each expert's tensor, the gate|up one split into gate and up (its rows interleave
    them: gate, up, gate, up, ...)."""
    proj, _, bias = base.partition("_proj")
    kind = "bias" if bias else "weight"
    for e, tensor in enumerate(experts):
        if proj == "gate_up":
            yield f"{stem}.{e}.gate_proj.{kind}", _every_other(tensor, 0), where
            yield f"{stem}.{e}.up_proj.{kind}", _every_other(tensor, 1), where
        else:
            yield f"{stem}.{e}.down_proj.{kind}", tensor, where


def _every_other(t: torch.Tensor | RawBlocks, first: int) -> torch.Tensor | RawBlocks:
    """Rows first, first + 2, ... (a tensor's, or a block weight's rows of blocks)."""
    if isinstance(t, RawBlocks):
        return t.rows(torch.arange(first, t.shape[0], 2))
    return t[first::2]


def _gpt_oss_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A gpt-oss config.json with GptOssConfig's defaults filled in; one line for a layer type we do not run."""
    # (a null head_dim is hidden / heads, a null window none, as in GptOssConfig; other nulls take the defaults)
    out = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k in ("head_dim", "sliding_window")}}
    if not out.get("rope_parameters") and not out.get("rope_scaling"):
        out["rope_scaling"] = YARN
    layers = int(out.get("num_hidden_layers") or 0)
    out["layer_types"] = out.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    unknown = sorted(set(out["layer_types"]) - {SLIDING, FULL})
    if unknown:
        raise ConfigError(f"config.json: layer_types {unknown} are not supported; supported: {SLIDING}, {FULL}")
    return out


def _gpt_oss_quirks(hf: dict[str, Any]) -> dict[str, Any]:
    swiglu = (float(hf["swiglu_alpha"]), float(hf["swiglu_limit"]))
    moe = MoEConfig.from_hf(hf, int(hf.get("num_hidden_layers") or 0), clamped_swiglu=swiglu,
                            softmax_after_top_k=True)  # fmt: skip
    bias = bool(hf["attention_bias"])
    return {"moe": moe, "attention_sinks": True, "mlp_bias": True, "attention_bias": bias, "o_proj_bias": bias,
            "layer_types": tuple(hf["layer_types"])}  # fmt: skip


def _gpt_oss_make_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """make-model's shape fields -> GptOssConfig's (v5 `rope_parameters`: YaRN unless the shape says otherwise)."""
    out = dict(fields)
    theta, scaling = out.pop("rope_theta", DEFAULTS["rope_theta"]), out.pop("rope_scaling", None)
    out["rope_parameters"] = {"rope_theta": theta, **(scaling or YARN)}
    return out


GPT_OSS = ModelFamily("gpt_oss", ("GptOssForCausalLM",), ("gpt_oss",), GptOssForCausalLM, "GptOssConfig",
                      adapt_config=_gpt_oss_quirks, normalize_hf=_gpt_oss_config,
                      make_fields=_gpt_oss_make_fields, quant_methods=("mxfp4",), loads_fp8=False)  # fmt: skip
