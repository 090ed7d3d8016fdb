"""`tokenmill serve | generate | bench | make-model`: parse flags, delegate; user errors are one line + exit 2."""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import replace
from typing import Any, NoReturn

from tokenmill.config import EngineConfig
from tokenmill.engine_flags import engine_args, engine_kwargs
from tokenmill.errors import TokenmillError
from tokenmill.make_model_cli import add_make_model_args, cmd_make_model
from tokenmill.metrics import peak_rss_mb

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line on stderr, exit status 2 (argparse's default also prints the whole usage)."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """`command`: the one asked for, where known; another's than bench's leaves the bench modes' parsers (and their
    imports: httpx, the harness) out of a server's start."""
    parser = _Parser(prog="tokenmill", description="A fast, exact, readable LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    _generate_args(sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal"))
    _serve_args(sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API"))

    if command in (None, "bench"):
        from tokenmill.bench.cli import add_bench_parser

        add_bench_parser(sub, engine_args)
    else:
        from tokenmill.bench.cli import BENCH_HELP

        sub.add_parser("bench", help=BENCH_HELP)

    env = sub.add_parser("env", help="print the CPU, its ISA, which kernel path runs and why, and torch's threads")
    env.add_argument("--bandwidth", action="store_true", help="also measure the memory read bandwidth (seconds)")

    add_make_model_args(sub.add_parser("make-model", help="write a random-weight checkpoint at a real model's shape"))
    return parser


def _generate_args(gen: argparse.ArgumentParser) -> None:
    """`tokenmill generate`'s flags."""
    engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    gen.add_argument("--max-tokens", type=int, default=None, help="default: the model's generation config, or 128")
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--min-p", type=float, default=None)
    gen.add_argument("--repetition-penalty", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")


def _serve_args(srv: argparse.ArgumentParser) -> None:
    """`tokenmill serve`'s flags."""
    engine_args(srv)
    srv.add_argument("--seed", type=int, default=0, help="seed for requests that bring none")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None, help="the name clients use (default: MODEL as given)")
    _models_args(srv)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or TOKENMILL_API_KEY)")
    srv.add_argument("--api-key-file", default=None, help="read the API key from this file (keeps it out of ps)")
    srv.add_argument("--public-docs", action="store_true", help="serve /docs and /openapi.json without the key")
    srv.add_argument("--no-web-ui", dest="web_ui", action="store_false",
                     help="do not serve the web page at / (chat and engine view; docs/api.md)")  # fmt: skip
    srv.add_argument("--max-waiting-requests", type=int, default=None,
                     help="sequences queued beyond this get 503 (default: no limit)")  # fmt: skip
    srv.add_argument("--max-n", type=int, default=128, help="most samples (n) per request (default: 128)")
    srv.add_argument("--max-prompts", type=int, default=256, help="most prompts per completions call (default: 256)")
    srv.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body in MiB (default: 4)")
    srv.add_argument("--max-pooling-inputs", type=int, default=2048,
                     help="most inputs per embeddings call, documents per rerank call, pairs per score call "
                     "(default: 2048, OpenAI's embeddings cap)")  # fmt: skip
    srv.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas as Ray actors behind this server (default: 1, no Ray; needs tokenmill[ray])",
    )
    srv.add_argument(
        "--ray-address",
        default=None,
        help="an existing Ray cluster for --data-parallel-size (default: a local Ray started here)",
    )
    srv.add_argument("--replica-max-restarts", type=int, default=10,
                     help="times a dead data-parallel replica is started again (default: 10; 0: never)")  # fmt: skip
    srv.add_argument("--replica-restart-backoff", type=float, default=1.0,
                     help="seconds before a dead replica's first restart, doubled for each later one up to "
                     "60 s (default: 1)")  # fmt: skip
    srv.add_argument(
        "--tool-call-parser",
        choices=["auto", "hermes", "llama3_json", "openai"],
        default="auto",
        help="how tool_choice=auto calls are read from the output (default: auto, by the chat template)",
    )
    srv.add_argument(
        "--reasoning-parser",
        choices=["auto", "none", "qwen3", "deepseek_r1", "gpt_oss"],
        default="auto",
        help="how a reasoning model's thinking is told from its answer (reasoning_content, thinking blocks); "
        "default: auto, by the chat template (<think>: qwen3 / deepseek_r1, harmony channels: gpt_oss), else none",
    )
    srv.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=10.0,
        help="seconds a structured-output grammar may take to compile before a 400 (default: 10)",
    )
    srv.add_argument(
        "--responses-store-size",
        type=int,
        default=1000,
        help="Responses API responses kept in memory for retrieval and previous_response_id; the least recently "
        "used is dropped first (default: 1000; 0 stores none)",
    )
    srv.add_argument("--grace-period", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    srv.add_argument("--no-engine-process", dest="engine_process", action="store_false",
                     help="run the engine in the server's own process (default: a process of its own, which "
                     "starts beside the server's; one MODEL, without --tensor-parallel-size or "
                     "--data-parallel-size)")  # fmt: skip
    srv.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    srv.add_argument("--log-format", choices=["text", "json"], default="text",
                     help="text, or json: one JSON object per line (time, level, logger, message, request_id where "
                     "known), the access log too, for log shippers (default: text)")  # fmt: skip
    srv.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                     help="send a trace per request (spans for queue, prefill, decode) to this OTLP/HTTP endpoint, "
                     "e.g. http://localhost:4318/v1/traces (needs tokenmill[otel])")  # fmt: skip


def _models_args(srv: argparse.ArgumentParser) -> None:
    """`tokenmill serve`'s flags for several models behind one server (docs/api.md, "Several models")."""
    srv.add_argument("--model", action="append", dest="named_models", metavar="NAME=PATH",
                     help="serve this model as NAME (repeat for several; instead of MODEL); each loads when a request "
                     "first names it")  # fmt: skip
    srv.add_argument("--models-config", default=None, metavar="FILE",
                     help="a YAML (or JSON) file listing the models: models: [{name, path, and any engine flag such "
                     "as dtype, quantization, max_model_len}]")  # fmt: skip
    srv.add_argument("--max-loaded-models", type=int, default=None, metavar="N",
                     help="models loaded at once; past it the least recently used idle one is unloaded "
                     "(default: no limit)")  # fmt: skip
    srv.add_argument("--models-memory-gb", type=float, default=None, metavar="GB",
                     help="the loaded models' weights and KV pools together, in GB; past it the least recently used "
                     "idle one is unloaded (default: no limit)")  # fmt: skip
    srv.add_argument("--idle-unload-seconds", type=float, default=None, metavar="S",
                     help="unload a model no request has used for this long (default: never)")  # fmt: skip
    srv.add_argument("--model-load-timeout", type=float, default=600.0, metavar="S",
                     help="how long a request waits for its model to load before a 503 (default: 600)")  # fmt: skip


def cmd_generate(a: argparse.Namespace) -> int:
    from tokenmill.memory import collector_paused

    with collector_paused():  # the imports and the load (memory.py)
        from tokenmill import LLM

        llm = LLM(a.model, **engine_kwargs(a))
    defaults = llm.get_default_sampling_params()
    gen_max = llm.loaded.generation_config.get("max_new_tokens")
    overrides = {
        "max_tokens": a.max_tokens if a.max_tokens is not None else (gen_max if isinstance(gen_max, int) else 128),
        "temperature": a.temperature,
        "top_p": a.top_p,
        "top_k": a.top_k,
        "min_p": a.min_p,
        "repetition_penalty": a.repetition_penalty,
        "seed": a.seed,
        "ignore_eos": a.ignore_eos,
    }
    params = replace(defaults, **{k: v for k, v in overrides.items() if v is not None})
    if a.chat:
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": a.prompt}])
        prompt: Any = {"prompt_token_ids": ids, "prompt": a.prompt}
    else:
        prompt = a.prompt
    start = time.perf_counter()
    final = None
    for out in llm.stream(prompt, params):
        if not a.json:
            sys.stdout.write(out.new_text[0])
            sys.stdout.flush()
        final = out
    assert final is not None and final.metrics is not None
    m, c = final.metrics, final.outputs[0]
    timings = {
        "prompt_tokens": m.num_prompt_tokens,
        "tokenization_ms": round(m.tokenization_ms, 3),
        "ttft_ms": round(m.ttft_ms or 0.0, 3),
        "decode_tokens_per_sec": round(m.decode_tokens_per_sec or 0.0, 3),
        "total_ms": round((time.perf_counter() - start) * 1000, 3),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    if a.json:
        print(json.dumps({"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                          "timings": timings}))  # fmt: skip
    else:
        print()
        print(
            f"[prompt tokens: {timings['prompt_tokens']} | tokenization: {timings['tokenization_ms']:.1f} ms | "
            f"TTFT: {timings['ttft_ms']:.1f} ms | decode: {timings['decode_tokens_per_sec']:.1f} tok/s | "
            f"generated: {len(c.token_ids)} ({c.finish_reason}) | peak RSS: {timings['peak_rss_mb']:.0f} MB]",
            file=sys.stderr,
        )
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from tokenmill.memory import collector_paused

    with collector_paused():  # until the model has loaded and launch.py freezes the heap (memory.py)
        return _serve(a)


def _serve(a: argparse.Namespace) -> int:
    from tokenmill.weights.source import default_model_ref, resolve_model

    cfg = EngineConfig(model=a.model, seed=a.seed, **engine_kwargs(a))
    if a.named_models or a.models_config:
        from tokenmill.server.launch import serve_models

        return serve_models(a, _served_models(a, cfg))
    several = [f for f in ("max_loaded_models", "models_memory_gb", "idle_unload_seconds") if getattr(a, f) is not None]
    if several:
        raise ValueError(f"--{several[0].replace('_', '-')} applies to several models (--model NAME=PATH, "
                         "--models-config FILE); one MODEL given alone stays loaded")  # fmt: skip
    path = resolve_model(cfg.model or default_model_ref(), cfg.revision)  # fail fast, before the port opens
    demo = a.model in (None, "demo", "tokenmill-demo")
    name = a.served_model_name or ("tokenmill-demo" if demo else a.model)
    if a.engine_process and cfg.tensor_parallel_size == 1 and a.data_parallel_size == 1:
        from tokenmill.engine.process_start import EngineProcess
        from tokenmill.server.launch import check_port

        check_port(a.host, a.port)  # (a taken port is one line before any engine starts)

        # at once, before this process's own imports: the two load side by side (process_engine.py)
        process = EngineProcess(replace(cfg, model=str(path)), a.log_level, a.log_format)
        from tokenmill.server.launch import serve

        return serve(a, cfg, path, name, process)
    _check_architecture(path)
    from tokenmill.tensor_parallel.workers import env_rank, run_env_worker

    if (env_rank(cfg) or 0) > 0:  # torchrun's rank > 0: a tensor-parallel worker for rank 0's server
        gc.enable()  # its steps run with the collector on (the pause is for a server's start)
        run_env_worker(replace(cfg, model=str(path)))
        return 0
    from tokenmill.server.launch import serve

    return serve(a, cfg, path, name)


def _served_models(a: argparse.Namespace, cfg: EngineConfig) -> list[tuple[str, EngineConfig]]:
    """`--model NAME=PATH` and `--models-config`'s models, each checked before the port opens."""
    from tokenmill.server.model_configs import model_configs
    from tokenmill.weights import resolve_model

    if a.model is not None:
        raise ValueError(f"give the models either as MODEL ({a.model}) or as --model NAME=PATH / --models-config "
                         "FILE, not both")  # fmt: skip
    if a.served_model_name is not None:
        raise ValueError("--served-model-name names one MODEL; with --model NAME=PATH the NAMEs are the names")
    models = []
    for name, model_cfg in model_configs(cfg, a.named_models or [], a.models_config):
        path = resolve_model(model_cfg.model or "", model_cfg.revision)
        try:
            _check_architecture(path)
        except (TokenmillError, ValueError) as e:
            raise ValueError(f"model {name!r}: {e}") from None
        models.append((name, replace(model_cfg, model=str(path))))
    return models


def _check_architecture(path: Any) -> None:
    from tokenmill.assembly.model import read_json
    from tokenmill.models import family_for
    from tokenmill.weights.gguf_checkpoint import is_gguf

    if is_gguf(path):  # opening a GGUF reads all its metadata (seconds for a big vocabulary): the load checks it
        return
    hf_config = read_json(path / "config.json", required=True)
    family_for(hf_config).config_from_hf(hf_config)


def cmd_bench(a: argparse.Namespace) -> int:
    from tokenmill.bench.cli import run_bench

    kwargs = engine_kwargs(a) if hasattr(a, "kv_cache") else {}
    path = run_bench(a, kwargs)
    if path is not None:
        print(f"results: {path}", file=sys.stderr)
    return 0


def cmd_env(a: argparse.Namespace) -> int:
    import os
    import platform

    import torch

    from tokenmill import __version__, kernels

    env_vars = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "TOKENMILL_"))}
    info = {"tokenmill": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "onednn_native_bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported(),
            **kernels.status(), "environment": env_vars}  # fmt: skip
    if a.bandwidth:
        from tokenmill.bench.bandwidth import read_bandwidth_gb_s

        info["read_bandwidth_gb_s"] = round(read_bandwidth_gb_s(), 1)
    width = max(len(k) for k in info)
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    return 0


def main(argv: list[str] | None = None) -> int:
    handlers = {"generate": cmd_generate, "serve": cmd_serve, "bench": cmd_bench, "make-model": cmd_make_model,
                "env": cmd_env}  # fmt: skip
    given = sys.argv[1:] if argv is None else argv
    parser = build_parser(given[0] if given and given[0] in handlers else None)
    args = parser.parse_args(argv)
    handler = handlers[args.command]
    try:
        return handler(args)
    except (TokenmillError, ValueError) as e:
        print(f"tokenmill {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # a path it cannot write or read (an --out under /proc, a folder where a file goes)
        where = f": {e.filename}" if e.filename else ""
        print(f"tokenmill {args.command}: error: {e.strerror or e}{where}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
