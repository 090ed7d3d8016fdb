"""`tokenmill serve`: from parsed flags to a running uvicorn, and the process's life around it.

- One MODEL loads at start and stays (`serve`); several (`--model NAME=PATH`, `--models-config`: `serve_models`)
  load on demand, within `--max-loaded-models` and `--models-memory-gb` (server/models_registry.py).

- The API key comes from `--api-key`, `--api-key-file` or `TOKENMILL_API_KEY` (the last two keep it out of `ps`).
- The port is tried before the model loads: a taken one is one line and exit 2, not a model loaded for nothing.
- One MODEL that fails to load prints one line and exits 2; the port never serves a server that cannot work. Of
  several, one that fails to load fails its requests (503 saying why); the others serve on.
- On SIGTERM, uvicorn stops accepting and gives open requests `--grace-period` seconds. Shortly before that
  ends, every request still running is aborted, so its stream ends cleanly (finish_reason "abort", then
  `[DONE]`) instead of being cut mid-chunk.
- If the engine loop dies, every open request gets an error, the server shuts down, and the process exits 1,
  so a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import errno
import functools
import gc
import logging
import math
import os
import signal
import socket
import sys
import threading
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

from tokenmill import reaper
from tokenmill.config import EngineConfig
from tokenmill.errors import TokenmillError
from tokenmill.memory import freeze_heap, release_code_pages
from tokenmill.server.logs import configure_logging

EXIT_USAGE = 2
EXIT_ENGINE_DIED = 1
log = logging.getLogger("tokenmill")


def api_key(args: argparse.Namespace) -> str | None:
    """The key from the flag, the file, or the environment (in that order); None when none is set."""
    if args.api_key:
        return str(args.api_key)
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as e:
            raise ValueError(f"--api-key-file {args.api_key_file!r} cannot be read: {e.strerror}") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file!r} is empty")
        return key
    return os.environ.get("TOKENMILL_API_KEY") or None


def server_config(args: argparse.Namespace, name: str) -> Any:
    from tokenmill.server.state import ServerConfig

    if args.responses_store_size < 0:
        raise ValueError(f"--responses-store-size={args.responses_store_size} is invalid: allowed an integer >= 0")
    for flag in ("max_waiting_requests", "max_n", "max_prompts", "max_pooling_inputs"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')}={value} is invalid: allowed an integer >= 1")
    if not 0 < args.max_body_mb < math.inf:
        raise ValueError(f"--max-body-mb={args.max_body_mb} is invalid: allowed finite values > 0")
    if not 0 < args.grammar_compile_timeout < math.inf:  # (a negative one failed every grammar, as the client's)
        raise ValueError(f"--grammar-compile-timeout={args.grammar_compile_timeout} is invalid: allowed finite "
                         "values > 0")  # fmt: skip
    if not 0 <= args.grace_period < math.inf:
        raise ValueError(f"--grace-period={args.grace_period} is invalid: allowed finite values >= 0")
    return ServerConfig(name, api_key(args), args.max_waiting_requests, args.max_n, args.max_prompts,
                        int(args.max_body_mb * 2**20), args.public_docs, args.tool_call_parser,
                        args.grammar_compile_timeout, args.responses_store_size, args.reasoning_parser,
                        args.max_pooling_inputs, args.web_ui)  # fmt: skip


def serve(args: argparse.Namespace, cfg: EngineConfig, path: Path, name: str, process: Any = None) -> int:
    """One model, loaded at start and kept; `process`: the engine's own process, already starting (an
    `EngineProcess`), else the engine runs in this one."""
    from tokenmill.server.models_registry import Limits, ModelRegistry, ModelSpec

    if args.data_parallel_size < 1 or (args.data_parallel_size > 1 and cfg.tensor_parallel_size > 1):
        raise ValueError(f"--data-parallel-size={args.data_parallel_size} is invalid: allowed an integer >= 1, "
                         "and 1 with --tensor-parallel-size > 1")  # fmt: skip
    if args.replica_max_restarts < 0:
        raise ValueError(f"--replica-max-restarts={args.replica_max_restarts} is invalid: allowed an integer >= 0")
    if not args.replica_restart_backoff > 0:
        raise ValueError(f"--replica-restart-backoff={args.replica_restart_backoff} is invalid: allowed seconds > 0")
    if args.data_parallel_size > 1 and cfg.lora:
        raise ValueError("LoRA adapters (--lora-modules, --enable-lora) do not run with --data-parallel-size > 1")
    config = server_config(args, name)
    died = threading.Event()
    spec = ModelSpec(name, lambda: _load(cfg, path, name, args, died, process))
    _run(args, config, ModelRegistry([spec], Limits(), keep_loaded=True))
    return EXIT_ENGINE_DIED if died.is_set() else 0


def serve_models(args: argparse.Namespace, models: list[tuple[str, EngineConfig]]) -> int:
    """Several models, each loaded when a request first names it, within the limits the flags set."""
    from tokenmill.assembly.estimate import estimate_bytes
    from tokenmill.server.models_registry import ModelRegistry, ModelSpec

    if args.data_parallel_size != 1 or any(cfg.tensor_parallel_size != 1 for _, cfg in models):
        raise ValueError("--data-parallel-size and --tensor-parallel-size serve one MODEL; with several models "
                         "(--model, --models-config) each runs in this process: allowed 1")  # fmt: skip
    if any(cfg.lora for _, cfg in models):
        raise ValueError("LoRA adapters (--lora-modules, --enable-lora) serve one MODEL; with several models "
                         "(--model, --models-config) they are not supported")  # fmt: skip
    limits = model_limits(args)
    gc.enable()  # these load on demand and may unload: the collector runs (cli.py paused it for the imports)
    specs = [ModelSpec(name, functools.partial(_load_model, cfg, name), estimate_bytes(cfg)) for name, cfg in models]
    _run(args, server_config(args, models[0][0]), ModelRegistry(specs, limits))
    return 0


def model_limits(args: argparse.Namespace) -> Any:
    from tokenmill.server.models_registry import Limits

    checks = {"max_loaded_models": (args.max_loaded_models, "an integer >= 1"),
              "models_memory_gb": (args.models_memory_gb, "values > 0"),
              "idle_unload_seconds": (args.idle_unload_seconds, "values > 0"),
              "model_load_timeout": (args.model_load_timeout, "values > 0")}  # fmt: skip
    for flag, (value, allowed) in checks.items():
        if value is not None and not value > 0:
            raise ValueError(f"--{flag.replace('_', '-')}={value} is invalid: allowed {allowed}")
    memory = None if args.models_memory_gb is None else int(args.models_memory_gb * 2**30)
    return Limits(args.max_loaded_models, memory, args.idle_unload_seconds, args.model_load_timeout)


def _run(args: argparse.Namespace, config: Any, models: Any) -> None:
    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    from tokenmill.server.app import build_app

    check_port(args.host, args.port)
    reaper.arm()  # whatever this process starts from now on ends when it does (tokenmill/reaper.py)
    json_logs = configure_logging(args.log_level, args.log_format)
    app = build_app(models, config, _tracer(args, config.served_model_name))
    # JSON: uvicorn's loggers propagate to the handler logs.py set, instead of its own config's
    log_config = None if json_logs else LOGGING_CONFIG
    # ws="none": no route takes a WebSocket, so uvicorn need not import its WebSocket protocol (~8 ms of a start)
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, ws="none",
                                    timeout_graceful_shutdown=args.grace_period, log_config=log_config),
                     app.state.tokenmill)  # fmt: skip
    # uvicorn re-raises SIGTERM to the handler that was there before once it has shut down; a no-op there
    # makes a graceful stop exit 0 instead of dying by the signal.
    signal.signal(signal.SIGTERM, lambda *_: None)
    if not models.keep_loaded:
        log.info("serving %s at http://%s:%d/v1 (each loads when first asked for)", ", ".join(models.names),
                 args.host, args.port)  # fmt: skip
    server.run()


def _tracer(args: argparse.Namespace, name: str) -> Any:
    """The OpenTelemetry tracer `--otlp-traces-endpoint` asks for, else None (and opentelemetry is not imported)."""
    if not args.otlp_traces_endpoint:
        return None
    from tokenmill.server.tracing import RequestTracer

    return RequestTracer(args.otlp_traces_endpoint, name)


def check_port(host: str, port: int) -> None:
    """Bind every address `host` names at `port` and let them go, as asyncio binds them for uvicorn once the app
    has started: a taken port (or a host this machine cannot bind) then stops the command before the model loads.
    (Handing such a socket to uvicorn instead made a 413 sent on a kept-alive connection arrive as a reset:
    tests/server/test_hostile_input.py.)"""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port={port} is invalid: allowed an integer in [0, 65535] (0: any free port)")
    if port == 0:  # any free one: nothing to check
        return
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host} cannot be resolved: {e.strerror}") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio: the IPv6 socket does not also take IPv4
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                hint = "; pick another --port, or 0 for any free one" if e.errno == errno.EADDRINUSE else ""
                raise ValueError(f"--host {host} --port {port} cannot be bound: {e.strerror or e}{hint}") from None


def _load(cfg: EngineConfig, path: Path, name: str, args: argparse.Namespace, died: threading.Event,
          process: Any) -> Any:  # fmt: skip
    """Runs on the loader thread. Any failure ends the process with one line: never a server that lies."""
    try:
        if process is not None:
            from tokenmill.engine.process_engine import connect

            engine: Any = connect(process, path)
        elif args.data_parallel_size > 1:
            from tokenmill.parallel.ray_engine import RayEngine, RestartPolicy

            restarts = RestartPolicy(args.replica_max_restarts, args.replica_restart_backoff)
            engine = RayEngine(replace(cfg, model=str(path)), args.data_parallel_size, args.ray_address, restarts)
        else:
            from tokenmill.engine.async_engine import AsyncEngine

            engine = AsyncEngine.from_config(replace(cfg, model=str(path)))
    except (TokenmillError, ValueError) as e:
        _die(f"tokenmill serve: error: {e}", EXIT_USAGE)
    except BaseException as e:
        log.debug("loading the model failed", exc_info=True)
        _die(f"tokenmill serve: error: loading {path} failed: {type(e).__name__}: {e}", EXIT_USAGE)

    def on_death(error: BaseException) -> None:
        log.error("the engine loop died (%r): shutting down, exit status %d", error, EXIT_ENGINE_DIED)
        died.set()
        os.kill(os.getpid(), signal.SIGTERM)

    engine.on_death = on_death
    freeze_heap()  # this model stays: its objects leave the collector's sight, which cli.py paused (memory.py)
    release_code_pages()  # what the imports and the load ran once leaves the resident set (memory.py)
    log.info("model %s from %s: %s, %d threads", name, path, engine.description, _threads(engine))
    log.info("serving at http://%s:%d/v1", args.host, args.port)
    return engine


def _threads(engine: Any) -> int:
    """The engine's intra-op threads (an engine in its own process says; else this process's torch)."""
    facts = getattr(engine, "facts", None)
    if facts is not None:
        return int(facts.threads)
    import torch

    return torch.get_num_threads()


def _load_model(cfg: EngineConfig, name: str) -> Any:
    """Runs on a worker thread, for one of several models: a failure is raised to the requests that wait for it."""
    import torch

    from tokenmill.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_config(cfg)
    log.info("model %s from %s: %s, %d threads", name, cfg.model, engine.description, torch.get_num_threads())
    return engine


def _die(message: str, status: int) -> Any:
    print(message.splitlines()[0] if message else "tokenmill serve: error", file=sys.stderr, flush=True)
    os._exit(status)


class _Server:
    """uvicorn's Server, with the abort-before-the-grace-period-ends step on the first shutdown signal."""

    def __init__(self, config: Any, state: Any) -> None:
        import uvicorn

        self.state, self.grace = state, float(config.timeout_graceful_shutdown or 0)
        self.server = uvicorn.Server(config)
        self._handle_exit = self.server.handle_exit
        self.server.handle_exit = self._on_exit  # type: ignore[method-assign]
        self._draining = False

    def run(self) -> None:
        self.server.run()

    def _on_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self._draining:
            self._draining = True
            margin = min(1.0, self.grace / 2)
            timer = threading.Timer(max(self.grace - margin, 0.0), self._abort_all)
            timer.daemon = True
            timer.start()
        self._handle_exit(sig, frame)

    def _abort_all(self) -> None:
        for engine in self.state.models.engines():
            if engine.is_healthy:
                engine.abort_all()
