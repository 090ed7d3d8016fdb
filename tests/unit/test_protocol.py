"""Request bodies: what a chat message carries into the chat template, and how bad fields are named."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tests.conftest import load_twice
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.anthropic_protocol import MessagesRequest
from tokenmill.server.errors import bad_value
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.responses_protocol import ResponsesRequest, template_messages

NAMED_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}{{ ' (' + m['name'] + ')' if m['name'] is defined else '' }}"
    "\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def test_message_name_reaches_the_chat_template(tokenizer_dir: Path, tmp_path: Path) -> None:
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "bob"},
                      {"role": "assistant", "content": "Hello"}]}
    )  # fmt: skip
    messages = [m.as_template_dict() for m in body.messages]
    assert messages == [{"role": "user", "content": "Hi", "name": "bob"}, {"role": "assistant", "content": "Hello"}]
    folder = shutil.copytree(tokenizer_dir, tmp_path / "tok")
    (folder / "chat_template.jinja").write_text(NAMED_TEMPLATE)
    for tok in load_twice(folder, tmp_path / "cache"):
        text = tok.decode(tok.apply_chat_template(messages, add_generation_prompt=False), skip_special_tokens=False)
        assert text == "<|im_start|>user (bob)\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"


def test_text_parts_join_by_newlines_and_take_cache_control() -> None:
    """Several text parts are one text joined by newlines, as vLLM joins them (no words fused); `cache_control` on a
    part (Anthropic's, which agent frameworks send here too) is accepted and changes nothing."""
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Context."},
                                                   {"type": "text", "text": "Question?",
                                                    "cache_control": {"type": "ephemeral"}}]}]}
    )  # fmt: skip
    assert body.messages[0].as_template_dict()["content"] == "Context.\nQuestion?"


@pytest.mark.parametrize(
    ("part", "says"),
    [({"type": "text"}, "Field required"), ({"type": "text", "text": 5}, "valid string"),
     ({"type": "text", "text": "hi", "colour": "red"}, "colour"),
     ({"type": "image_url", "image_url": {}}, "'image_url'")],
)  # fmt: skip
def test_a_bad_content_part_is_named_for_what_is_wrong(part: dict[str, Any], says: str) -> None:
    """A malformed text part's error names its field (it said "parts of type 'text' are not supported"); a part of
    another type is refused by its type."""
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [part]}]})
    text = str(err.value)
    assert says in text and ("not supported" in text) == (part["type"] != "text"), text


@pytest.mark.parametrize("key", ["²", "٣", "-1", "1.5", " 7"])
def test_logit_bias_keys_are_ascii_token_ids(key: str) -> None:
    """Keys are token ids in ASCII digits: a superscript or an Arabic-Indic digit is no id (str.isdigit says it is)."""
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "logit_bias": {key: 5}})  # fmt: skip
    with pytest.raises(ValueError, match=r"^logit_bias=.*keys are token ids"):
        body.sampling_params(SamplingParams(), 4, None, None, None)


def test_validation_errors_name_what_their_start_does_not() -> None:
    """A logit_bias id past the vocabulary names the parameter; a prompt past the context carries OpenAI's code
    `context_length_exceeded`, which clients look for."""
    bias = bad_value(ValueError("logit_bias names token id 99999, out of range: allowed [0, 383]"))
    assert (bias.status, bias.param, bias.code) == (400, "logit_bias", None)
    long = bad_value(ValueError("This model's maximum context length is 512 tokens. However, you requested 600"))
    assert (long.param, long.code) == (None, "context_length_exceeded")
    assert bad_value(ValueError("seed=1.5 is invalid: allowed an integer")).param == "seed"


def test_a_chat_template_that_does_not_parse_is_found_at_load(tokenizer_dir: Path, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """A template that is not valid Jinja loads with one warning naming it (plain prompts still run), and a chat is
    refused as the model's fault, not the messages'; before, /health said ready and every chat request got a 400
    blaming `messages`."""
    folder = shutil.copytree(tokenizer_dir, tmp_path / "tok")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    for tok in load_twice(folder, tmp_path / "cache"):
        assert tok.template_problem is not None and "does not parse (line 1" in tok.template_problem
        with pytest.raises(ValueError, match=r"^this model's chat template does not parse .*: fix its chat template"):
            tok.apply_chat_template([{"role": "user", "content": "Hi"}])
        assert tok.encode("Hi") and "does not parse" in caplog.text


def test_responses_and_messages_join_text_parts_by_newlines_as_chat_does() -> None:
    """A Responses input message's text parts, a function_call_output's, an Anthropic user turn's text blocks and a
    tool_result's are one text joined by newlines, as the chat completions' parts (they were joined with nothing,
    fusing the last word of one part with the first of the next)."""
    parts = [{"type": "input_text", "text": "Context."}, {"type": "input_text", "text": "Question?"}]
    responses = ResponsesRequest.model_validate({"model": "m", "input": [
        {"role": "user", "content": parts},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": parts},
    ]})  # fmt: skip
    said = template_messages(None, responses.input_items())
    assert [m["content"] for m in said if m["role"] in ("user", "tool")] == ["Context.\nQuestion?"] * 2
    blocks = [{"type": "text", "text": "Context."}, {"type": "text", "text": "Question?"}]
    messages = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": blocks},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, {"type": "text", "text": "Now."},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": blocks}, *blocks]},
    ]})  # fmt: skip
    turns = [(m["role"], m["content"]) for m in messages.template_messages()]
    assert turns == [("user", "Context.\nQuestion?"), ("assistant", "Let me look.\nNow."),
                     ("tool", "Context.\nQuestion?"), ("user", "Context.\nQuestion?")]  # fmt: skip
