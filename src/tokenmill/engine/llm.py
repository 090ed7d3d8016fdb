"""The offline API, shaped like vLLM's `LLM` so its users feel at home.

llm = LLM(model="path-or-hub-id", dtype="float32", device="cpu")
outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

LoRA adapters (peft folders), as vLLM's: `LLM(model, lora_modules={"sql": "/adapters/sql"})` (or `enable_lora=True`
and `llm.load_lora(name, path)` later), then `llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, path))`
or `lora_request="sql"`; a request without one runs on the base model.

A model served for pooling (`task="embed"` / `"score"`, or detected from the checkpoint) embeds and scores:
`llm.embed(["Hello"])[0].outputs.embedding`, `llm.score("query", ["doc 1", "doc 2"])[0].outputs.score`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.assembly import LoadedModel, load
from tokenmill.config import EngineConfig
from tokenmill.engine.build import build_engine_core
from tokenmill.engine.scoring import score_pairs, score_prompt
from tokenmill.errors import LoraError
from tokenmill.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.types import EngineRequest

Prompt = str | dict[str, Any]  # "text" | {"prompt": "text"} | {"prompt_token_ids": [...]}
Message = dict[str, Any]


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: the adapter a request runs with, loaded from `lora_path` the first time its name is used
    (`lora_int_id` is kept for vLLM's signature; tokenmill numbers adapters itself)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None


LoraArg = LoRARequest | str | None


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        self.config = EngineConfig(model=model, **engine_kwargs)
        self.loaded: LoadedModel = load(self.config)
        self.tokenizer = self.loaded.tokenizer
        self.engine = build_engine_core(self.loaded, self.config)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (they also end with this process)."""
        self.engine.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json sampling defaults (what vLLM uses when none are given)."""
        return self.loaded.default_sampling_params()

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int], float]:
        start = time.perf_counter()
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt), (time.perf_counter() - start) * 1000
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]], 0.0
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return self._tokenize(prompt["prompt"])
        raise ValueError(f"a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids', got {prompt!r}")

    def load_lora(self, name: str, path: str) -> None:
        """Serve the peft adapter in folder `path` as `name` (LoraError if it does not fit or the name is taken)."""
        if self.engine.lora is None:
            raise LoraError("this LLM serves no LoRA adapters: make it with enable_lora=True or lora_modules")
        self.engine.lora.add(self.engine.lora.read(name, path))

    def unload_lora(self, name: str) -> None:
        if self.engine.lora is None:
            raise LoraError(f"no LoRA adapter named {name!r}: this LLM serves none")
        self.engine.lora.remove(name)

    def _lora_name(self, lora: LoraArg) -> str | None:
        """The adapter's name, loading a `LoRARequest`'s folder the first time its name is seen."""
        if isinstance(lora, LoRARequest):
            loaded = self.engine.lora is not None and lora.lora_name in self.engine.lora.names
            if not loaded and lora.lora_path is not None:
                self.load_lora(lora.lora_name, lora.lora_path)
            return lora.lora_name
        return lora

    def _add(self, prompt: Prompt, params: SamplingParams, priority: int = 0, lora: str | None = None) -> str:
        arrival = time.perf_counter()
        text, token_ids, tokenization_ms = self._tokenize(prompt)
        max_tokens = self.engine.validate(token_ids, params, lora)
        request_id = self.engine.new_request_id()
        request = EngineRequest(request_id, token_ids, params, max_tokens, text, arrival, tokenization_ms, priority,
                                lora=lora)  # fmt: skip
        self.engine.add_request(request)
        return request_id

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoraArg | Sequence[LoraArg] = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts.

        `priority` (one per prompt, lower first) matters with `scheduling_policy="priority"`. `lora_request`: the
        LoRA adapter (a `LoRARequest` or a loaded adapter's name) for every prompt, or one per prompt (None: the
        base model); the prompts run in the same batches whatever their adapters.
        """
        batch = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        params = self._params_for(len(batch), sampling_params)
        priorities = list(priority) if priority is not None else [0] * len(batch)
        if len(priorities) != len(batch):
            raise ValueError(f"got {len(priorities)} priorities for {len(batch)} prompts; they must match")
        one = lora_request is None or isinstance(lora_request, LoRARequest | str)
        loras = [lora_request] * len(batch) if one else list(lora_request)  # type: ignore[arg-type]
        if len(loras) != len(batch):
            raise ValueError(f"got {len(loras)} lora requests for {len(batch)} prompts; they must match")
        names = [self._lora_name(lora) for lora in loras]  # type: ignore[arg-type]
        ids: list[str] = []
        try:
            for p, sp, prio, lora in zip(batch, params, priorities, names, strict=True):
                ids.append(self._add(p, sp, prio, lora))
        except Exception:
            for rid in ids:  # a bad prompt fails the call without leaving the others running
                self.engine.abort(rid)
            raise
        return self._run(ids)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list of them) and generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts: list[Prompt] = []
        for conv in conversations:
            ids = self.tokenizer.apply_chat_template(
                conv,  # type: ignore[arg-type]
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            prompts.append({"prompt_token_ids": ids, "prompt": self.tokenizer.decode(ids, False)})
        return self.generate(prompts, sampling_params)

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (`.outputs.embedding`), in the order of the prompts; `pooling_params` sets
        `dimensions` and `normalize` for all of them."""
        batch = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        params = pooling_params or PoolingParams()
        outs = self._pool([self._tokenize(p)[1] for p in batch], params)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(data)) for o, data in outs]

    def score(
        self, data_1: str | Sequence[str], data_2: str | Sequence[str], instruction: str | None = None
    ) -> list[ScoringRequestOutput]:
        """The relevance score of each pair (`.outputs.score`): one data_1 with each data_2, or element by element
        (as vLLM's `LLM.score`). `instruction`: a yes/no reranker's task description (Qwen3-Reranker's default)."""
        pooling = self.loaded.task.pooling
        if pooling is None or pooling.task != "score":
            raise ValueError(f"this model is served for {', '.join(self.loaded.task.names)}, not score: load it with "
                             "task='score'")  # fmt: skip
        first = data_1 if isinstance(data_1, str) else list(data_1)
        second = data_2 if isinstance(data_2, str) else list(data_2)
        prompts = [score_prompt(self.tokenizer, pooling, q, d, instruction) for q, d in score_pairs(first, second)]
        outs = self._pool(prompts, PoolingParams(task="score"))
        return [ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(data[0])) for o, data in outs]

    def _pool(self, prompts: list[list[int]], params: PoolingParams) -> list[tuple[RequestOutput, list[float]]]:
        """Run pooling requests to the end: (each one's output, its pooled vector), in order."""
        ids: list[str] = []
        try:
            for token_ids in prompts:
                self.engine.validate_pooling(token_ids, params)
                request_id = self.engine.new_request_id()
                self.engine.add_request(EngineRequest(request_id, token_ids, SamplingParams(max_tokens=None), 0,
                                                      arrival_time=time.perf_counter(), pooling=params))  # fmt: skip
                ids.append(request_id)
        except Exception:
            for rid in ids:  # a bad prompt fails the call without leaving the others running
                self.engine.abort(rid)
            raise
        results = []
        for out in self._run(ids):
            if out.pooled is None:
                raise RuntimeError(f"request {out.request_id} ended without a result: {out.error or 'aborted'}")
            results.append((out, out.pooled.data))
        return results

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield a `RequestOutput` after every step for one prompt; `new_text` holds each step's text."""
        request_id = self._add(prompt, sampling_params or self.get_default_sampling_params())
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(request_id)

    def _params_for(
        self, count: int, sampling_params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(f"got {len(sampling_params)} sampling params for {count} prompts; they must match")
        return list(sampling_params)

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        pending, done = set(request_ids), {}
        while pending:
            if not self.engine.has_unfinished():
                raise RuntimeError(f"requests {sorted(pending)} vanished from the engine")
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    done[out.request_id] = out
                    pending.discard(out.request_id)
        return [done[rid] for rid in request_ids]
