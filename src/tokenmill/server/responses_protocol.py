"""Request bodies of OpenAI's Responses API (`POST /v1/responses`), as pydantic models with the house rules of
protocol.py (unknown fields are a 400 naming them, strict types, valid Unicode), and their translation into what
the rest of the server speaks: conversation items, chat-template messages, tools as the template takes them, the
structured-output constraint of `text.format`, and the sampling fields chat completions use.

Input items are `message` (the `type` may be left out, as the SDK's easy messages do; content a string or
`input_text` / `output_text` parts), `function_call`, `function_call_output` and `reasoning` (as a reasoning model's
responses return them, and agents send them back). Every item is normalized into one plain dict shape with an id
(`normalize`): that is what the store keeps and `input_items` lists, and what `template_messages` renders, whether
it came in this request or from a `previous_response_id`.

Any other item, content part or tool type is refused by name, and so is a reasoning item whose thinking is
encrypted (another service's: nothing here can read it). Whether a reasoning item may be given at all depends on
the server (a reasoning parser): responses_routes.py checks that.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server.protocol import Int64, Text, _SamplingFields, _Strict, type_tag, unique_tool_names

Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]  # the SDK's ReasoningEffort
THINKING_OFF = ("none", "minimal")  # efforts that turn the thinking off where the template can (enable_thinking)


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class _Unsupported(BaseModel):
    """A type tokenmill cannot take: accepted by the schema only to say what is wrong with it."""

    model_config = ConfigDict(extra="allow")
    type: str | None = None


class UnsupportedPart(_Unsupported):
    @model_validator(mode="after")
    def _refuse(self) -> UnsupportedPart:
        if self.type in ("input_image", "input_file", "input_audio"):
            raise ValueError(f"content parts of type {self.type!r} are not supported: this model takes text only")
        raise ValueError(f"unknown content part type {self.type!r}: allowed input_text and output_text")


class UnsupportedItem(_Unsupported):
    @model_validator(mode="after")
    def _refuse(self) -> UnsupportedItem:
        raise ValueError(f"unknown input item type {self.type!r}: allowed message, function_call, "
                         "function_call_output and reasoning")  # fmt: skip


class UnsupportedTool(_Unsupported):
    @model_validator(mode="after")
    def _refuse(self) -> UnsupportedTool:
        raise ValueError(f"tools of type {self.type!r} are not supported: tokenmill serves function tools only, "
                         "which your code runs")  # fmt: skip


class TextPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: Text
    # an output_text part sent back as the API (and the SDK's `responses.parse`) returned it: ignored
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    parsed: Any = None


def _part_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "text" if kind in ("input_text", "output_text") else "other"


Part = Annotated[Annotated[TextPart, Tag("text")] | Annotated[UnsupportedPart, Tag("other")], Discriminator(_part_tag)]
Status = Literal["in_progress", "completed", "incomplete"] | None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[Part]
    id: Text | None = None
    status: Status = None
    phase: Text | None = None  # on assistant messages the API returned

    def normalize(self) -> dict[str, Any]:
        kind = "output_text" if self.role == "assistant" else "input_text"
        parts = [{"type": kind, "text": self.content}] if isinstance(self.content, str) else [
            {"type": p.type, "text": p.text} for p in self.content]  # type: ignore[union-attr]  # fmt: skip
        return {"id": self.id or new_id("msg_"), "type": "message", "role": self.role, "content": parts,
                "status": self.status or "completed"}  # fmt: skip


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text
    id: Text | None = None
    status: Status = None
    parsed_arguments: Any = None  # the SDK's `responses.parse` adds it to the items it returns: ignored

    def normalize(self) -> dict[str, Any]:
        return {"id": self.id or new_id("fc_"), "type": "function_call", "call_id": self.call_id, "name": self.name,
                "arguments": self.arguments, "status": self.status or "completed"}  # fmt: skip


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[Part]
    id: Text | None = None
    status: Status = None

    def normalize(self) -> dict[str, Any]:
        output = self.output if isinstance(self.output, str) else [
            {"type": p.type, "text": p.text} for p in self.output]  # type: ignore[union-attr]  # fmt: skip
        return {"id": self.id or new_id("fco_"), "type": "function_call_output", "call_id": self.call_id,
                "output": output, "status": self.status or "completed"}  # fmt: skip


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: Text


class SummaryText(_Strict):
    type: Literal["summary_text"]
    text: Text


class ReasoningItem(_Strict):
    """A reasoning model's thinking, as a response returned it. Its `content` goes to the template as the next
    assistant turn's `reasoning_content`; its `summary` is not read (tokenmill writes none)."""

    type: Literal["reasoning"]
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: Text | None = None
    id: Text | None = None
    status: Status = None

    @model_validator(mode="after")
    def _readable(self) -> ReasoningItem:
        if self.encrypted_content:
            raise ValueError("reasoning items with encrypted_content cannot be read here: it is another service's "
                             "encrypted thinking; send the item's reasoning_text content, or leave it out")  # fmt: skip
        return self

    def normalize(self) -> dict[str, Any]:
        return {"id": self.id or new_id("rs_"), "type": "reasoning", "summary": [p.model_dump() for p in self.summary],
                "content": [p.model_dump() for p in self.content or []],
                "status": self.status or "completed"}  # fmt: skip


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[UnsupportedItem, Tag("other")],
    Discriminator(type_tag(("message", "function_call", "function_call_output", "reasoning"), default="message")),
]  # fmt: skip


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


ToolDef = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[UnsupportedTool, Tag("other")],
    Discriminator(type_tag(("function",))),
]


class NamedFunction(_Strict):
    type: Literal["function"]
    name: Text


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: Text | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ValueError("a format of type json_schema needs a name and a schema")
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None


class ReasoningConfig(_Strict):
    effort: Effort | None = None
    summary: Text | None = None  # accepted: tokenmill writes no summaries (a reasoning item's summary is empty)
    generate_summary: Text | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None  # accepted: tokenmill sends no obfuscation padding


ALLOWED_INCLUDES = ("reasoning.encrypted_content",)  # asked by agents on any model; there is none to include


class ResponsesRequest(_Strict):
    model: Text | None = None
    input: Text | list[InputItem]
    instructions: Text | None = None
    previous_response_id: Text | None = None
    store: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    background: bool = False
    max_output_tokens: Int64 | None = None
    thinking_token_budget: Int64 | None = None  # vLLM's extension, as chat completions take it
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[Text] | None = None
    truncation: Literal["disabled"] | None = None
    metadata: dict[str, Text] | None = None
    user: Text | None = None
    safety_identifier: Text | None = None  # accepted, nothing to do with it
    prompt_cache_key: Text | None = None  # accepted: prefix caching keeps every prompt's blocks already

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        unique_tool_names([t.name for t in self.tools or [] if isinstance(t, FunctionTool)])
        if self.background and not self.store:
            raise ValueError("background=true needs store=true: a background response is read back from the store")
        bad = next((i for i in self.include or [] if i not in ALLOWED_INCLUDES), None)
        if bad is not None:
            raise ValueError(f"include {bad!r} is not supported: allowed {', '.join(ALLOWED_INCLUDES)}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens={self.max_output_tokens} is invalid: allowed an integer >= 1")
        return self

    def input_items(self) -> list[dict[str, Any]]:
        """This request's input as normalized items, each with an id."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input).normalize()]
        return [item.normalize() for item in self.input]  # type: ignore[union-attr]

    @property
    def effort(self) -> str | None:
        return self.reasoning.effort if self.reasoning is not None else None

    def template_kwargs(self) -> dict[str, Any]:
        """What `reasoning.effort` tells the chat template: `enable_thinking` (Qwen3's: false for none and minimal)
        and `reasoning_effort` (gpt-oss's: low, medium or high). Templates ignore what they do not read."""
        effort = self.effort
        if effort is None:
            return {}
        level = "low" if effort in THINKING_OFF else "high" if effort in ("xhigh", "max") else effort
        return {"enable_thinking": effort not in THINKING_OFF, "reasoning_effort": level}

    def template_tools(self) -> list[dict[str, Any]]:
        """The function tools as chat templates (and tools.py) take them: chat completions' nested shape."""
        return [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type", "strict"})}
                for t in self.tools or [] if isinstance(t, FunctionTool)]  # fmt: skip

    def tool_choice_mode(self) -> tuple[str | None, str | None]:
        """(tools.plan's choice, the named function) for `tool_choice`."""
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            return "named", choice.name
        return choice, None

    def structured(self) -> StructuredOutputsParams | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(json=fmt.schema_)

    def sampling_fields(self) -> _SamplingFields:
        """The same sampling fields a chat completion has, so both build their SamplingParams one way."""
        return _SamplingFields(max_tokens=self.max_output_tokens, temperature=self.temperature, top_p=self.top_p)


def template_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation (normalized items, oldest first) as the chat template sees it: `instructions` as the system
    message, a `developer` message as a system one, consecutive `function_call` items as one assistant message's
    `tool_calls` (after its text, if the model wrote some), each `function_call_output` as a `tool` message, and
    `reasoning` items as the next assistant message's `reasoning_content` (as the Messages API passes thinking
    blocks; dropped when no assistant turn follows). Several text parts are one text joined by newlines, as the chat
    completions' parts are. ValueError for an output whose call_id no earlier function_call
    has."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    called: set[str] = set()
    thought = ""  # reasoning items not yet given to an assistant message
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            thought += "".join(p["text"] for p in item["content"])
            continue
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": "\n".join(p["text"] for p in item["content"])})
        elif kind == "function_call":
            called.add(item["call_id"])
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": _arguments(item["arguments"])}}  # fmt: skip
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            if item["call_id"] not in called:
                raise ValueError(f"function_call_output for call_id {item['call_id']!r}, which no earlier "
                                 "function_call item has (in this input or the previous response's)")  # fmt: skip
            output = item["output"]
            text = output if isinstance(output, str) else "\n".join(p["text"] for p in output)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        if thought and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"] = out[-1].get("reasoning_content", "") + thought
        thought = ""
    return out


def _arguments(text: str) -> Any:
    """Arguments go to the template as objects, as Hugging Face templates expect (text when not JSON)."""
    try:
        return json.loads(text)
    except ValueError:
        return text
