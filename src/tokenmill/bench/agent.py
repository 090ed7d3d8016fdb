"""`tokenmill bench serve --workload agent`: an agent loop's traffic, turn after turn of a growing conversation.

N conversations run at once; each is a chat whose first user message holds `--input-len` tokens (a task and its
documents), and whose every later turn appends the assistant's answer as the server gave it, then a user message
with a tool's result and a question, so the history grows to about `--max-context` tokens over `--turns` turns.
A turn is sent when its conversation's last answer has streamed in. A server that reuses what it computed for the
history answers each turn's prompt mostly from its prefix cache.

Per turn it records TTFT, TPOT, the prompt tokens and the cached ones: `usage.prompt_tokens_details.cached_tokens`
(OpenAI's field; tokenmill and vLLM report it) or llama-server's `timings.cache_n`. The summary holds the serve
benchmark's figures over every turn, and `agent`: TTFT p50 by turn, the prefix hit rate (cached / prompt tokens,
over the turns after the first) and the whole loop's wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx

from tokenmill.bench.prompts import TokenCounter, fit_text
from tokenmill.bench.serve import _finish_rows, _model_len, sampling, send, summarize_rows
from tokenmill.bench.stats import summarize
from tokenmill.bench.store import Run

CONTEXT_MARGIN = 64  # tokens kept free of the context for the chat template's own


@dataclass(frozen=True)
class AgentPlan:
    conversations: int
    turns: int
    first_len: int  # tokens of the first user message
    turn_len: int  # tokens each later user message adds (tool result and question)
    output_len: int


def agent_plan(args: argparse.Namespace, max_model_len: int | None) -> AgentPlan:
    """The loop's sizes from the flags (defaults: 4 conversations x 10 turns, 4k growing to 32k tokens, 64 out),
    scaled down to fit `max_model_len` where the server says it."""
    turns, out = args.turns or 10, args.output_len or 64
    first, top = args.input_len or 4096, args.max_context or 32768
    if max_model_len:
        top = min(top, max_model_len - CONTEXT_MARGIN)
    grow = (top - first - turns * out) // max(1, turns - 1) if turns > 1 else 0
    if first > top:
        first, grow = max(1, top - turns * (out + 16)), 16
    plan = AgentPlan(args.conversations or 4, turns, first, max(1, grow), out)
    if min(plan.conversations, plan.turns, plan.first_len, plan.output_len) < 1:
        raise ValueError(f"conversations, turns, input-len and output-len must be positive: {plan}")
    return plan


def conversation_texts(plan: AgentPlan, counter: TokenCounter, seed: int) -> list[list[str]]:
    """Each conversation's user messages, turn by turn (the same for the same seed)."""
    rng = random.Random(f"{seed}-agent")
    texts = []
    for _ in range(plan.conversations):
        first, _ = fit_text(counter, rng, plan.first_len)
        later = [f"Tool result: {fit_text(counter, rng, plan.turn_len)[0]}\nWhat next?" for _ in range(plan.turns - 1)]
        texts.append([f"Task: {first}", *later])
    return texts


async def run_loops(args: argparse.Namespace, plan: AgentPlan, texts: list[list[str]]) -> tuple[list[dict], float]:
    """Every conversation's turns, conversations concurrently; rows in (conversation, turn) order, wall seconds."""
    args = argparse.Namespace(**{**vars(args), "endpoint": "chat"})  # (send reads the endpoint from it)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    rows: list[list[dict[str, Any]]] = [[] for _ in texts]
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as client:  # fmt: skip

        async def loop(c: int) -> None:
            messages: list[dict[str, str]] = []
            for turn, text in enumerate(texts[c]):
                messages.append({"role": "user", "content": text})
                body = {"model": args.model, "messages": list(messages), "max_tokens": plan.output_len,
                        "stream": True, "stream_options": {"include_usage": True}, **sampling(args)}  # fmt: skip
                if not args.no_ignore_eos:
                    body["ignore_eos"] = True
                row: dict[str, Any] = {"index": c * plan.turns + turn, "conversation": c, "turn": turn,
                                       "kind": "agent", "sent": False, "ok": False, "error": None,
                                       "prompt_tokens": None, "output_tokens": None,
                                       "output_tokens_source": None}  # fmt: skip
                rows[c].append(row)
                await send(client, args, body, row, t0, args.timeout)
                if not row["ok"]:
                    return  # the conversation ends with its failed turn
                messages.append({"role": "assistant", "content": row["text"]})

        try:
            async with asyncio.timeout(args.max_duration):
                await asyncio.gather(*(loop(c) for c in range(len(texts))))
        except TimeoutError:
            pass
    wall = time.monotonic() - t0
    for row in (r for conv in rows for r in conv):
        if row["sent"] and "end_s" not in row:
            row.update(ok=False, error=f"cancelled: run bound of {args.max_duration}s reached", end_s=wall)
    return [r for conv in rows for r in conv], wall


def agent_summary(rows: list[dict[str, Any]], plan: AgentPlan, wall: float) -> dict[str, Any]:
    """TTFT p50 by turn, the prefix hit rate after the first turn, and the loop's wall time."""
    ok = [r for r in rows if r["ok"]]
    by_turn = [[r["ttft_ms"] for r in ok if r["turn"] == t] for t in range(plan.turns)]
    later = [r for r in ok if r["turn"] > 0 and r.get("cached_tokens") is not None]
    prompt = sum(r["prompt_tokens"] or 0 for r in later)
    return {
        "conversations": plan.conversations, "turns": plan.turns, "first_len": plan.first_len,
        "turn_len": plan.turn_len, "output_len": plan.output_len, "wall_s": wall,
        "ttft_p50_by_turn_ms": [statistics.median(t) if t else None for t in by_turn],
        "prompt_tokens_by_turn": [max((r["prompt_tokens"] or 0 for r in ok if r["turn"] == t), default=None)
                                  for t in range(plan.turns)],
        "prefix_hit_rate": sum(r["cached_tokens"] for r in later) / prompt if prompt else None,
        "ttft_after_first_ms": summarize([r["ttft_ms"] for r in ok if r["turn"] > 0]),
    }  # fmt: skip


def agent_report(s: dict[str, Any]) -> list[str]:
    """The agent section of the run's report."""
    a = s["agent"]
    hit = "-" if a["prefix_hit_rate"] is None else f"{a['prefix_hit_rate']:.1%}"
    lines = ["", f"Agent loop: {a['conversations']} conversations x {a['turns']} turns, first message "
             f"{a['first_len']} tokens, +{a['turn_len']} a turn, {a['output_len']} out; wall {a['wall_s']:.1f} s, "
             f"prefix hit rate {hit} (turns after the first).", "", "| turn | prompt tokens | TTFT p50 ms |",
             "|---|---|---|"]  # fmt: skip
    for t, (n, ttft) in enumerate(zip(a["prompt_tokens_by_turn"], a["ttft_p50_by_turn_ms"], strict=True)):
        lines.append(f"| {t} | {n if n is not None else '-'} | {'-' if ttft is None else f'{ttft:.0f}'} |")
    return lines


def run_agent(args: argparse.Namespace) -> Any:
    """The agent workload against `--url`: the run folder (manifest, rows, summary, report), as run_workload's."""

    seed = args.seed if args.seed is not None else 0
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=30) as client:
        max_len = _model_len(client, args.model)
        counter = TokenCounter(args.tokenizer, client, args.model)
        plan = agent_plan(args, max_len)
        texts = conversation_texts(plan, counter, seed)
        config = {"workload": "agent", **plan.__dict__, "max_concurrency": plan.conversations, "url": args.url,
                  "model": args.model, "endpoint": "chat", "seed": seed, "server_label": args.server_label,
                  "server_max_model_len": max_len, "prompt_token_source": counter.source,
                  "ignore_eos": not args.no_ignore_eos, "sampling": sampling(args)}  # fmt: skip
        run = Run.create(args.output_dir, "agent", config)
        rows, wall = asyncio.run(run_loops(args, plan, texts))
        _finish_rows(rows, counter)
    summary = {"workload": "agent", **summarize_rows(rows, wall, {})}
    summary["agent"] = agent_summary(rows, plan, wall)
    run.save_raw(rows)
    run.save_summary(summary)
    f, done = summary["ttft_ms"], f"{summary['requests_completed']}/{summary['requests_sent']} turns ok"
    where = f"`{args.server_label}` at {args.url}, model `{args.model}`, seed {seed}."
    figures = f"{done}; TTFT p50 {f['p50']:.0f} ms, TPOT p50 {summary['tpot_ms']['p50']:.1f} ms."
    report = ["# serve benchmark: agent", "", where, "", figures, *agent_report(summary)]
    path = run.finish("\n".join(report) + "\n", headline=("wall_s", wall, "s"), model=args.model,
                      backend=args.server_label)  # fmt: skip
    hit = summary["agent"]["prefix_hit_rate"]
    hit_text = "-" if hit is None else f"{hit:.1%}"
    print(f"agent: {done}, wall {wall:.1f} s, TTFT p50 {f['p50']:.1f} ms, prefix hit rate {hit_text} -> {path}",
          flush=True)  # fmt: skip
    return path
