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
    eos = llm.token_eos()
    token_prompts = [
        list(p) if not isinstance(p, str) else llm.tokenize(p.encode("utf-8"), add_bos=True, special=True)
        for p in prompts
    ]

    import llama_cpp as lc

    ctx, n_batch = llm._ctx.ctx, min(512, n_ctx)  # the raw llama_context (llama-cpp-python's own handle)
    greedy = lc.llama_sampler_init_greedy()

    def decode(ids: list[int]) -> None:
        for i in range(0, len(ids), n_batch):
            chunk = ids[i : i + n_batch]
            tokens = (lc.llama_token * len(chunk))(*chunk)  # alive until llama_decode has read it
            status = lc.llama_decode(ctx, lc.llama_batch_get_one(tokens, len(chunk)))
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status}")

    def generate(ids: list[int], n: int) -> tuple[list[int], float | None]:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)  # no prefix reuse: from position 0
        out: list[int] = []
        first: float | None = None
        if n <= 0:
            return out, first
        decode(ids)
        while len(out) < n:
            tok = lc.llama_sampler_sample(greedy, ctx, -1)
            if first is None:
                first = time.perf_counter()
            if tok == eos and not ignore_eos:
                break
            out.append(tok)
            if len(out) < n:
                decode([tok])
        return out, first

    warmup_s = 0.0
    if warmup and token_prompts and max_tokens > 0:
        t0 = time.perf_counter()
        generate(token_prompts[0][:8] or [eos], 2)
        warmup_s = time.perf_counter() - t0
    runs = []
    for ids in token_prompts:
        if len(ids) + max_tokens > n_ctx:
            raise ValueError(f"prompt of {len(ids)} tokens + {max_tokens} new tokens exceeds n_ctx={n_ctx}")
        t0 = time.perf_counter()
        out, first = generate(ids, max_tokens)
        elapsed = time.perf_counter() - t0
        runs.append({
            "prompt_tokens": len(ids),
            "ttft_ms": ((first if first is not None else time.perf_counter()) - t0) * 1000,
            "generate_time_s": elapsed,
            "completion_tokens": len(out),
            "token_ids": out,
            "text": llm.detokenize(out).decode("utf-8", errors="replace"),
        })  # fmt: skip
    total_tokens = sum(r["completion_tokens"] for r in runs)
    total_time = sum(r["generate_time_s"] for r in runs)
    lc.llama_sampler_free(greedy)
    if hasattr(llm, "close"):
        llm.close()
    return {
        "load_time_s": load_time,
        "warmup_s": warmup_s,
        "runs": runs,
        "completion_tokens": total_tokens,
        "generate_time_s": total_time,
        "tokens_per_second": total_tokens / total_time if total_time > 0 else 0.0,
        "llama_cpp_version": llamacpp_version(),
    }
