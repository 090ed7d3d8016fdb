"""The engine's numbers at one moment, as one frozen object (metrics.EngineSnapshot) that other threads may read:
the scheduler's queues, the KV pool and its prefix cache by tier, and the step and token counts."""

from __future__ import annotations

from tokenmill.metrics import EngineSnapshot, EngineStats
from tokenmill.scheduler import Scheduler


def engine_snapshot(scheduler: Scheduler, stats: EngineStats) -> EngineSnapshot:
    kv = scheduler.kv
    return EngineSnapshot(
        running=len(scheduler.running),
        waiting=len(scheduler.waiting),
        kv_blocks_total=kv.num_blocks,
        kv_blocks_free=kv.num_free_blocks,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        **{f"prefix_cache_{tier}_hits": hits for tier, hits in kv.prefix_cache_hits_by_tier.items()},
        **{f"prefix_cache_{tier}_bytes": used for tier, used in kv.tier_bytes().items()},
        num_preemptions=scheduler.num_preemptions,
        num_steps=stats.num_steps,
        mean_batch_size=stats.mean_batch_size,
        max_batch_size=stats.max_batch_size,
        num_completed=stats.num_completed,
        num_aborted=stats.num_aborted,
        num_failed=stats.num_failed,
        spec_draft_tokens=stats.spec_draft_tokens,
        spec_accepted_tokens=stats.spec_accepted_tokens,
        prompt_tokens=stats.prompt_tokens,
        generation_tokens=stats.generation_tokens,
    )
