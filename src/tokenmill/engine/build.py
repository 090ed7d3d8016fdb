"""The engine core for a loaded model: its parts from the assembly, a scheduler over their KV manager, and the
proposer `cfg.speculative_model` names."""

from __future__ import annotations

from functools import partial

from tokenmill.assembly import LoadedModel, build_parts
from tokenmill.assembly.parts import RunnerFactory
from tokenmill.config import EngineConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.prefix_tiers import attach_prefix_tiers
from tokenmill.scheduler import Scheduler, SchedulerConfig
from tokenmill.spec_decode import NgramProposer, Proposer


def build_engine_core(loaded: LoadedModel, cfg: EngineConfig, detokenize: bool = True) -> EngineCore:
    """Wire `loaded` into KV backend + KV manager + runner (assembly/) + scheduler + proposer as `cfg` says.
    `detokenize` False: outputs of tokens alone, for a server that makes the text (server/engine_process.py)."""
    make_runner: RunnerFactory | None = None
    if cfg.tensor_parallel_size > 1:
        from tokenmill.tensor_parallel.workers import TensorParallelRunner

        make_runner = partial(TensorParallelRunner, cfg=cfg)  # rank 0: broadcasts each step to the workers

    parts = build_parts(loaded, cfg, make_runner=make_runner)
    attach_prefix_tiers(parts.kv, parts.backend.paged, loaded, cfg)  # RAM and disk below the pool, where asked
    max_len = loaded.max_model_len
    chunked = cfg.enable_chunked_prefill and parts.backend.retains_kv  # recompute keeps no partial prefill
    budget = cfg.max_num_batched_tokens if chunked else max(cfg.max_num_batched_tokens, max_len)
    scheduler = Scheduler(
        SchedulerConfig(cfg.max_num_seqs, budget, chunked, cfg.scheduling_policy, cfg.batching, cfg.pooling_share),
        parts.kv,
    )
    core = EngineCore(parts.runner, scheduler, loaded.tokenizer, loaded.config.vocab_size, max_len,
                      loaded.eos_token_ids, make_proposer(loaded, cfg, max_len), cfg.speculative_disable_by_batch_size,
                      cfg.num_scheduler_steps, loaded.task, loaded.config.hidden_size, cfg.max_lora_rank,
                      detokenize, loaded.config.rope.long_from)  # fmt: skip
    if core.lora is not None:
        for name, path in cfg.lora_modules:  # the adapters served from the start (a bad one: one line, no engine)
            core.lora.add(core.lora.read(name, path))
    return core


def make_proposer(target: LoadedModel, cfg: EngineConfig, max_len: int) -> Proposer | None:
    """The proposer `cfg.speculative_model` names: prompt lookup ("ngram"), a draft model, or none."""
    if not target.task.generate:  # drafts propose tokens, and a model that only pools samples none
        return None
    if cfg.speculative_model == "ngram":
        return NgramProposer(cfg.num_speculative_tokens, cfg.ngram_prompt_lookup_min, cfg.ngram_prompt_lookup_max)
    if cfg.speculative_model is not None:
        from tokenmill.spec_decode.draft import build_draft_proposer

        return build_draft_proposer(target, cfg, max_len)
    return None
