"""Tool calling for `/v1/chat/completions`: what `tool_choice` constrains, and tool calls read from the output.

- `"none"` (or no tools): the tools are not shown to the template and nothing is parsed.
- a named function: the output is constrained to that function's parameter schema, and is its arguments.
- `"required"`: the output is constrained to a JSON array of `{"name", "parameters"}` calls (one at most when
  `parallel_tool_calls` is false), each object matching its tool's schema.
- `"auto"` (the default with tools): the model writes freely (with `parallel_tool_calls` false, its calls after
  the first are dropped, as vLLM drops them); tool calls are parsed from its own format, the
  chat template's: Hermes/Qwen `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks, or Llama 3.x
  JSON (`{"name": ..., "parameters": ...}`, optionally after `<|python_tag|>`, several separated by `;`), or
  gpt-oss's harmony messages to a function (`openai`, vLLM's name: `<|channel|>commentary to=functions.NAME
  <|constrain|>json<|message|>{...}<|call|>`, read by the reasoning stream, reasoning.py, with the gpt_oss
  reasoning parser on). `--tool-call-parser auto` picks by the template (one that writes `<tool_call>` is Hermes,
  one with harmony's `<|channel|>` openai).

Calls are read from the output as it is generated (tool_stream.py): every mode streams a call's arguments as
`delta.tool_calls` pieces, as the `openai` SDK expects; the whole-text parsers here read a model's calls that
the stream could not follow.

Must not import torch.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server.protocol import ChatCompletionRequest, NamedToolChoice

PARSERS = ("auto", "hermes", "llama3_json", "openai")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    parser: str  # "hermes" | "llama3_json"
    function: str | None = None  # the named function
    tools: list[dict[str, Any]] = field(default_factory=list)  # as the chat template takes them
    parallel: bool = True  # False: one call at most (`parallel_tool_calls`, Anthropic's `disable_parallel_tool_use`)


def plan(
    tools: list[dict[str, Any]], choice: str | None, parser: str, chat_template: str, function: str | None = None,
    parallel: bool = True,
) -> ToolPlan:  # fmt: skip
    """What a request's tools (as the chat template takes them) and tool choice mean: `choice` is "none", "auto",
    "required", "named" (`function` names it) or None (auto with tools, none without); `parallel` False allows
    one call. ValueError for a choice that needs tools when none are given, or names a function that is not among
    them."""
    choice = choice or ("auto" if tools else "none")
    if parser == "auto":
        harmony = "<|channel|>" in chat_template
        parser = "hermes" if HERMES_OPEN in chat_template else "openai" if harmony else "llama3_json"
    if not tools:
        if choice not in ("none", "auto"):
            raise ValueError("tool_choice needs tools: the request gives none")
        return ToolPlan("none", parser)
    if choice == "named":
        if function not in {t["function"]["name"] for t in tools}:
            raise ValueError(f"tool_choice names the function {function!r}, which is not in tools")
        return ToolPlan("named", parser, function, tools)
    return ToolPlan(choice, parser, None, tools, parallel)


def chat_plan(body: ChatCompletionRequest, parser: str, chat_template: str) -> ToolPlan:
    """`plan` for a chat completion's `tools` and `tool_choice`."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        return plan(tools, "named", parser, chat_template, choice.function.name)
    return plan(tools, choice, parser, chat_template, parallel=body.parallel_tool_calls)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def constraint(p: ToolPlan) -> StructuredOutputsParams | None:
    """The grammar a forced tool call needs (None for "auto" and "none")."""
    if p.mode == "named":
        tool = next(t for t in p.tools if t["function"]["name"] == p.function)
        return StructuredOutputsParams(json=_parameters(tool))
    if p.mode != "required":
        return None
    # each tool's parameters under an $id of its own, so that their "#..." references resolve in them, not in the
    # array around them (a tool's $defs, or a recursive "#")
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "parameters": {"$id": f"urn:tokenmill:tool:{i}", **_parameters(t)}},
              "required": ["name", "parameters"], "additionalProperties": False}
             for i, t in enumerate(p.tools)]  # fmt: skip
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not p.parallel:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array)


def new_call_id() -> str:
    """A tool call's id, as OpenAI's are written (every reader of calls takes its ids here)."""
    return "call_" + uuid.uuid4().hex[:24]


def new_call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": text}}


def parse_whole(p: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a finished `"auto"` output read whole, in the plan's parser's format: a model's
    calls that tool_stream.py's reader could not follow as they came."""
    if p.parser == "openai":  # harmony's calls are read from the channels (reasoning.py): the rest is content
        return text, []
    return _parse_hermes(text) if p.parser == "hermes" else _parse_llama3(text)


def _call_of(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return new_call(obj["name"], args)


def _parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    calls = []
    for m in _HERMES.finditer(text):
        try:
            call = _call_of(json.loads(m.group(1)))
        except ValueError:
            call = None
        if call is None:
            return text, []  # a malformed block: the output stays content, as written
        calls.append(call)
    if not calls:
        return text, []
    content = text[: text.find(HERMES_OPEN)].strip()
    return content or None, calls


def _parse_llama3(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    for part in body.split(";"):  # several calls: "{...}; {...}"
        try:
            call = _call_of(json.loads(part))
        except ValueError:
            return text, []
        if call is None:
            return text, []
        calls.append(call)
    return None, calls
