"""The engine's process: `python -m tokenmill.server.engine_process FD SERVER_PID`, started by the server
(process_engine.py).

It reads the engine's config from the socket FD, loads the model, says "ready" with the facts the server checks
requests against (or "failed" with one line), and then serves the socket:
- the main thread reads the server's messages: requests to add, aborts, calls, and "stop";
- the engine's loop thread (`PipeEngine`, an `AsyncEngine`) sends, after each step, its published numbers and the
  step's outputs, each encoded as what it adds (output_codec.py), in one message;
- calls (a grammar's compile, LoRA loads and unloads) run on worker threads and reply when done.
It ends when the server asks, and at once when the socket closes (the server has gone, however it went). A
Ctrl-C reaches the whole process group: the server decides, so this process ignores SIGINT.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.output_codec import OutputEncoder
from tokenmill.engine.process_start import EngineFacts, Link

log = logging.getLogger("tokenmill.engine")


class PipeEngine(AsyncEngine):
    """An `AsyncEngine` whose outputs go down the socket instead of to streams in this process."""

    def attach(self, link: Link) -> None:
        self.link = link
        self._encoders: dict[str, OutputEncoder] = {}
        self._applied_total = 0  # loop thread: sequences its published snapshot counts
        self._sent: tuple[Any, int] | None = None

    def _publish(self) -> None:
        self._applied_total += self._applied_seqs
        super()._publish()

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        items: list[tuple[str, Any, BaseException | None]] = []
        for request_id, item in outbox:
            if isinstance(item, BaseException):
                items.append((request_id, None, item))
                self._encoders.pop(request_id, None)
                continue
            encoder = self._encoders.setdefault(request_id, OutputEncoder())
            items.append((request_id, encoder.encode(item), None))
            if item.finished or item.error is not None:
                del self._encoders[request_id]
        numbers = (self._snapshot, self._applied_total)
        if items or numbers != self._sent:
            self._sent = numbers
            self.link.send(("out", *numbers, items))


def facts(engine: AsyncEngine) -> EngineFacts:
    import torch

    core = engine.core
    registry = core.lora
    adapters = None if registry is None else tuple((a.name, a.path) for a in registry.loaded)
    return EngineFacts(engine.max_model_len, engine.vocab_size, engine.task, engine.default_sampling_params(),
                       engine.description, engine.memory_bytes, core.kv.num_blocks,
                       getattr(core.kv, "block_size", 0) if core.kv.num_blocks_needed(1) else 0, core.hidden_size,
                       adapters, torch.get_num_threads(), os.getpid())  # fmt: skip


def _run_call(engine: PipeEngine, kind: str, args: tuple[Any, ...]) -> Any:
    if kind == "compile":
        engine.compile_grammar(*args)
        return None
    if kind == "load_lora":
        asyncio.run(engine.load_lora(*args))
    elif kind == "unload_lora":
        asyncio.run(engine.unload_lora(*args))
    else:
        raise ValueError(f"unknown call {kind!r}")
    return tuple(engine.lora_adapters())


def _call(engine: PipeEngine, link: Link, call_id: int, kind: str, args: tuple[Any, ...]) -> None:
    try:
        reply: tuple[Any, ...] = ("reply", call_id, True, _run_call(engine, kind, args))
    except Exception as e:  # the caller's error: it goes back to the server's caller
        reply = ("reply", call_id, False, e)
    try:
        link.send(reply)
    except Exception:  # an error that does not pickle: its text does
        link.send(("reply", call_id, False, RuntimeError(f"{type(reply[3]).__name__}: {reply[3]}")))


class ServerTokenizer:
    """What the server said of its tokenizer (its first message after the config, read when the load needs it):
    the EOS id, from which this process's tokenizer waits to be built until a grammar needs it. Where the server
    could not build one, this process builds its own at once, so the load fails with the tokenizer's own line."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self._said: tuple[bool, int | None] | None = None

    def said(self) -> tuple[bool, int | None]:
        if self._said is None:
            message = self.link.recv()
            if message[0] != "tokenizer":  # the server is stopping before it got that far ("stop")
                os._exit(0)
            self._said = (bool(message[1]), message[2])
        return self._said

    def make(self, source: Any, model_type: str | None, gguf_metadata: Any) -> Any:
        from tokenmill.tokenizer import DeferredTokenizer, Tokenizer

        if not self.said()[0]:
            return Tokenizer(source, model_type, gguf_metadata)
        return DeferredTokenizer(source, model_type, gguf_metadata, lambda: self.said()[1])


def _load(cfg: Any, link: Link) -> PipeEngine | None:
    from tokenmill.assembly import load
    from tokenmill.engine.build import build_engine_core
    from tokenmill.errors import TokenmillError
    from tokenmill.memory import freeze_heap, release_code_pages

    tokenizer = ServerTokenizer(link)
    try:
        loaded = load(cfg, make_tokenizer=tokenizer.make)
        engine = PipeEngine(build_engine_core(loaded, cfg, detokenize=False), loaded)
        tokenizer.said()  # (read before serving, whether or not the load needed it)
    except (TokenmillError, ValueError) as e:
        link.send(("failed", str(e)))
        return None
    except BaseException as e:
        log.debug("loading the model failed", exc_info=True)
        link.send(("failed", f"loading {cfg.model} failed: {type(e).__name__}: {e}"))
        return None
    engine.attach(link)
    engine.on_death = lambda e: link.send(("died", repr(e)))
    engine.start()
    freeze_heap()  # the model stays: its objects leave the collector's sight (memory.py)
    release_code_pages()  # what the imports ran once leaves the resident set (memory.py)
    link.send(("ready", facts(engine)))
    return engine


def serve(engine: PipeEngine, link: Link) -> None:
    """The main thread: the server's messages, until "stop" or the socket's end."""
    calls = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="tokenmill-call")
    while True:
        try:
            message = link.recv()
        except (EOFError, OSError):  # the server has gone: nothing is left to serve
            os._exit(0)
        kind = message[0]
        if kind == "add":
            engine.post_requests(message[1])
        elif kind == "abort":
            engine.abort(message[1])
        elif kind == "stop_seq":
            engine.stop_sequence(*message[1:])
        elif kind == "abort_all":
            engine.abort_all()
        elif kind == "call":
            calls.submit(_call, engine, link, *message[1:])
        elif kind == "stop":
            engine.shutdown()
            calls.shutdown(wait=False, cancel_futures=True)
            return


def _die_with_server(server_pid: int) -> None:
    """SIGKILL this process as soon as the server's ends, even in the middle of a load (Linux's PR_SET_PDEATHSIG;
    the socket's end does it too, once serving). What this process started is then reaped by its own reaper."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # (not glibc's Linux: the socket's end alone)
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != server_pid:  # it ended before the call above
        os._exit(0)


def main(argv: list[str]) -> int:
    from tokenmill import reaper
    from tokenmill.server.logs import configure_logging

    _die_with_server(int(argv[2]))
    # a Ctrl-C, systemd's stop (KillMode=control-group) and timeout(1) signal the whole group: the server drains its
    # requests through this process, then stops it (its "stop" message; it dies with the server in any case)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    gc.disable()  # (as the server's start: the collector would walk the imports' objects again and again)
    link = Link(Connection(int(argv[1])))
    cfg, log_level, log_format = link.recv()
    configure_logging(log_level, log_format)
    reaper.arm()  # what this process starts (a kernel build's compiler jobs) ends with it
    engine = _load(cfg, link)
    if engine is None:
        return 2
    serve(engine, link)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
