"""One backend, one process: load a model, run the prompts greedily one at a time, write a JSON result.

    python -m tokenmill.bench.worker --backend tokenmill|transformers|llama.cpp --model DIR \
        --spec SPEC.json --out OUT.json

`compare.py` starts one of these per backend so each backend's memory is its own, and samples its RSS.
The spec holds the prompts (token ids), max_tokens, threads, dtype and, for llama.cpp, the GGUF path.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def _tokenmill(model: str, spec: dict[str, Any]) -> dict[str, Any]:
    from tokenmill import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, **{"dtype": spec["dtype"], **spec.get("engine", {}), "enable_prefix_caching": False})
    load = time.perf_counter() - start
    if spec["prompts"]:  # untimed warmup, as the llama.cpp backend does
        llm.generate([{"prompt_token_ids": spec["prompts"][0][:8]}], SamplingParams(temperature=0, max_tokens=2))
    runs = []
    for ids in spec["prompts"]:
        t0 = time.perf_counter()
        out = llm.generate(
            [{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
        )[0]
        elapsed = time.perf_counter() - t0
        m = out.metrics
        assert m is not None
        c = out.outputs[0]
        runs.append(
            {
                "prompt_tokens": len(ids),
                "ttft_ms": m.ttft_ms,
                "generate_time_s": elapsed,
                "completion_tokens": len(c.token_ids),
                "token_ids": c.token_ids,
                "text": c.text,
            }
        )
    from tokenmill.models.linear import weight_bytes

    return {"load_time_s": load, "runs": runs, "weight_bytes": weight_bytes(llm.loaded.model)}


def _transformers(model: str, spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        def __init__(self) -> None:
            self.calls = 0
            self.first: float | None = None

        def put(self, value: Any) -> None:
            self.calls += 1
            if self.calls == 2 and self.first is None:  # the first put() is the prompt
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    start = time.perf_counter()
    where = {"pretrained_model_name_or_path": model}
    if model.lower().endswith(".gguf"):  # transformers dequantizes a GGUF into its own model
        where = {"pretrained_model_name_or_path": str(Path(model).parent), "gguf_file": Path(model).name}
    hf = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype[spec["dtype"]]).eval()
    tok = AutoTokenizer.from_pretrained(**where)
    load = time.perf_counter() - start
    if spec["prompts"]:  # untimed warmup
        with torch.inference_mode():
            hf.generate(torch.tensor([spec["prompts"][0][:8]]), max_new_tokens=2, do_sample=False)
    runs = []
    for ids in spec["prompts"]:
        streamer = FirstToken()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=spec["max_tokens"],
                min_new_tokens=spec["max_tokens"],
                do_sample=False,
                streamer=streamer,
            )
        elapsed = time.perf_counter() - t0
        new = out[0, len(ids) :].tolist()
        ttft = ((streamer.first or time.perf_counter()) - t0) * 1000
        runs.append(
            {
                "prompt_tokens": len(ids),
                "ttft_ms": ttft,
                "generate_time_s": elapsed,
                "completion_tokens": len(new),
                "token_ids": new,
                "text": tok.decode(new, skip_special_tokens=True),
            }
        )
    return {"load_time_s": load, "runs": runs}


def _llamacpp(model: str, spec: dict[str, Any]) -> dict[str, Any]:
    from tokenmill.bench.llamacpp_backend import run_llamacpp

    result = run_llamacpp(Path(spec["gguf"]), spec["prompts"], spec["max_tokens"], spec["threads"], spec["n_ctx"])
    # what a decode step reads: the GGUF's tensors (its token embedding too: read whole when tied to the LM head)
    return {**result, "weight_bytes": Path(spec["gguf"]).stat().st_size}


BACKENDS = {"tokenmill": _tokenmill, "transformers": _transformers, "llama.cpp": _llamacpp}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=list(BACKENDS), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--spec", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    spec = json.loads(Path(a.spec).read_text())
    if spec.get("threads"):
        import torch

        torch.set_num_threads(spec["threads"])
    try:
        result = BACKENDS[a.backend](a.model, spec)
        result["status"] = "ok"
    except ImportError as e:
        result = {"status": "not installed", "error": str(e)}
    except Exception as e:
        result = {
            "status": "unavailable" if type(e).__name__ == "BackendUnavailable" else "error",
            "error": f"{type(e).__name__}: {e}",
        }
    Path(a.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
