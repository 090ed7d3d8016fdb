"""Tensor-parallel ranks: rank 0 is the engine process, ranks 1..N-1 are worker processes.

Rank 0 owns the scheduler, the KV manager and the sampler, as with one process. Each step its runner
broadcasts the step's `ModelInput` (torch.distributed's object broadcast) and then runs its own shard; every
worker receives the same input and runs its shard through the same code path (its own KV tensors, the same
block tables), so the all-reduces of the row-parallel linears pair up. Workers never sample.

Workers start with `torch.multiprocessing` (spawn) on this machine and join a gloo group (NCCL on CUDA) over a
local TCP rendezvous; their row-parallel sums go through shared memory (shm.py), not gloo. Across machines,
`torchrun` starts one process per rank with the same command (`torchrun --nnodes N --node-rank R
--master-addr HEAD ... -m tokenmill serve MODEL --tensor-parallel-size N`): with torchrun's RANK / WORLD_SIZE /
MASTER_ADDR in the environment, rank 0 joins the group through them (`env://`) instead of spawning, and every
other rank runs `run_env_worker` instead of the command.

A rank that dies breaks the next collective on rank 0 (gloo sees the closed socket), and the runner turns that
into `TensorParallelError`, which ends the engine loop: `/health` turns 503 and every
waiting request gets an error, never a hang. `close()` sends the workers an empty message and joins them.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokenmill import reaper
from tokenmill.config import EngineConfig
from tokenmill.memory import release_code_pages
from tokenmill.models.sharding import use_reducer
from tokenmill.runner import ModelRunner
from tokenmill.tensor_parallel.shm import ShmAllReduce
from tokenmill.types import ModelInput, RunnerOutput

log = logging.getLogger("tokenmill.parallel")
TIMEOUT = timedelta(seconds=120)  # a collective that waits longer has lost a rank (gloo also notices closed sockets)


class TensorParallelError(BaseException):
    """A rank failed or left: the engine loop must stop (BaseException, so a step's retry does not catch it)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init(rank: int, size: int, init_method: str, device: str) -> None:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=TIMEOUT)


def env_rank(cfg: EngineConfig) -> int | None:
    """This process's rank when torchrun started it for this tensor-parallel size, else None."""
    if cfg.tensor_parallel_size > 1 and "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        if int(os.environ.get("WORLD_SIZE", "0")) != cfg.tensor_parallel_size:
            raise ValueError(f"torchrun started {os.environ.get('WORLD_SIZE')} processes but "
                             f"tensor_parallel_size={cfg.tensor_parallel_size}: they must be equal")  # fmt: skip
        return int(os.environ["RANK"])
    return None


def run_env_worker(cfg: EngineConfig) -> None:
    """A rank > 0 that torchrun started: serve rank 0's steps until it ends."""
    rank = env_rank(cfg)
    assert rank is not None and rank > 0
    _worker(rank, cfg.tensor_parallel_size, "env://", cfg)


def _worker(rank: int, size: int, init_method: str, cfg: EngineConfig) -> None:
    """A worker rank: load this rank's shard, then run every step rank 0 broadcasts, until an empty one."""
    from tokenmill.assembly import build_parts, load

    torch.set_num_threads(cfg.threads or 1)
    _init(rank, size, init_method, cfg.device)
    setup: list[Any] = [None, None]
    dist.broadcast_object_list(setup, src=0)  # rank 0's KV pool size (every pool has as many blocks), shm name
    num_blocks, shm_name = int(setup[0]), setup[1]
    if shm_name is not None:
        parent = mp.parent_process()
        use_reducer(ShmAllReduce(rank, size, shm_name, lambda: parent is None or parent.is_alive()))
    loaded = load(cfg, rank=rank)
    # rank 0's pool, eagerly: a CUDA graph would record the all-reduces of one step
    kv_cfg = replace(cfg, num_kv_blocks=num_blocks, kv_cache_memory_gb=None, enforce_eager=True)
    runner = build_parts(loaded, kv_cfg, sample=False).runner
    release_code_pages()  # what the imports ran once leaves this rank's resident set (memory.py)
    dist.barrier()  # loaded: rank 0 may start
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        if message[0] is None:
            break
        runner.compute(message[0])
    dist.destroy_process_group()


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: starts the workers, broadcasts each step to them, then runs its own shard and samples."""

    def __init__(self, model: Any, device: torch.device, kv: Any, seed: int, cfg: EngineConfig) -> None:
        super().__init__(model, device, kv, seed)
        size = cfg.tensor_parallel_size
        if env_rank(cfg) == 0:  # torchrun started the other ranks, maybe on other machines
            init_method, self.workers = "env://", []
        else:
            init_method, ctx = f"tcp://127.0.0.1:{_free_port()}", mp.get_context("spawn")
            self.workers = [ctx.Process(target=_worker, args=(rank, size, init_method, cfg), daemon=True,
                                        name=f"tokenmill-tp{rank}") for rank in range(1, size)]  # fmt: skip
        if self.workers:
            reaper.before_spawn()
        for w in self.workers:
            w.start()
        try:
            _init(0, size, init_method, cfg.device)
            local_cpu = init_method != "env://" and not cfg.device.startswith("cuda")  # ranks share this memory
            shm_name = ShmAllReduce.new_name() if local_cpu and ShmAllReduce.supported() else None
            dist.broadcast_object_list([kv.num_blocks, shm_name], src=0)
            if shm_name is not None:
                use_reducer(ShmAllReduce(0, size, shm_name, lambda: self.alive))
            dist.barrier()  # every worker has its shard
        except Exception as e:
            self.close()
            raise RuntimeError(f"tensor-parallel workers did not start: {e}") from None
        self.closed = False

    @property
    def runs_decode_steps(self) -> bool:
        return False  # the workers run one step per broadcast

    def execute(self, batch: ModelInput) -> RunnerOutput:
        self.hooks.before_step(batch)  # before the broadcast: an injected fault must not leave the workers waiting
        dead = [w.name for w in self.workers if not w.is_alive()]
        if dead:
            raise TensorParallelError(f"tensor-parallel rank(s) {', '.join(dead)} exited")
        try:
            dist.broadcast_object_list([replace(batch, grammar_bitmask=None, grammar_rows={})], src=0)
            return self.compute(batch)
        except Exception as e:  # a collective failed (a rank died), or rank 0 failed mid-step: ranks are out of step
            raise TensorParallelError(f"tensor-parallel step failed: {type(e).__name__}: {e}") from None

    @property
    def alive(self) -> bool:
        return all(w.is_alive() for w in self.workers)

    def close(self) -> None:
        if getattr(self, "closed", True) is False and all(w.is_alive() for w in self.workers):
            try:
                dist.broadcast_object_list([None], src=0)
                dist.destroy_process_group()
            except Exception as e:  # a worker already gone: nothing to tell it
                log.warning("tensor-parallel shutdown: %s", e)
        self.closed = True
        for w in self.workers:
            w.join(timeout=10)
            if w.is_alive():
                w.kill()


def worker_pids(runner: ModelRunner) -> list[int]:
    """The worker processes' ids (for tests and `/stats`); [] for a one-process runner."""
    return [w.pid for w in getattr(runner, "workers", []) if w.pid is not None]
