"""Request bodies: what a chat message carries into the chat template."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.conftest import load_twice
from tokenmill.server.protocol import ChatCompletionRequest

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
