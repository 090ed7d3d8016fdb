"""Helpers for the server tests: a real `tokenmill serve` subprocess on 127.0.0.1, SSE parsing, error checks,
and offline (in-process `LLM`) expectations to compare the server's outputs with.

`launch(model_dir, tmp_dir, *flags)` starts a server and waits for `/health`; `Server.stop()` sends SIGTERM and
returns the exit status. conftest's module-scoped `server` fixture uses `running(...)`, reading a module's
SERVER_FLAGS / SERVED_MODEL_NAME.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tokenmill import LLM, SamplingParams
from tokenmill.forward import DecodeRunPath, GraphsPath, ModulesPath, StackListsPath, StackMetadataPath
from tokenmill.outputs import CompletionOutput

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
# the names a response's `timings.forward_steps` may hold: the runner's forward paths
FORWARD_PATHS = frozenset(p.name for p in (GraphsPath, StackListsPath, StackMetadataPath, DecodeRunPath, ModulesPath))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    model: str  # the name requests must use
    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait (bounded), and return the exit status; kill it if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise AssertionError(f"server did not exit {timeout}s after SIGTERM; log:\n{self.log_tail()}") from None


def launch(
    model_dir: Path | str | None,
    tmp_dir: Path,
    *flags: str,
    served_name: str | None = None,
    env: dict[str, str] | None = None,
    launcher: list[str] | None = None,
) -> Server:
    """Start `python -m tokenmill serve MODEL_DIR ...` on a free port (`launcher` replaces `python -m`, e.g. with
    torchrun's; no MODEL_DIR: the flags name the models); return once `/health` answers 200."""
    port = free_port()
    model = [] if model_dir is None else [str(model_dir)]
    cmd = [*(launcher or [sys.executable, "-m"]), "tokenmill", "serve", *model, "--host", HOST, "--port",
           str(port), "--dtype", "float32", *flags]  # fmt: skip
    if served_name is not None:
        cmd += ["--served-model-name", served_name]
    # Two shared cores: the server and the test process each get one intra-op thread (no spin contention).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    log_path = tmp_dir / f"server-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, f"http://{HOST}:{port}", served_name or str(model_dir or ""), log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode} during startup; log:\n{server.log_tail()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                return server
        if time.monotonic() > deadline:
            server.stop()
            raise AssertionError(f"/health not 200 within {STARTUP_TIMEOUT_S}s; log:\n{server.log_tail()}")
        time.sleep(0.2)  # bounded polling of /health


@contextlib.contextmanager
def running(
    model_dir: Path | str | None,
    tmp_dir: Path,
    *flags: str,
    served_name: str | None = None,
    env: dict[str, str] | None = None,
    launcher: list[str] | None = None,
) -> Iterator[Server]:
    server = launch(model_dir, tmp_dir, *flags, served_name=served_name, env=env, launcher=launcher)
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop()


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def offline(llm: LLM, prompt: Any, max_tokens: int, **params: Any) -> CompletionOutput:
    """What the engine produces for `prompt` run alone (greedy, ignore_eos unless overridden)."""
    params = {"temperature": 0.0, "ignore_eos": True, **params}
    with _one_thread():
        return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, **params))[0].outputs[0]


def offline_chat(llm: LLM, messages: list[dict[str, Any]], max_tokens: int, **params: Any) -> CompletionOutput:
    params = {"temperature": 0.0, "ignore_eos": True, **params}
    with _one_thread():
        return llm.chat(messages, SamplingParams(max_tokens=max_tokens, **params))[0].outputs[0]


def sse_events(raw: str) -> list[dict[str, str]]:
    """Split an SSE body into events ({"event"?, "data"}); every event must end with a blank line."""
    assert raw.endswith("\n\n"), f"SSE body must end with a blank line: {raw[-80:]!r}"
    events = []
    for block in raw.split("\n\n")[:-1]:
        event: dict[str, str] = {}
        for line in block.split("\n"):
            field, sep, value = line.partition(":")
            assert sep, f"malformed SSE line {line!r}"
            event[field] = value[1:] if value.startswith(" ") else value
        events.append(event)
    return events


def sse_json(events: list[dict[str, str]]) -> list[dict[str, Any]]:
    """The JSON payloads of `data:` events before the final `[DONE]`, which must be the last event."""
    assert events and events[-1] == {"data": "[DONE]"}, f"stream must end with data: [DONE], got {events[-1:]}"
    return [json.loads(e["data"]) for e in events[:-1]]


def assert_openai_error(resp: httpx.Response, status: int, *mentions: str) -> dict[str, Any]:
    """An OpenAI-shaped error body with this status whose message/param mention every string given."""
    assert resp.status_code == status, f"expected {status}, got {resp.status_code}: {resp.text[:500]}"
    assert "Traceback" not in resp.text
    body = resp.json()
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"]
    said = f"{error['message']} {error['param'] or ''}"
    for word in mentions:
        assert word in said, f"{word!r} not named in error {error}"
    return error


def train_tiny_llama(tok: Any, prompt_ids: list[int], target_ids: list[int], out: Path) -> Path:
    """A tiny Llama trained here (a few seconds) to answer `prompt_ids` with `target_ids`, saved with `tok` to `out`:
    a model that really writes a tool call or a think block, for the servers' parsers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))  # fmt: skip
    model = LlamaForCausalLM(cfg)
    ids = torch.tensor([prompt_ids + target_ids])
    labels = torch.tensor([[-100] * len(prompt_ids) + target_ids])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if loss.item() < 1e-3:
            break
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


# A tiny Llama that thinks in `<think>...</think>` before it answers, behind a Qwen3-like template (which writes an
# earlier assistant turn's `reasoning_content` back as its thinking): asked REASONER_ASK, it answers greedily with
# REASONER_THOUGHT as its reasoning and REASONER_ANSWER as its content.
REASONER_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.reasoning_content is defined and m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
REASONER_ASK = [{"role": "user", "content": "How is the weather?"}]
REASONER_THOUGHT = "\nThe sky is blue and the sun is up high.\n"
REASONER_ANSWER = "\n\nIt is sunny."


def train_reasoner(tokenizer_dir: Path, out: Path) -> Path:
    """The reasoning model above, trained here (a few seconds) with the tests' tokenizer and saved to `out`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.add_tokens(["<think>", "</think>"])  # as Qwen3's: added tokens, not special ones
    tok.chat_template = REASONER_TEMPLATE
    p_ids = tok.encode(
        tok.apply_chat_template(REASONER_ASK, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    t_ids = tok.encode(f"<think>{REASONER_THOUGHT}</think>{REASONER_ANSWER}<|im_end|>", add_special_tokens=False)
    return train_tiny_llama(tok, p_ids, t_ids, out)
