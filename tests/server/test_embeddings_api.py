"""`POST /v1/embeddings` through a real `tokenmill serve` of an embedding checkpoint laid out as Qwen3-Embedding's
(a causal Qwen3 with sentence-transformers' last-token pooling: served as an embedder with no flag), driven by the
official `openai` SDK and LangChain's `OpenAIEmbeddings`; the vectors equal the offline engine's, which
tests/parity/test_pooling_models.py holds to transformers. Also: the rerank and score endpoints on an embedding model
(the cosine of two embeddings), bad input (a 400 in OpenAI's shape each, nothing leaked) and generation refused."""

from __future__ import annotations

import base64
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.pooling_checkpoints import sentence_transformers
from tests.server.helpers import Server, assert_openai_error, running
from tokenmill import LLM, PoolingParams

NAME = "embedder"
TEXTS = ["Hello world!", "To be, or not to be, that is the question.", "café 日本語 🙂", "a"]
FLAGS = ("--max-model-len", "64", "--max-pooling-inputs", "8", "--served-model-name", NAME)
TOL = 1e-5  # the same engine, alone or batched with others


@pytest.fixture(scope="module")
def folder(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = make_checkpoint("qwen3", initializer_range=0.1)
    return sentence_transformers(source, tmp_path_factory.mktemp("embedder") / "qwen3", "last")


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(folder, tmp_path_factory.mktemp("server"), *FLAGS) as s:
        s.model = NAME
        yield s


@pytest.fixture(scope="module")
def offline(folder: Path) -> LLM:
    return LLM(str(folder), dtype="float32", max_model_len=64)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < TOL


def test_the_openai_sdk_gets_the_engines_vectors_and_usage(client: openai.OpenAI, offline: LLM) -> None:
    """The SDK asks for base64 unless told otherwise and decodes it; `float` is plain JSON."""
    expected = offline.embed(TEXTS)
    for fmt in (openai.NOT_GIVEN, "float"):
        resp = client.embeddings.create(model=NAME, input=TEXTS, encoding_format=fmt)  # type: ignore[arg-type]
        assert resp.object == "list" and resp.model == NAME
        assert [d.index for d in resp.data] == list(range(len(TEXTS)))
        assert all(d.object == "embedding" for d in resp.data)
        assert all(_close(d.embedding, e.outputs.embedding) for d, e in zip(resp.data, expected, strict=True))
        tokens = sum(len(e.prompt_token_ids) for e in expected)
        assert (resp.usage.prompt_tokens, resp.usage.total_tokens) == (tokens, tokens)


def test_base64_is_little_endian_float32(http: httpx.Client, offline: LLM) -> None:
    r = http.post("/v1/embeddings", json={"model": NAME, "input": TEXTS[1], "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    vector = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert _close(vector, offline.embed(TEXTS[1])[0].outputs.embedding)


def test_token_id_inputs_and_dimensions(client: openai.OpenAI, offline: LLM) -> None:
    ids = [offline.tokenizer.encode(t) for t in TEXTS[:2]]
    one = client.embeddings.create(model=NAME, input=ids[0], encoding_format="float")
    many = client.embeddings.create(model=NAME, input=ids, encoding_format="float")
    expected = offline.embed(TEXTS[:2])
    assert _close(one.data[0].embedding, expected[0].outputs.embedding)
    assert all(_close(d.embedding, e.outputs.embedding) for d, e in zip(many.data, expected, strict=True))
    cut = client.embeddings.create(model=NAME, input=TEXTS[0], dimensions=16, encoding_format="float")
    assert _close(cut.data[0].embedding, offline.embed(TEXTS[0], PoolingParams(dimensions=16))[0].outputs.embedding)
    assert abs(sum(x * x for x in cut.data[0].embedding) - 1) < 1e-5


def test_langchain_openai_embeddings(server: Server, offline: LLM) -> None:
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: send the texts, not tiktoken's ids for OpenAI's own models (as vLLM says)
    emb = OpenAIEmbeddings(model=NAME, base_url=f"{server.url}/v1", api_key="x", check_embedding_ctx_length=False)
    docs = emb.embed_documents(TEXTS)
    query = emb.embed_query(TEXTS[0])
    expected = offline.embed(TEXTS)
    assert all(_close(d, e.outputs.embedding) for d, e in zip(docs, expected, strict=True))
    assert _close(query, expected[0].outputs.embedding)


def test_rerank_and_score_on_an_embedding_model_are_cosines(http: httpx.Client, offline: LLM) -> None:
    query, docs = TEXTS[0], TEXTS[1:]
    vectors = [e.outputs.embedding for e in offline.embed([query, *docs])]
    cosines = [sum(a * b for a, b in zip(vectors[0], v, strict=True)) for v in vectors[1:]]
    r = http.post("/v1/rerank", json={"model": NAME, "query": query, "documents": docs})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(len(docs)), key=lambda i: -cosines[i])
    assert all(abs(x["relevance_score"] - cosines[x["index"]]) < TOL for x in results)
    s = http.post("/v1/score", json={"model": NAME, "text_1": query, "text_2": docs}).json()
    assert [abs(d["score"] - c) < TOL for d, c in zip(s["data"], cosines, strict=True)] == [True] * len(docs)


BAD: list[tuple[dict[str, Any], str]] = [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": ["x"] * 9}, "--max-pooling-inputs"),
    ({"input": "word " * 80}, "maximum context length is 64"),
    ({"input": [10**6]}, "out of range"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 65}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": 5}, "input"),
    ({"input": "x", "truncate": True}, "truncate"),
    ({"input": "x", "model": "other"}, "other"),
]


@pytest.mark.parametrize(("body", "named"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_a_4xx_in_openais_shape(http: httpx.Client, body: dict[str, Any], named: str) -> None:
    r = http.post("/v1/embeddings", json={"model": NAME, **body})
    assert_openai_error(r, 404 if named == "other" else 400, named)


def test_generation_is_refused_with_how_to_serve_it(http: httpx.Client) -> None:
    chat = http.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "Hi"}]})
    assert_openai_error(chat, 400, "--task generate")
    assert_openai_error(http.post("/v1/completions", json={"model": NAME, "prompt": "Hi"}), 400, "--task generate")
    msg = http.post("/v1/messages", json={"model": NAME, "max_tokens": 8,
                                          "messages": [{"role": "user", "content": "Hi"}]})  # fmt: skip
    assert msg.status_code == 400 and msg.json()["type"] == "error" and "--task generate" in msg.text
    assert_openai_error(http.post("/v1/responses", json={"model": NAME, "input": "Hi"}), 400, "--task generate")


def test_nothing_leaked_and_the_server_is_healthy(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    stats = http.get("/stats").json()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0
    assert stats["completed_requests"] > 0 and stats["failed_requests"] == 0
    metrics = http.get("/metrics").text  # each embedded input is a finished request, and its tokens prompt tokens
    assert re.search(r'tokenmill:request_success_total\{[^}]*finished_reason="stop"[^}]*\} [1-9]', metrics)
    assert re.search(r"tokenmill:prompt_tokens_total\{[^}]*\} [1-9]", metrics)


def test_the_embed_benchmark_workload_runs_against_the_server(server: Server, tmp_path: Path) -> None:
    """`tokenmill bench serve --workload embed` (bench/embed.py): every request's texts come back embedded, and the
    summary counts them and their prompt tokens from `usage`."""
    import argparse
    import json

    from tokenmill.bench.serve_args import add_serve_parser
    from tokenmill.bench.serve_run import run_serve

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--url", server.url, "--model", NAME, "--workload", "embed", "--num-prompts",
                              "6", "--embed-batch", "3", "--input-len", "12", "--max-concurrency", "4",
                              "--output-dir", str(tmp_path)])  # fmt: skip
    run = run_serve(args)
    summary = json.loads((run / "summary" / "summary.json").read_text())
    rows = json.loads((run / "raw" / "trials.json").read_text())
    assert summary["requests_completed"] == 6 and summary["requests_errors"] == 0
    assert summary["input_throughput"] == pytest.approx(18 / summary["duration_s"])
    assert all(r["ok"] and r["prompt_tokens"] >= 3 * 10 for r in rows)  # ~12 tokens a text, three texts a request
