"""`tokenmill bench serve`'s flags (serve_run.py runs them)."""

from __future__ import annotations

import argparse

from tokenmill.bench.serve import WORKLOADS


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="streaming load generator against an OpenAI-compatible server")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name the server expects in requests")
    p.add_argument(
        "--request-models",
        default=None,
        help="comma-separated `model` names the requests take in turn (LoRA adapters, several models)",
    )
    p.add_argument("--workload", choices=[*WORKLOADS, "all"], default="custom")
    p.add_argument("--request-rate", type=float, default=None, help="req/s, Poisson arrivals; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 128)")
    p.add_argument("--output-len", type=int, default=None, help="generated tokens per request (default 128)")
    p.add_argument("--prefix-len", type=int, default=None, help="shared prefix tokens (prefix_caching: 1024)")
    p.add_argument("--conversations", type=int, default=None, help="agent: conversations at once (4)")
    p.add_argument("--turns", type=int, default=None, help="agent: turns per conversation (10)")
    p.add_argument("--max-context", type=int, default=None, help="agent: tokens the history grows to (32768)")
    p.add_argument("--embed-batch", type=int, default=1, help="embed: texts per /v1/embeddings request")
    p.add_argument(
        "--embed-rate",
        type=float,
        default=None,
        metavar="R",
        help="run the workload alone, then with /v1/embeddings requests arriving at R a second beside it, "
        "and compare each stream's TPOT (a server with --task generate,embed)",
    )
    p.add_argument("--embed-len", type=int, default=None, help="with --embed-rate: tokens a text (default input-len)")
    p.add_argument(
        "--idle-wait",
        type=float,
        default=0.0,
        metavar="S",
        help="switch: wait up to S seconds for every model to be unloaded, before the first request and after the last",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", default=None, metavar="ttft:MS,tpot:MS", help="SLOs (any of ttft, tpot, e2e)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="HF tokenizer folder for exact token counts")
    p.add_argument("--warmup", type=int, default=0, help="requests sent first and excluded from the figures")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--max-duration", type=float, default=3600.0, help="seconds for the whole run")
    p.add_argument("--no-ignore-eos", action="store_true", help="for servers that reject `ignore_eos`")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); above, every request draws")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: top_p (sent, 1 too)")
    p.add_argument("--top-k", type=int, default=None, help="with --temperature: top_k, sent where given (0: off)")
    p.add_argument("--min-p", type=float, default=None, help="with --temperature: min_p, sent where given (0: off)")
    p.add_argument("--output-dir", default="./bench-results")
    p.add_argument("--server-label", default="tokenmill", help="backend name in index.csv")
    p.add_argument("--flops-model", default=None, metavar="PATH",
                   help="the served model's folder or GGUF: report its model GFLOPS and their share of this machine's "
                   "arithmetic peaks (probed before the first run)")  # fmt: skip
    p.add_argument("--probe-threads", type=int, default=None, help="with --flops-model: the server's threads")
    p.add_argument("--server-peers", default=None, metavar="LABEL=URL[@MODEL],...",
                   help="also run the workload against these servers, one after another, and tabulate")  # fmt: skip
