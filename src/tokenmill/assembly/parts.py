"""The one place that wires a loaded model to its KV backend, KV manager and runner.

`build_parts` is called by the engine (engine/build.py), the draft model (spec_decode/draft.py) and every
tensor-parallel worker rank (tensor_parallel/workers.py); Ray replicas' front validates with `kv_manager` over the
replicas' pool. After `make_kv_backend` resolves `cfg.kv_cache`, everything asks the backend's attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.assembly.model import LoadedModel
from tokenmill.attention import KVBackend, make_kv_backend
from tokenmill.config import EngineConfig
from tokenmill.cuda_graphs import DecodeGraphs
from tokenmill.kernels import Kernels
from tokenmill.kv_cache import KVCacheManager, KVManager, UnpagedKVManager
from tokenmill.models import CausalLM
from tokenmill.models.lora import ModelLoras
from tokenmill.models.pooling import Pooler
from tokenmill.runner import ModelRunner

# how a runner is made: (model, device, KV backend, seed); a tensor-parallel engine passes its rank-0 runner
RunnerFactory = Callable[[CausalLM, torch.device, KVBackend, int], ModelRunner]


@dataclass
class Parts:
    backend: KVBackend  # where keys and values live (the runner's)
    kv: KVManager  # which blocks each request's tokens take (the scheduler's)
    runner: ModelRunner


def kv_manager(num_blocks: int, block_size: int, prefix_caching: bool) -> KVManager:
    """Block accounting for a pool of `num_blocks` (0: a backend without blocks, which needs none)."""
    return KVCacheManager(num_blocks, block_size, prefix_caching) if num_blocks else UnpagedKVManager()


def build_parts(
    loaded: LoadedModel,
    cfg: EngineConfig,
    max_model_len: int | None = None,
    *,
    sample: bool = True,
    make_runner: RunnerFactory | None = None,
) -> Parts:
    """`loaded`'s KV backend (sized by `cfg` for contexts of `max_model_len`, the model's own by default), its KV
    manager and its runner: a `ModelRunner` that samples (`sample`; a tensor-parallel worker only computes), with
    CUDA graphs for decode steps on a GPU unless `cfg.enforce_eager`, or what `make_runner` makes."""
    max_len = max_model_len or loaded.max_model_len
    backend = make_kv_backend(cfg, loaded.config, loaded.dtype, loaded.device, max_len, loaded.ops)
    blocks = backend.num_blocks if backend.uses_blocks else 0
    kv = kv_manager(blocks, cfg.block_size, cfg.enable_prefix_caching)
    if make_runner is not None:
        return Parts(backend, kv, make_runner(loaded.model, loaded.device, backend, cfg.seed))
    runner = ModelRunner(loaded.model, loaded.device, backend, cfg.seed, sample=sample)
    if cfg.lora:
        kernels = loaded.ops if isinstance(loaded.ops, Kernels) else None  # (ops/lora.h; a GPU's: torch's matmuls)
        runner.lora = ModelLoras(loaded.model, loaded.device, loaded.dtype, kernels)
    if loaded.task.pooling is not None:
        runner.pooler = Pooler(loaded.model, loaded.task.pooling)
    if not loaded.task.generate:  # the fast paths are for decode steps, which a model that only pools never takes
        runner.decode_stack = None
        return Parts(backend, kv, runner)
    if cfg.batch_invariant:  # the decode stack multiplies a step's rows together (a lone row sums otherwise)
        runner.decode_stack = None
    runner.graphs = DecodeGraphs.build(loaded.model, backend, cfg.max_num_seqs, max_len, cfg.enforce_eager)
    return Parts(backend, kv, runner)
