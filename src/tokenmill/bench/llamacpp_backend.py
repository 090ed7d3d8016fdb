"""The llama.cpp peer through `llama-cpp-python` (optional: `pip install 'tokenmill[llamacpp]'`).

`run_llamacpp` loads a GGUF (see `gguf_export.py`) and generates greedily for each prompt, one at a time, timing
the load, the first token (TTFT) and the whole generation. Each prompt starts from an empty KV cache: llama-cpp-python
would otherwise reuse a cached common prefix between prompts, which the other backends do not get to do.

The loop is llama.cpp's own C API (`llama_decode`, then a greedy `llama_sampler_sample`), as its `simple` example
runs it, not `Llama.generate`, which builds a sampler chain in Python for every token: what is timed is llama.cpp.
`compare` runs this in a worker without tokenmill's OMP_WAIT_POLICY (compare.worker_env).
"""

from __future__ import annotations

import time
from importlib import metadata
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install 'tokenmill[llamacpp]'"


class BackendUnavailable(Exception):
    """llama-cpp-python is not installed (or cannot load its native library)."""


def llamacpp_version() -> str | None:
    """The installed llama-cpp-python version, or None when it is not installed."""
    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None


def _import_llama() -> Any:
    try:
        from llama_cpp import Llama
    except ImportError as e:
        raise BackendUnavailable(f"llama.cpp backend needs llama-cpp-python: {INSTALL_HINT} ({e})") from e
    except (OSError, RuntimeError) as e:
        raise BackendUnavailable(f"llama-cpp-python is installed but cannot load: {e}; try {INSTALL_HINT}") from e
    return Llama


class _Greedy:
    """Greedy generation on llama.cpp's raw context (llama-cpp-python's own handle): the prompt in batches of
    n_batch, then one token at a time, each from an empty KV cache (no prefix reuse: from position 0)."""

    def __init__(self, llm: Any, n_batch: int, ignore_eos: bool) -> None:
        import llama_cpp as lc

        self.lc, self.ctx, self.n_batch = lc, llm._ctx.ctx, n_batch
        self.eos, self.ignore_eos = llm.token_eos(), ignore_eos
        self.sampler = lc.llama_sampler_init_greedy()

    def _decode(self, ids: list[int]) -> None:
        lc = self.lc
        for i in range(0, len(ids), self.n_batch):
            chunk = ids[i : i + self.n_batch]
            tokens = (lc.llama_token * len(chunk))(*chunk)  # alive until llama_decode has read it
            status = lc.llama_decode(self.ctx, lc.llama_batch_get_one(tokens, len(chunk)))
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status}")

    def generate(self, ids: list[int], n: int) -> tuple[list[int], float | None]:
        """Up to n tokens after `ids` (fewer at EOS unless ignore_eos), and when the first was sampled."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        out: list[int] = []
        first: float | None = None
        if n <= 0:
            return out, first
        self._decode(ids)
        while len(out) < n:
            tok = self.lc.llama_sampler_sample(self.sampler, self.ctx, -1)
            if first is None:
                first = time.perf_counter()
            if tok == self.eos and not self.ignore_eos:
                break
            out.append(tok)
            if len(out) < n:
                self._decode([tok])
        return out, first

    def timed(self, llm: Any, ids: list[int], max_tokens: int) -> dict[str, Any]:
        """One prompt's run: its tokens, text, TTFT and generation time."""
        t0 = time.perf_counter()
        out, first = self.generate(ids, max_tokens)
        elapsed = time.perf_counter() - t0
        return {
            "prompt_tokens": len(ids),
            "ttft_ms": ((first if first is not None else time.perf_counter()) - t0) * 1000,
            "generate_time_s": elapsed,
            "completion_tokens": len(out),
            "token_ids": out,
            "text": llm.detokenize(out).decode("utf-8", errors="replace"),
        }

    def close(self) -> None:
        self.lc.llama_sampler_free(self.sampler)


def run_llamacpp(
    gguf_path: Path,
    prompts: list[str] | list[list[int]],
    max_tokens: int,
    n_threads: int,
    n_ctx: int,
    *,
    ignore_eos: bool = True,
    warmup: bool = True,
) -> dict[str, Any]:
    """Greedy generation of `max_tokens` per prompt (text, or token ids used as they are) with llama.cpp.

    Returns {"load_time_s", "warmup_s", "runs": [{"prompt_tokens", "ttft_ms", "generate_time_s",
    "completion_tokens", "token_ids", "text"}, ...], "completion_tokens", "generate_time_s",
    "tokens_per_second", "llama_cpp_version"}. Text prompts are tokenized as the GGUF says (BOS if it adds one,
    special tokens parsed). `ignore_eos` (the default, like the other backends in `compare`) generates exactly
    `max_tokens`; `warmup` first runs a short untimed generation so one-off start-up costs are not in run 0.
    """
    Llama = _import_llama()
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    threads = n_threads if n_threads and n_threads > 0 else None
    start = time.perf_counter()
    llm = Llama(
        model_path=str(gguf_path), n_ctx=n_ctx, n_batch=min(512, n_ctx), n_threads=threads,
        n_threads_batch=threads, verbose=False,
    )  # fmt: skip
    load_time = time.perf_counter() - start
    token_prompts = [
        list(p) if not isinstance(p, str) else llm.tokenize(p.encode("utf-8"), add_bos=True, special=True)
        for p in prompts
    ]
    greedy: _Greedy | None = None
    try:
        for ids in token_prompts:
            if len(ids) + max_tokens > n_ctx:
                raise ValueError(f"prompt of {len(ids)} tokens + {max_tokens} new tokens exceeds n_ctx={n_ctx}")
        greedy = _Greedy(llm, min(512, n_ctx), ignore_eos)
        warmup_s = 0.0
        if warmup and token_prompts and max_tokens > 0:
            t0 = time.perf_counter()
            greedy.generate(token_prompts[0][:8] or [greedy.eos], 2)
            warmup_s = time.perf_counter() - t0
        runs = [greedy.timed(llm, ids, max_tokens) for ids in token_prompts]
    finally:
        if greedy is not None:
            greedy.close()
        if hasattr(llm, "close"):
            llm.close()
    total_tokens = sum(r["completion_tokens"] for r in runs)
    total_time = sum(r["generate_time_s"] for r in runs)
    return {
        "load_time_s": load_time,
        "warmup_s": warmup_s,
        "runs": runs,
        "completion_tokens": total_tokens,
        "generate_time_s": total_time,
        "tokens_per_second": total_tokens / total_time if total_time > 0 else 0.0,
        "llama_cpp_version": llamacpp_version(),
    }
