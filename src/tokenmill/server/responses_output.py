"""The Responses API's answer: output items from one engine request's output, and the response object around
them (echoing the request, with status, usage and `incomplete_details`).

The output is a list of items, in the order the model produced them:
- a `message` item with one `output_text` part: the text (without the tool calls read from it), present whenever
  there is text or nothing else;
- one `function_call` item per tool call (`call_id`, `name`, `arguments`), read by tools.py as for a chat
  completion.
A `reasoning` item goes first once tokenmill has a reasoning parser: `output_items` is where it is made (from the
reasoning text the parser splits off), and `responses_stream.Items` where it is streamed (one more item kind
beside `message` and `function_call`).

Must not import torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.server import tool_stream, tools
from tokenmill.server.responses_protocol import FunctionTool, NamedFunction, ResponsesRequest, new_id

ABORTED = "the request was aborted: the server is shutting down; retry"


def status_of(out: CompletionOutput) -> str:
    """A finished output's status (its items' and the response's): incomplete when max_output_tokens cut it."""
    return "incomplete" if out.finish_reason == "length" else "completed"


def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("msg_"), "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)]}  # fmt: skip


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": "fc_" + call_id.removeprefix("call_"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def output_items(plan: tools.ToolPlan, out: CompletionOutput) -> list[dict[str, Any]]:
    """The output items of a finished output."""
    content, calls = tool_stream.parse(plan, out.text) if plan.mode != "none" else (out.text, [])
    items = [message_item(content or "", "completed")] if content or not calls else []
    for c in calls:
        items.append(function_call_item(c["id"], c["function"]["name"], c["function"]["arguments"], "completed"))
    items[-1]["status"] = status_of(out)  # only the last item can have been cut short
    return items


def usage(num_input: int, final: RequestOutput | None) -> dict[str, Any]:
    output = len(final.outputs[0].token_ids) if final is not None else 0
    cached = final.metrics.num_cached_tokens if final is not None and final.metrics is not None else 0
    return {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_input + output}  # fmt: skip


@dataclass(frozen=True)
class ResponseHead:
    """What a response echoes of its request, fixed when the call starts."""

    id: str
    model: str
    created_at: int
    fields: dict[str, Any]  # the request's settings, as the response object lists them

    @classmethod
    def of(cls, response_id: str, model: str, body: ResponsesRequest, temperature: float, top_p: float) -> ResponseHead:
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        choice = body.tool_choice
        fields = {
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": None,
            "store": body.store,
            "temperature": temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice.model_dump() if isinstance(choice, NamedFunction) else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or [] if isinstance(t, FunctionTool)],
            "top_p": top_p,
            "truncation": "disabled",
            "user": body.user,
            "background": False,
        }
        return cls(response_id, model, int(time.time()), fields)

    def body(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None, error: str | None = None
    ) -> dict[str, Any]:
        """The response object. `status` "incomplete" means the output ran into max_output_tokens."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
                "error": {"code": "server_error", "message": error} if error is not None else None,
                "incomplete_details": incomplete, "model": self.model, "output": output, **self.fields,
                "usage": usage}  # fmt: skip
