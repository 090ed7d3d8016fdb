"""The Responses API's answer: output items from one engine request's output, and the response object around
them (echoing the request, with status, usage and `incomplete_details`).

The output is a list of items, in the order the model produced them:
- with a reasoning parser, a `reasoning` item with one `reasoning_text` part (and an empty `summary`): the
  thinking the parser splits off, present when the model thought something;
- a `message` item with one `output_text` part: the text (without the tool calls read from it), present whenever
  there is text or nothing else;
- one `function_call` item per tool call (`call_id`, `name`, `arguments`), read by tools.py as for a chat
  completion.
The text is read as a chat completion's is (choice_stream.read_answer), and streamed the same way
(responses_stream.py).

Must not import torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.server.choice_stream import AnswerPlan, read_answer
from tokenmill.server.responses_protocol import FunctionTool, NamedFunction, ResponsesRequest, new_id

ABORTED = "the request was aborted: the server is shutting down; retry"


def status_of(out: CompletionOutput) -> str:
    """A finished output's status (its items' and the response's): incomplete when max_output_tokens cut it."""
    return "incomplete" if out.finish_reason == "length" else "completed"


def message_item(text: str, status: str) -> dict[str, Any]:
    return {"id": new_id("msg_"), "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)]}  # fmt: skip


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(text: str, status: str) -> dict[str, Any]:
    return {"id": new_id("rs_"), "type": "reasoning", "summary": [], "content": [reasoning_part(text)],
            "status": status}  # fmt: skip


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def function_call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": "fc_" + call_id.removeprefix("call_"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def output_items(answer: AnswerPlan, out: CompletionOutput) -> list[dict[str, Any]]:
    """The output items of a finished output."""
    thought, content, calls = read_answer(answer, out.text)
    items = [reasoning_item(thought, "completed")] if thought else []
    items += [message_item(content or "", "completed")] if content or not (calls or thought) else []
    for c in calls:
        items.append(function_call_item(c["id"], c["function"]["name"], c["function"]["arguments"], "completed"))
    items[-1]["status"] = status_of(out)  # only the last item can have been cut short
    return items


def usage(num_input: int, final: RequestOutput | None, answer: AnswerPlan) -> dict[str, Any]:
    out = final.outputs[0] if final is not None else None
    output = len(out.token_ids) if out is not None else 0
    cached = final.metrics.num_cached_tokens if final is not None and final.metrics is not None else 0
    thought = answer.reasoning_tokens(out.token_ids) if out is not None else 0
    return {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": thought},
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
            "reasoning": body.reasoning.model_dump(exclude={"generate_summary"}) if body.reasoning else None,
            "store": body.store,
            "temperature": temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice.model_dump() if isinstance(choice, NamedFunction) else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or [] if isinstance(t, FunctionTool)],
            "top_p": top_p,
            "truncation": "disabled",
            "user": body.user,
            "background": body.background,
        }
        return cls(response_id, model, int(time.time()), fields)

    def body(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None, error: str | None = None
    ) -> dict[str, Any]:
        """The response object. `status` "incomplete" means the output ran into max_output_tokens; a background
        response is also "queued", "in_progress" or "cancelled"."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
                "error": {"code": "server_error", "message": error} if error is not None else None,
                "incomplete_details": incomplete, "model": self.model, "output": output, **self.fields,
                "usage": usage}  # fmt: skip


def response_body(head: ResponseHead, answer: AnswerPlan, num_input: int, final: RequestOutput) -> dict[str, Any]:
    """The whole response for a finished request."""
    out = final.outputs[0]
    return head.body(status_of(out), output_items(answer, out), usage(num_input, final, answer))
