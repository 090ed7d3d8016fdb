"""`POST /v1/rerank` (Cohere/Jina's shape, also at /rerank and /v2/rerank) and `POST /v1/score` (vLLM's) through a
real `tokenmill serve --task rerank` of a causal Qwen3 read as a Qwen3-Reranker (P(yes) under its prompt); the scores
equal the offline engine's, which tests/parity/test_pooling_models.py holds to transformers. Bad input is a 400 in
OpenAI's shape, and an embeddings request says how to serve one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import TINY
from tests.pooling_checkpoints import yes_no_tokenizer
from tests.server.helpers import Server, assert_openai_error, running
from tokenmill import LLM

NAME = "reranker"
QUERY = "What is the question?"
DOCS = ["To be, or not to be, that is the question.", "Hello world!", "The quick brown fox jumps over the lazy dog."]
TOL = 1e-5


@pytest.fixture(scope="module")
def folder(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenmill.make_model import hf_config, write_checkpoint

    tmp = tmp_path_factory.mktemp("reranker")
    tok = yes_no_tokenizer(tokenizer_dir, tmp / "tok")
    return write_checkpoint(hf_config("qwen3", **{**TINY, "vocab_size": 400, "initializer_range": 0.1}), tok,
                            tmp / "qwen3")  # fmt: skip


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = ("--task", "rerank", "--max-pooling-inputs", "4", "--served-model-name", NAME)
    with running(folder, tmp_path_factory.mktemp("server"), *flags) as s:
        yield s


@pytest.fixture(scope="module")
def scores(folder: Path) -> list[float]:
    """The offline engine's score of each document against the query."""
    return [o.outputs.score for o in LLM(str(folder), dtype="float32", task="score").score(QUERY, DOCS)]


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_sorts_the_documents_by_the_models_scores(http: httpx.Client, scores: list[float], path: str) -> None:
    r = http.post(path, json={"model": NAME, "query": QUERY, "documents": [DOCS[0], {"text": DOCS[1]}, DOCS[2]]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == NAME and body["id"]
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] > 0
    results = body["results"]
    assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -scores[i])
    for x in results:
        assert abs(x["relevance_score"] - scores[x["index"]]) < TOL
        assert x["document"] == {"text": DOCS[x["index"]]}


def test_top_n_and_return_documents(http: httpx.Client, scores: list[float]) -> None:
    body = {"model": NAME, "query": QUERY, "documents": DOCS, "top_n": 1, "return_documents": False}
    results = http.post("/v1/rerank", json=body).json()["results"]
    assert len(results) == 1 and set(results[0]) == {"index", "relevance_score"}
    assert results[0]["index"] == max(range(3), key=lambda i: scores[i])
    assert abs(results[0]["relevance_score"] - max(scores)) < TOL
    every = http.post("/v1/rerank", json={**body, "top_n": 0}).json()["results"]  # 0: every document, as vLLM
    assert sorted(r["index"] for r in every) == [0, 1, 2]


def test_score_pairs_one_with_many_and_many_with_many(http: httpx.Client, scores: list[float]) -> None:
    for path in ("/v1/score", "/score"):
        one = http.post(path, json={"model": NAME, "text_1": QUERY, "text_2": DOCS})
        assert one.status_code == 200, one.text
        body = one.json()
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2]
        assert all(d["object"] == "score" and abs(d["score"] - s) < TOL for d, s in zip(body["data"], scores))
    many = http.post("/v1/score", json={"model": NAME, "text_1": [QUERY] * 3, "text_2": DOCS}).json()
    assert all(abs(d["score"] - s) < TOL for d, s in zip(many["data"], scores, strict=True))
    single = http.post("/v1/score", json={"model": NAME, "text_1": QUERY, "text_2": DOCS[1]}).json()
    assert len(single["data"]) == 1 and abs(single["data"][0]["score"] - scores[1]) < TOL


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS * 2}, "--max-pooling-inputs"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": QUERY, "documents": [{"txt": "x"}]}, "documents"),
    ("/v1/rerank", {"documents": DOCS}, "query"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "rank_fields": ["a"]}, "rank_fields"),
    ("/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": DOCS}, "text_1"),
    ("/v1/score", {"text_1": QUERY, "text_2": "word " * 600}, "maximum context length"),
    ("/v1/embeddings", {"input": "Hello"}, "--task embed"),
]


@pytest.mark.parametrize(("path", "body", "named"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_a_400_in_openais_shape(http: httpx.Client, path: str, body: dict[str, Any], named: str) -> None:
    assert_openai_error(http.post(path, json={"model": NAME, **body}), 400, named)


def test_nothing_leaked(http: httpx.Client) -> None:
    stats = http.get("/stats").json()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0
