"""Reasoning over HTTP, with the `openai` and `anthropic` clients against a real server: a tiny Llama trained here
(a few seconds) to think in `<think>...</think>` before it answers, behind a Qwen3-like template (which writes an
earlier assistant turn's `reasoning_content` back as its thinking). The reasoning parser is picked from the
template (`--reasoning-parser auto`). Chat completions, Anthropic's messages and OpenAI's Responses API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.server.helpers import REASONER_ANSWER as ANSWER
from tests.server.helpers import REASONER_ASK as ASK
from tests.server.helpers import REASONER_THOUGHT as THOUGHT
from tests.server.helpers import Server, running, train_reasoner


@pytest.fixture(scope="module")
def reasoner(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[Server]:
    out = train_reasoner(tokenizer_dir, tmp_path_factory.mktemp("reasoner"))
    with running(out, tmp_path_factory.mktemp("reasoner-log")) as s:
        yield s


@pytest.fixture(scope="module")
def client(reasoner: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{reasoner.url}/v1", api_key="x", timeout=120, max_retries=0)


def _chat(client: openai.OpenAI, server: Server, max_tokens: int = 60, **kw: Any) -> Any:
    return client.chat.completions.create(model=server.model, messages=ASK, max_tokens=max_tokens, temperature=0,
                                          **kw)  # fmt: skip


def test_reasoning_content_is_kept_apart_from_the_answer_whole_and_streamed(
    client: openai.OpenAI, reasoner: Server
) -> None:
    msg = _chat(client, reasoner).choices[0].message
    assert msg.reasoning_content == THOUGHT and msg.content == ANSWER  # type: ignore[attr-defined]
    reasoning, content, roles = "", "", 0
    for chunk in _chat(client, reasoner, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        roles += delta.role is not None
        assert "<think>" not in (delta.content or "") + (getattr(delta, "reasoning_content", None) or "")
    assert (reasoning, content, roles) == (THOUGHT, ANSWER, 1)


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI, reasoner: Server) -> None:
    plain = _chat(client, reasoner, max_tokens=1)
    off = _chat(client, reasoner, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    block = httpx.post(f"{reasoner.url}/tokenize", json={"prompt": "<think>\n\n</think>\n\n",
                                                        "add_special_tokens": False}).json()["count"]  # fmt: skip
    assert off.usage.prompt_tokens == plain.usage.prompt_tokens + block  # the empty thinking is in the prompt
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        _chat(client, reasoner, extra_body={"chat_template_kwargs": {"tools": []}})


@pytest.mark.parametrize("budget", [0, 3])
def test_a_thinking_budget_forces_the_end_of_thinking_after_n_tokens(
    client: openai.OpenAI, reasoner: Server, budget: int
) -> None:
    free = _chat(client, reasoner, logprobs=True)
    tokens = [t.token for t in free.choices[0].logprobs.content]
    assert tokens[0] == "<think>" and tokens.index("</think>") > budget + 1  # unbudgeted, it thinks longer
    thought = tokens.index("</think>") - 1  # the markers not counted, as the Responses API counts them
    assert free.usage.completion_tokens_details.reasoning_tokens == thought
    r = _chat(client, reasoner, logprobs=True, extra_body={"thinking_token_budget": budget})
    tokens = [t.token for t in r.choices[0].logprobs.content]
    assert tokens[0] == "<think>" and tokens[budget + 1] == "</think>"
    assert r.usage.completion_tokens_details.reasoning_tokens == budget
    answer = "".join(t for t in tokens[budget + 2 :] if t != "<|im_end|>")  # the EOS token is not text
    assert r.choices[0].message.content == answer  # a later <think> is answer too
    assert r.choices[0].message.reasoning_content == "".join(tokens[1 : budget + 1])  # type: ignore[attr-defined]
    chunks = list(_chat(client, reasoner, stream=True, extra_body={"thinking_token_budget": budget},
                        stream_options={"include_usage": True}))  # fmt: skip
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert streamed == "".join(tokens[1 : budget + 1])
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == budget  # the final usage chunk


def test_messages_return_thinking_blocks_and_stream_thinking_deltas(reasoner: Server) -> None:
    client = anthropic.Anthropic(base_url=reasoner.url, api_key="x", timeout=120, max_retries=0)
    kw: dict[str, Any] = dict(model=reasoner.model, max_tokens=60, messages=ASK, extra_body={"temperature": 0})
    m = client.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"] and m.stop_reason == "end_turn"
    assert m.content[0].thinking == THOUGHT and m.content[1].text == ANSWER  # type: ignore[union-attr]
    with client.messages.stream(**kw) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in kinds and "text_delta" in kinds
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]
    budgeted = client.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 2})
    assert budgeted.content[0].type == "thinking" and len(budgeted.content[0].thinking) < len(THOUGHT)
    turn = [{"type": "thinking", "thinking": THOUGHT, "signature": ""}, {"type": "text", "text": ANSWER}]
    history: Any = [*ASK, {"role": "assistant", "content": turn}, {"role": "user", "content": "And now?"}]
    assert client.messages.create(**{**kw, "messages": history}).content


def _respond(client: openai.OpenAI, server: Server, max_output_tokens: int = 60, **kw: Any) -> Any:
    kw = {"input": ASK, "temperature": 0, **kw}
    return client.responses.create(model=server.model, max_output_tokens=max_output_tokens, **kw)


def test_responses_return_a_reasoning_item_before_the_message_whole_and_streamed(
    client: openai.OpenAI, reasoner: Server
) -> None:
    r = _respond(client, reasoner)
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.status == "completed"
    thought = r.output[0]
    assert thought.id.startswith("rs_") and thought.summary == [] and thought.status == "completed"
    assert [(c.type, c.text) for c in thought.content or []] == [("reasoning_text", THOUGHT)]
    assert r.output_text == ANSWER
    chat = _chat(client, reasoner, logprobs=True)
    tokens = [t.token for t in chat.choices[0].logprobs.content]
    assert tokens[0] == "<think>" and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == tokens.index("</think>") - 1  # the markers not counted
    with client.responses.stream(model=reasoner.model, input=ASK, max_output_tokens=60, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    thinking, answering = kinds.count("response.reasoning_text.delta"), kinds.count("response.output_text.delta")
    item = ["response.output_item.added", "response.content_part.added"]
    done = ["response.content_part.done", "response.output_item.done"]
    assert thinking > 1 and answering > 1 and kinds == [
        "response.created", "response.in_progress",
        *item, *["response.reasoning_text.delta"] * thinking, "response.reasoning_text.done", *done,
        *item, *["response.output_text.delta"] * answering, "response.output_text.done", *done,
        "response.completed",
    ]  # fmt: skip
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT  # type: ignore[union-attr]
    assert final.output[0].model_dump(exclude={"id"}) == thought.model_dump(exclude={"id"})
    assert (final.output_text, final.output[1].status, final.usage) == (ANSWER, "completed", r.usage)


def test_a_thinking_budget_and_reasoning_effort_reach_a_response(client: openai.OpenAI, reasoner: Server) -> None:
    budgeted = _respond(client, reasoner, extra_body={"thinking_token_budget": 2})
    assert budgeted.output[0].type == "reasoning" and budgeted.usage.output_tokens_details.reasoning_tokens == 2
    assert len(budgeted.output[0].content[0].text) < len(THOUGHT)  # type: ignore[index]
    plain = _respond(client, reasoner, 1)
    off = _respond(client, reasoner, 1, reasoning={"effort": "none"})
    block = httpx.post(f"{reasoner.url}/tokenize", json={"prompt": "<think>\n\n</think>\n\n",
                                                        "add_special_tokens": False}).json()["count"]  # fmt: skip
    assert off.usage.input_tokens == plain.usage.input_tokens + block  # Qwen3's template: thinking off
    assert off.reasoning and off.reasoning.effort == "none"
    high = _respond(client, reasoner, 1, reasoning={"effort": "high"})
    assert high.usage.input_tokens == plain.usage.input_tokens


def test_reasoning_items_given_back_reach_the_template_as_thinking_blocks_do(
    client: openai.OpenAI, reasoner: Server
) -> None:
    r = _respond(client, reasoner)
    then: Any = {"role": "user", "content": "And now?"}
    by_hand = _respond(client, reasoner, 1, input=[*ASK, *r.output, then], store=False)
    continued = _respond(client, reasoner, 1, input=[then], previous_response_id=r.id)
    claude = anthropic.Anthropic(base_url=reasoner.url, api_key="x", timeout=120, max_retries=0)
    turn: Any = [{"type": "thinking", "thinking": THOUGHT, "signature": ""}, {"type": "text", "text": ANSWER}]
    count = lambda content: claude.messages.count_tokens(  # noqa: E731
        model=reasoner.model, messages=[*ASK, {"role": "assistant", "content": content}, then]).input_tokens  # type: ignore[list-item]  # fmt: skip
    assert by_hand.usage.input_tokens == continued.usage.input_tokens == count(turn) > count(ANSWER)


def test_a_budget_or_thinking_without_a_parser_is_a_400(server: Server) -> None:
    """The module server's model has a template without <think>: no reasoning parser."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=120, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="reasoning parser"):
        client.chat.completions.create(model=server.model, messages=ASK, max_tokens=4,
                                       extra_body={"thinking_token_budget": 4})  # fmt: skip
    plain = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=4)
    assert getattr(plain.choices[0].message, "reasoning_content", None) is None
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", timeout=120, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="reasoning parser"):
        claude.messages.create(model=server.model, max_tokens=4, messages=ASK,  # type: ignore[arg-type]
                               thinking={"type": "enabled", "budget_tokens": 2})  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="reasoning parser"):
        _respond(client, server, 4, extra_body={"thinking_token_budget": 4})
    off = _respond(client, server, 4, reasoning={"effort": "minimal"})  # nothing to turn off: accepted
    assert [o.type for o in off.output] == ["message"] and off.usage.output_tokens_details.reasoning_tokens == 0
