"""From a model reference to ready parts: checkpoint folder, configs, tokenizer and a loaded model."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokenmill.assembly.task import resolve_task
from tokenmill.config import DTYPES, EngineConfig
from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.kernels import CudaKernels, FusedOps, Kernels
from tokenmill.kernels import active as active_kernels
from tokenmill.kernels.cuda import cuda_kernels
from tokenmill.kernels.cuda import unavailable as gpu_kernels_unavailable
from tokenmill.kernels.formats import pack as pack_weight
from tokenmill.memory import machine_bytes, return_freed_memory, trim
from tokenmill.model_config import ModelConfig
from tokenmill.models import CausalLM, family_for
from tokenmill.models.compile import compile_model
from tokenmill.models.layers import bind_kernels
from tokenmill.models.linear import (
    FORMAT_OF_QUANTIZATION,
    linear_format,
    make_row_invariant,
    place_weights,
    prepare_linears,
)
from tokenmill.models.pooling import as_pooling_model
from tokenmill.models.sharding import Shard, check_shardable, split_head, wrap_row_parallel
from tokenmill.pooling_params import ModelTask
from tokenmill.progress import progress
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer
from tokenmill.weights import fp8, load_weights, resolve_model
from tokenmill.weights.gguf_checkpoint import GGUFCheckpoint, is_gguf
from tokenmill.weights.packed_cache import PackedCache, cache_path
from tokenmill.weights.safetensors_io import count_tensors, iter_tensors
from tokenmill.weights.safetensors_io import sample as safetensors_sample
from tokenmill.weights.source import DEMO_MODEL, default_model_ref

DEMO_DRAFT = DEMO_MODEL.parent / "demo-draft"  # its draft model: `--speculative-model demo-draft`
log = logging.getLogger("tokenmill.engine")
_TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES if name != "auto"}


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    model: CausalLM
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    generation_config: dict[str, Any] = field(default_factory=dict)
    kernels: dict[str, int] = field(default_factory=dict)  # linear kernel -> how many linears use it
    ops: FusedOps | None = None  # the fused ops the model and the paged KV cache use (None: pure torch)
    task: ModelTask = field(default_factory=ModelTask)  # generation and/or pooling (assembly/task.py)

    def __post_init__(self) -> None:
        outside = self._named_eos_ids() - self.eos_token_ids
        if self.model is not None and outside:  # (the engine's load: once)
            log.warning("%s: EOS ids %s lie outside the vocabulary (%d tokens) and are ignored", self.path.name,
                        sorted(outside), self.config.vocab_size)  # fmt: skip

    def _named_eos_ids(self) -> set[int]:
        ids = set(self.config.eos_token_ids)
        eos = self.generation_config.get("eos_token_id")
        ids |= set(eos) if isinstance(eos, list) else ({eos} if isinstance(eos, int) else set())
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return {i for i in ids if isinstance(i, int)}

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """EOS ids from generation_config.json, config.json and the tokenizer, together; those outside the vocabulary
        are left out, as llama.cpp leaves out such special ids (min_tokens masks every EOS id's logit)."""
        return frozenset(i for i in self._named_eos_ids() if 0 <= i < self.config.vocab_size)

    def default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json sampling defaults (what vLLM uses when none are given)."""
        gen = self.generation_config
        kwargs = {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                  if gen.get(k) is not None}  # fmt: skip
        if gen.get("do_sample") is False:
            kwargs["temperature"] = 0.0
        if isinstance(gen.get("max_new_tokens"), int):
            kwargs["max_tokens"] = gen["max_new_tokens"]
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:  # (the message named the value, not the file it came from)
            raise ConfigError(f"generation_config.json: {e}") from None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but this PyTorch build sees no CUDA GPU; use cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, config: ModelConfig) -> torch.dtype:
    """`dtype`, or with "auto" the checkpoint's own; a checkpoint dtype we cannot compute in is an error."""
    name = config.torch_dtype if dtype == "auto" else dtype
    if name not in _TORCH_DTYPES:
        allowed = ", ".join(_TORCH_DTYPES)
        raise ConfigError(f"config.json: dtype {name!r} is not one tokenmill computes in; pass --dtype {allowed}")
    return _TORCH_DTYPES[name]


def read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path} does not exist")
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def read_checkpoint(cfg: EngineConfig) -> tuple[Path, GGUFCheckpoint | None, dict[str, Any], ModelConfig]:
    """(folder or file, the GGUF or None, config.json as a dict, our config) of the model `cfg` names: no weights
    read. Fails on an unknown architecture."""
    path = resolve_model(cfg.model or default_model_ref(), cfg.revision)
    gguf = GGUFCheckpoint(path) if is_gguf(path) else None
    hf_config = gguf.hf_config() if gguf else read_json(path / "config.json", required=True)
    if gguf:
        gguf.check_tokenizer(int(hf_config["vocab_size"]))
    return path, gguf, hf_config, family_for(hf_config).config_from_hf(hf_config)


def load_front(cfg: EngineConfig) -> LoadedModel:
    """What a front end needs of the model (configs, tokenizer, sampling defaults, EOS ids), without weights."""
    path, gguf, hf_config, config = read_checkpoint(cfg)
    generation = {} if gguf else read_json(path / "generation_config.json", required=False)
    tokenizer = Tokenizer(path, hf_config.get("model_type"), gguf.metadata if gguf else None)
    task = resolve_task(cfg.task, path, hf_config, gguf, tokenizer)
    return LoadedModel(path, config, tokenizer, None, torch.device("cpu"), torch.float32,  # type: ignore[arg-type]
                       config.max_position_embeddings, generation, task=task)  # fmt: skip


def load(cfg: EngineConfig, rank: int = 0, make_tokenizer: Callable[..., Tokenizer] = Tokenizer) -> LoadedModel:
    """The model `cfg` names; with tensor_parallel_size > 1, tensor-parallel rank `rank`'s shard of it.
    `make_tokenizer`: builds the tokenizer from (source, model_type, GGUF metadata); the engine's own process
    defers it (server/engine_process.py)."""
    return_freed_memory()  # (memory.py: glibc would keep every freed activation resident)
    path, gguf, hf_config, model_config = read_checkpoint(cfg)  # fail on the architecture before any weights
    family = family_for(hf_config)
    shard = None
    if cfg.tensor_parallel_size > 1:
        if gguf:
            raise ConfigError("tensor_parallel_size > 1 loads safetensors checkpoints; this is a GGUF file")
        check_shardable(model_config.architecture)
        shard, full_config = Shard(rank, cfg.tensor_parallel_size), model_config
        model_config = shard.local_config(model_config)
    if gguf and cfg.quantization != "none":
        _check_gguf_quantization(gguf, cfg.quantization)
    if resolve_device(cfg.device).type == "cpu":
        _check_fits(path, gguf, cfg.tensor_parallel_size, _fp8_itemsize(cfg, hf_config, model_config))
    max_len = cfg.max_model_len or model_config.max_position_embeddings
    if max_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_len} exceeds the model's max_position_embeddings="
            f"{model_config.max_position_embeddings}"
        )
    device, dtype = resolve_device(cfg.device), resolve_dtype(cfg.dtype, model_config)
    if cfg.batch_invariant and (device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32)):
        resolved = f"{device.type} {str(dtype).removeprefix('torch.')}"
        raise ConfigError(f"batch_invariant runs on the CPU in bfloat16 or float32; this model resolved to "
                          f"{resolved}: pass --device cpu and --dtype")  # fmt: skip
    tokenizer = make_tokenizer(path, hf_config.get("model_type"), gguf.metadata if gguf else None)
    task = resolve_task(cfg.task, path, hf_config, gguf, tokenizer)
    if task.pooling is not None and shard is not None:
        raise ConfigError(f"tensor_parallel_size > 1 serves generation only; this checkpoint is served for "
                          f"{', '.join(task.names)}")  # fmt: skip
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    with torch.device("meta"):
        model = family.model_class(model_config)
        if task.pooling is not None:
            as_pooling_model(model, task.pooling, task.generate)
    # each dense linear packed as it completes (unless a tensor-parallel shard splits its head first): the file's
    # pages plus one packed copy, never every weight dense and packed at once; taken from the packed cache where an
    # earlier start put it there (weights/loader.py): a GGUF's, or a folder's where the loader packs every linear
    fmt = None if shard else linear_format(cfg.quantization, device, dtype, cfg.pack_weights, cfg.cpu_kernels)
    packer = None if fmt is None else functools.partial(pack_weight, fmt=fmt)
    cache = _packed_cache(cfg, gguf, path, device) if gguf or fmt is not None else None
    if gguf:
        with progress(f"loading {path.name}", total=len(gguf.tensors)) as advance:
            load_weights(model, _ticking(gguf.iter_tensors(hf_config), advance), str(path), dtype, device, False,
                         "its GGUF metadata", cache, packer, fmt)  # fmt: skip
    else:
        with progress(f"loading {path.name}", total=count_tensors(path)) as advance:
            tensors = _ticking(((n, t, str(f)) for n, t, f in iter_tensors(path)), advance)
            if fp8.quantized(hf_config):  # (before a shard's slicing: the scales' blocks are the whole weight's)
                log.info("%s: an FP8 checkpoint; its weights dequantized to %s as they load", path.name, dtype)
                tensors = fp8.dequantized(tensors, fp8.block_size(hf_config), defer=shard is None)
            if shard is not None:
                tensors = shard.stream(tensors, full_config)
            load_weights(model, tensors, str(path), dtype, device, cache=cache, packer=packer, pack_format=fmt)
    if shard is not None:
        split_head(model, shard)  # before packing: its rows become a kernel linear like any other
    gpu_ops = _gpu_kernels(cfg, device)
    quantization = fp8.quantization_for(cfg.quantization, hf_config, device)  # (an FP8 checkpoint on a GPU)
    kernels = prepare_linears(model, quantization, device, cfg.pack_weights, cfg.cpu_kernels, gpu_ops)
    if device.type == "cpu" and not (cache and (cache.complete or cache.place(model))):  # (else: in its file)
        place_weights(model)  # one huge-page region, in the order a step reads them (kernels/placement.py)
    if gguf:  # (after the packing: a tied bf16 table is looked up in the head's panels, and never copied)
        gguf.copy_out(model)
    if shard is not None:
        wrap_row_parallel(model)
    ops: FusedOps | None = None
    if cfg.compile:
        compile_model(model)  # inductor fuses the same ops itself; the fused kernels would split its graphs
    elif cfg.cpu_kernels and device.type == "cpu" and dtype in (torch.bfloat16, torch.float32):
        ops = active_kernels()
        bind_kernels(model, ops)
    elif gpu_ops is not None:
        ops = gpu_ops
        bind_kernels(model, ops)
        model.bind_gpu_ops(ops)
    trim()  # what loading freed (the tokenizer's JSON, packing's scratch) leaves the arenas (memory.py)
    if cfg.batch_invariant:
        if not isinstance(ops, Kernels):
            raise ConfigError("batch_invariant needs tokenmill's compiled CPU kernels, and none could be built here")
        make_row_invariant(model, ops)
    return LoadedModel(
        path=path,
        config=model_config,
        tokenizer=tokenizer,
        model=model,
        device=device,
        dtype=dtype,
        max_model_len=max_len,
        generation_config={} if gguf else read_json(path / "generation_config.json", required=False),
        kernels=kernels,
        ops=ops,
        task=task,
    )


def _packed_cache(
    cfg: EngineConfig, gguf: GGUFCheckpoint | None, folder: Path, device: torch.device
) -> PackedCache | None:
    """The packed-weight cache of `gguf`, or else of the safetensors `folder`, where its weights run in the compiled
    CPU kernels and `--weight-cache` is on (weights/packed_cache.py)."""
    if device.type != "cpu" or not (cfg.cpu_kernels and cfg.weight_cache):
        return None
    ops = active_kernels()
    source = gguf.path if gguf else folder
    sample = gguf.reader.sample() if gguf else safetensors_sample(folder)  # the contents' fingerprint
    if ops is None or not sample:
        return None
    return PackedCache(cache_path(source, ops.layout, sample), source)


def _gpu_kernels(cfg: EngineConfig, device: torch.device) -> CudaKernels | None:
    """The Triton kernels for a model on a GPU, unless `--no-gpu-kernels` or `--compile`; without Triton, one
    line says why and torch's ops run."""
    if device.type != "cuda" or not cfg.gpu_kernels or cfg.compile:
        return None
    reason = gpu_kernels_unavailable(device)
    if reason is not None:
        log.warning("the GPU kernels are off: %s", reason)
        return None
    return cuda_kernels()


def _ticking(tensors: Iterator[Any], advance: Any) -> Iterator[Any]:
    for item in tensors:
        yield item
        advance()


def _fp8_itemsize(cfg: EngineConfig, hf_config: dict[str, Any], config: ModelConfig) -> int:
    """Bytes a value an FP8 checkpoint's weights take once loaded: the model dtype's, unless --quantization packs
    them anew (about a byte or less: counted as the file's byte); 1 for any other checkpoint."""
    dequantized = fp8.quantized(hf_config) and cfg.quantization == "none"
    return resolve_dtype(cfg.dtype, config).itemsize if dequantized else 1


def _check_fits(path: Path, gguf: GGUFCheckpoint | None, ranks: int, fp8_itemsize: int = 1) -> None:
    """A checkpoint whose weights (this rank's share) exceed the machine's memory fails here, in one line, before any
    weight is read: mapped, it would start and then page from disk at every step. An FP8 folder's weights count
    as they will be held, dequantized to `fp8_itemsize` bytes a value (1: kept at a byte, or quantized anew)."""
    have = machine_bytes()
    files = [] if gguf else sorted(path.glob("*.safetensors")) if path.is_dir() else []
    extra = fp8.expansion_bytes(files, fp8_itemsize) if fp8_itemsize > 1 else 0
    need = sum(t.n_bytes for t in gguf.reader.tensors) if gguf else sum(f.stat().st_size for f in files) + extra
    need //= ranks
    if have is not None and need > have:
        held = f" (its FP8 weights dequantized to {fp8_itemsize} bytes a value)" if extra else ""
        raise ModelLoadError(
            f"{path.name}: its weights take {need / 2**30:.1f} GiB{held}, more than this machine's "
            f"{have / 2**30:.1f} GiB of memory; pick a smaller model or a smaller quantization (Q4_K_M: about 0.6 "
            "bytes per weight; --quantization int8 keeps an FP8 model at about a byte a weight)"
        )


def _check_gguf_quantization(gguf: GGUFCheckpoint, quantization: str) -> None:
    """A GGUF's block weights run in their own formats; --quantization may only ask for that same one."""
    held = gguf.block_formats()
    wanted = FORMAT_OF_QUANTIZATION.get(quantization)  # (a mix: none of them alone)
    if held and held != {wanted}:
        names = {"q8_0": "Q8_0 (int8)", "q4_0": "Q4_0 (int4)"}
        raise ConfigError(
            f"{gguf.path.name} already holds {' and '.join(names.get(f, f.upper()) for f in sorted(held))} weights, "
            "which run as "
            f"they are; --quantization {quantization} would re-quantize them: drop --quantization, or load a "
            "float (F32/F16/BF16) GGUF or the HF folder"
        )
