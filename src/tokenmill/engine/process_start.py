"""The engine's process seen from the server's, until it is ready: the process (`EngineProcess`, started before the
server's own imports), the socket between them (`Link`), the facts it sends once loaded (`EngineFacts`), and the
tokenizer the server builds meanwhile (`load_tokenizer`). engine/process_engine.py serves through them."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.pooling_params import ModelTask
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer

log = logging.getLogger("tokenmill.engine")


@dataclass(frozen=True)
class EngineFacts:
    """What the engine's process tells the server once it has loaded: the facts requests are checked against."""

    max_model_len: int
    vocab_size: int
    task: ModelTask
    defaults: SamplingParams  # the checkpoint's generation_config.json sampling defaults
    description: str
    memory_bytes: int
    num_blocks: int  # the KV pool's blocks (0 with an unpaged cache)
    block_size: int  # tokens a block holds (0: unpaged: a request needs no blocks)
    hidden_size: int
    adapters: tuple[tuple[str, str], ...] | None  # (name, folder) of each LoRA adapter; None: it serves none
    threads: int
    pid: int

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) if self.block_size else 0


class Link:
    """One end of the socket pair: whole pickled messages, sent from any thread."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: Any) -> None:
        with self._lock:
            self.conn.send(message)

    def recv(self) -> Any:
        return self.conn.recv()


class EngineProcess:
    """The engine's process, started before anything heavy is imported here."""

    def __init__(self, cfg: EngineConfig, log_level: str, log_format: str) -> None:
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-P", "-m", "tokenmill.server.engine_process", str(theirs.fileno()), str(os.getpid())]
        self.proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),))
        theirs.close()
        self.link = Link(Connection(ours.detach()))
        self.link.send((cfg, log_level, log_format))

    def wait_ready(self) -> EngineFacts:
        """Block until the engine has loaded. ValueError with the engine's one line if it could not."""
        try:
            kind, payload = self.link.recv()
        except (EOFError, OSError):
            status = self.proc.wait()
            raise ValueError(f"the engine's process exited with status {status} while loading the model") from None
        if kind != "ready":
            self.proc.wait()
            raise ValueError(payload)
        facts: EngineFacts = payload
        return facts

    def stop(self, timeout: float) -> None:
        with contextlib.suppress(OSError):  # (it has gone already)
            self.link.send(("stop",))
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the engine's process did not stop within %.0f s: killing it", timeout)
            self.proc.kill()
            self.proc.wait()


def load_tokenizer(path: Path) -> Tokenizer:
    """The model's tokenizer, read as the engine's loader reads it, without torch (engine/../assembly/model.py)."""
    from tokenmill.tokenizer.gguf import kept_folder

    if path.suffix.lower() != ".gguf" or (kept_folder(path) / "tokenizer_config.json").is_file():
        return Tokenizer(path)  # (a GGUF's kept tokenizer: its header need not be read, nor numpy imported)
    from tokenmill.weights.gguf_reader import GGUFFile

    header = GGUFFile(path)

    def meta(key: str) -> Any:
        f = header.fields.get(key)
        return None if f is None else f.contents()

    arch = meta("general.architecture")
    return Tokenizer(path, None if arch is None else str(arch), meta)
