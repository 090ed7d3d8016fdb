"""Request bodies of Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), as pydantic models
with the house rules of protocol.py (unknown fields are a 400 naming them, strict types, valid Unicode), and
their translation into what the rest of the server speaks: chat-template messages, tools as the template takes
them, and the sampling fields that chat completions use.

Content blocks are `text`, `tool_use` and `thinking` (assistant turns; thinking goes to the template as the turn's
`reasoning_content`) and `tool_result` (user turns, its content a string or text blocks). Any other block type is
refused by name: images and documents because the models take text only, `redacted_thinking` because nothing
here can read it. `cache_control` is accepted wherever Anthropic takes it
and has nothing to do: prefix caching keeps every prompt's blocks already.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from tokenmill.server.protocol import Int64, Text, _SamplingFields, _Strict, type_tag, unique_tool_names

CacheControl = dict[str, Any] | None  # {"type": "ephemeral", "ttl"?}: accepted, see the module docstring


class TextBlock(_Strict):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]
    cache_control: CacheControl = None


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: Text
    signature: Text = ""  # tokenmill signs nothing: accepted as given
    cache_control: CacheControl = None


class UnsupportedBlock(BaseModel):
    """A block type tokenmill cannot take: accepted by the schema only to say what is wrong with it."""

    model_config = ConfigDict(extra="allow")
    type: str

    @model_validator(mode="after")
    def _refuse(self) -> UnsupportedBlock:
        if self.type in ("image", "document"):
            raise ValueError(f"content blocks of type {self.type!r} are not supported: this model takes text only")
        if self.type == "redacted_thinking":
            raise ValueError("content blocks of type 'redacted_thinking' are not supported: they are encrypted "
                             "for Anthropic's models; send thinking blocks")  # fmt: skip
        raise ValueError(f"unknown content block type {self.type!r}: allowed text, tool_use and tool_result")


ResultPart = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[UnsupportedBlock, Tag("other")], Discriminator(type_tag(("text",)))
]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[ResultPart] = ""
    is_error: bool = False  # accepted; chat templates have no field for it, so the model sees the content only
    cache_control: CacheControl = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)  # type: ignore[union-attr]


Block = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[UnsupportedBlock, Tag("other")],
    Discriminator(type_tag(("text", "tool_use", "tool_result", "thinking"))),
]  # fmt: skip


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: Text | list[Block]

    def template_dicts(self, at: int, called: set[str]) -> list[dict[str, Any]]:
        """This turn as chat-template messages: an assistant turn is one message (text, and its tool_use blocks
        as `tool_calls`); a user turn's tool_result blocks are `tool` messages, its text a user message. `called`
        holds the tool_use ids seen so far. ValueError for a block in the wrong turn or an unmatched result."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        blocks = self.content
        wrong = ("tool_result",) if self.role == "assistant" else ("tool_use", "thinking")
        bad = next((b.type for b in blocks if b.type in wrong), None)
        if bad is not None:
            raise ValueError(f"messages.{at}: a {self.role} message may not hold {bad} blocks")
        if self.role == "assistant":
            uses = [b for b in blocks if isinstance(b, ToolUseBlock)]
            called.update(b.id for b in uses)
            message: dict[str, Any] = {"role": "assistant", "content": _joined(blocks)}
            thought = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
            if thought:
                message["reasoning_content"] = thought
            if uses:
                message["tool_calls"] = [{"id": b.id, "type": "function", "function": {"name": b.name,
                                          "arguments": b.input}} for b in uses]  # fmt: skip
            return [message]
        out: list[dict[str, Any]] = []
        for b in blocks:
            if isinstance(b, ToolResultBlock):
                if b.tool_use_id not in called:
                    raise ValueError(f"messages.{at}: tool_result for tool_use_id {b.tool_use_id!r}, which no "
                                     "earlier assistant message's tool_use block has")  # fmt: skip
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
            elif out and out[-1]["role"] == "user":  # consecutive text blocks: one user message
                out[-1]["content"] += "\n" + _joined([b])
            else:
                out.append({"role": "user", "content": _joined([b])})
        return out


def _joined(blocks: list[Any]) -> str:
    """The text blocks' texts joined by newlines, as the chat completions' text parts (and vLLM's): no words fused."""
    return "\n".join(b.text for b in blocks if isinstance(b, TextBlock))


class ToolDef(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")]
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl = None

    @model_validator(mode="after")
    def _object_input(self) -> ToolDef:
        if self.input_schema.get("type") != "object":  # (a tool_use block's input is an object)
            raise ValueError(f'tool {self.name!r}: input_schema must be an object schema ("type": "object")')
        return self


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('give name with type "tool", and only then')
        return self


class ThinkingConfig(_Strict):
    """`enabled` (with `budget_tokens`: the thinking budget), `adaptive` (no budget) or `disabled` (the template
    gets `enable_thinking: false`, which Qwen3's honours)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Int64 | None = None

    @model_validator(mode="after")
    def _budget(self) -> ThinkingConfig:
        if self.type == "enabled" and (self.budget_tokens is None or self.budget_tokens < 1):
            raise ValueError('thinking of type "enabled" needs budget_tokens, an integer >= 1')
        return self

    def template_kwargs(self) -> dict[str, Any]:
        return {"enable_thinking": self.type != "disabled"}


class CountTokensRequest(_Strict):
    """What `/v1/messages/count_tokens` takes: the prompt side of a Messages request."""

    model: Text
    messages: list[Message] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: CacheControl = None

    @model_validator(mode="after")
    def _tools(self) -> CountTokensRequest:
        unique_tool_names([t.name for t in self.tools or []])
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as the chat template sees it (system first). ValueError when it cannot be one."""
        system = self.system if isinstance(self.system, str) else _joined(self.system or [])
        out = [{"role": "system", "content": system}] if system else []
        called: set[str] = set()
        for at, message in enumerate(self.messages):
            out += message.template_dicts(at, called)
        if self.messages[-1].role == "assistant":
            raise ValueError("the last message is the assistant's: continuing a prefilled assistant turn is not "
                             "supported; end with a user message")  # fmt: skip
        return out

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates (and tools.py) take them: OpenAI's function shape."""
        return [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                 **({"description": t.description} if t.description is not None else {})}}
                for t in self.tools or []]  # fmt: skip

    def tool_choice_mode(self) -> tuple[str | None, str | None]:
        """(tools.plan's choice, the named tool) for `tool_choice`."""
        tc = self.tool_choice
        if tc is None:
            return None, None
        return {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[tc.type], tc.name


class MessagesRequest(CountTokensRequest):
    max_tokens: Int64
    stop_sequences: list[Text] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # {"user_id"}: accepted, nothing to do with it

    def sampling_fields(self) -> _SamplingFields:
        """The same sampling fields a chat completion has, so both build their SamplingParams one way."""
        return _SamplingFields(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                               top_k=self.top_k, stop=self.stop_sequences)  # fmt: skip
