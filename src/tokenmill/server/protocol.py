"""Request bodies of the HTTP API, as pydantic v2 models. Unknown fields are rejected (400 naming the
field), never silently ignored. Types are strict (`true` is not an integer, `1.5` is not one either), floats
must be finite, integers fit in 64 bits, and text must be valid Unicode (no lone UTF-16 surrogates). A null
where a field takes none, or for a field tokenmill lacks, is that field left out: OpenAI's and Anthropic's SDKs
type such fields optional, and send null for a None they are passed.
Conversion to `SamplingParams` (which checks the ranges) lives here too."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cache
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from tokenmill.sampling_params import INT64, SamplingParams, StructuredOutputsParams


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        raise ValueError(f"text holds a lone UTF-16 surrogate (U+{ord(bad):04X}); send valid Unicode") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
Int64 = Annotated[int, Field(ge=INT64[0], le=INT64[1])]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        """Drops the nulls this model could not take (see the module's docstring); a field that takes null keeps it."""
        if not isinstance(data, dict) or None not in data.values():
            return data
        takes = _takes_null(cls)
        return {k: v for k, v in data.items() if v is not None or k in takes}


@cache
def _takes_null(model: type[BaseModel]) -> frozenset[str]:
    """The keys (names and aliases) of `model`'s fields whose type allows null."""
    return frozenset(key for name, f in model.model_fields.items() if _nullable(f.annotation)
                     for key in (name, f.alias) if key)  # fmt: skip


def _nullable(annotation: Any) -> bool:
    return annotation is Any or annotation is None or type(None) in get_args(annotation)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    name: Text = "response"
    description: Text | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extra parameter (one of these)."""

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


class _SamplingFields(_Strict):
    model: Text | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    n: Int64 = 1
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Int64 | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    priority: Int64 = 0
    # structured output: OpenAI's response_format, vLLM's structured_outputs, and its older guided_* names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_decoding_backend: Text | None = None  # accepted and ignored: there is one backend (llguidance)
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) -> bias in [-100, 100]
    prompt_logprobs: Int64 | None = None  # vLLM's: per prompt token, its logprob and the top k

    @model_validator(mode="after")
    def _stream_options(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:  # (as vLLM and OpenAI refuse it)
            raise ValueError("stream_options is allowed only with stream: true")
        return self

    def structured(self) -> tuple[str, StructuredOutputsParams] | None:
        """(the field it came from, the constraint) for the one structured-output field given, or None.
        Raises ValueError when several are given or the one given is malformed."""
        found: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ValueError("response_format of type json_schema needs a json_schema object")
            found.append(("response_format", StructuredOutputsParams(json=rf.json_schema.schema_)))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            found.append(("structured_outputs", StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                json_object=bool(so.json_object))))  # fmt: skip
        old = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
        for name, key in old.items():
            if getattr(self, name) is not None:
                found.append((name, StructuredOutputsParams(**{key: getattr(self, name)})))
        if len(found) > 1:
            raise ValueError(f"give one structured-output field, not {' and '.join(f for f, _ in found)}")
        return found[0] if found else None

    def sampling_params(
        self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:  # fmt: skip
        """Request fields over the model's generation_config defaults. Raises ValueError on bad values."""
        given: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        base = replace(defaults, **{k: v for k, v in given.items() if v is not None})
        return SamplingParams(
            n=self.n,
            temperature=base.temperature,
            top_p=base.top_p,
            top_k=base.top_k,
            min_p=base.min_p,
            repetition_penalty=base.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=structured_outputs,
            logit_bias=self._logit_bias(),
        )

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        bad = next((k for k in self.logit_bias if not (k.isascii() and k.isdigit())), None)  # ("²" and "٣": digits)
        if bad is not None:
            raise ValueError(f"logit_bias={self.logit_bias!r} is invalid: keys are token ids, and {bad!r} is not one")
        return {int(k): v for k, v in self.logit_bias.items()}


class CompletionRequest(_SamplingFields):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    logprobs: Int64 | None = None
    echo: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: Text
    cache_control: dict[str, Any] | None = None  # Anthropic's, which agent frameworks send here too: ignored


class OtherPart(BaseModel):
    """A content part that is not text (image_url, input_audio, file, ...): accepted by the schema so that the
    message can say what is wrong (`ChatMessage` refuses it)."""

    model_config = ConfigDict(extra="allow")
    type: str


def type_tag(known: tuple[str, ...], default: str | None = None) -> Any:
    """A union's discriminator by `type`: a known type's model reads the value (so a malformed one's error names its
    field), any other type the catch-all tagged "other" (whose own validator says what is not supported)."""

    def tag(value: Any) -> str:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
        return kind if kind in known else "other"

    return tag


ContentPart = Annotated[Annotated[TextPart, Tag("text")] | Annotated[OtherPart, Tag("other")],
                        Discriminator(type_tag(("text",)))]  # fmt: skip


class FunctionCall(_Strict):
    name: Text
    arguments: Text


class ToolCall(_Strict):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: Text | None = None  # a tool turn: which call this is the result of

    @model_validator(mode="after")
    def _text_only(self) -> ChatMessage:
        other = [p.type for p in self.content or [] if not isinstance(p, str | TextPart)]
        if other:
            raise ValueError(f"this model takes text only; content parts of type {other[0]!r} are not supported")
        return self

    def text(self) -> str:
        """The content; text parts joined by newlines, as vLLM joins them."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""

    def as_template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it; `name` is passed on, as vLLM does. Tool-call arguments go
        to the template as objects, as Hugging Face templates expect."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                "arguments": _arguments(c.function.arguments)}}
                for c in self.tool_calls
            ]  # fmt: skip
        return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDef(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


def unique_tool_names(names: list[str]) -> None:
    """ValueError for a name given to two tools: a call to it could not say which one it means."""
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise ValueError(f"tool names must be unique: {twice!r} is given twice")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the chat template
    thinking_token_budget: Int64 | None = None  # reasoning tokens before the end of thinking is forced

    @model_validator(mode="after")
    def _tools(self) -> ChatCompletionRequest:
        unique_tool_names([t.function.name for t in self.tools or []])
        return self


class GenerateRequest(_Strict):
    prompt: Text
    max_tokens: Int64 | None = 128
    temperature: float | None = None


class TokenizeRequest(_Strict):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # a prompt's (a conversation's special tokens are its chat template's)
    add_generation_prompt: bool = True  # messages': the assistant turn's opening, as vLLM's /tokenize

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if self.prompt is not None and self.messages is not None:
            raise ValueError("give prompt or messages, not both")
        return self


class DetokenizeRequest(_Strict):
    model: Text | None = None
    tokens: list[TokenId]
