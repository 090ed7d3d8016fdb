"""Request bodies of the HTTP API, as pydantic v2 models. Unknown fields are rejected (400 naming the
field), never silently ignored. Types are strict (`true` is not an integer, `1.5` is not one either), floats
must be finite, integers fit in 64 bits, and text must be valid Unicode (no lone UTF-16 surrogates).
Conversion to `SamplingParams` (which checks the ranges) lives here too."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from tokenmill.sampling_params import INT64, SamplingParams


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


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


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

    def sampling_params(
        self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
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
        )


class CompletionRequest(_SamplingFields):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    logprobs: Int64 | None = None
    echo: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def as_template_dict(self) -> dict[str, str]:
        """The message as the chat template sees it; `name` is passed on, as vLLM does."""
        message = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True


class GenerateRequest(_Strict):
    prompt: Text
    max_tokens: Int64 | None = 128
    temperature: float | None = None


class TokenizeRequest(_Strict):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: Text | None = None
    tokens: list[TokenId]
