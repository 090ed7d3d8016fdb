"""Request bodies: what a chat message carries into the chat template."""

from __future__ import annotations

from pathlib import Path

from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.tokenizer import Tokenizer

NAMED_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}{{ ' (' + m['name'] + ')' if m['name'] is defined else '' }}"
    "\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def test_message_name_reaches_the_chat_template(tokenizer_dir: Path) -> None:
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "bob"},
                      {"role": "assistant", "content": "Hello"}]}
    )  # fmt: skip
    messages = [m.as_template_dict() for m in body.messages]
    assert messages == [{"role": "user", "content": "Hi", "name": "bob"}, {"role": "assistant", "content": "Hello"}]
    tok = Tokenizer(tokenizer_dir)
    tok.hf.chat_template = NAMED_TEMPLATE
    text = tok.decode(tok.apply_chat_template(messages, add_generation_prompt=False), skip_special_tokens=False)
    assert text == "<|im_start|>user (bob)\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
