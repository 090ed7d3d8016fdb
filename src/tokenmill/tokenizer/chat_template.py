"""Chat templates rendered as transformers 5 renders them (its utils/chat_template_utils.py and
`apply_chat_template`), without importing transformers: the same sandboxed jinja2 environment, globals and filters,
and the same preparation of the messages, tools and variables the template sees."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

# Names a message's reasoning may come under; transformers copies it to `reasoning_content` and `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def pick_template(templates: str | dict[str, str] | None, name: str | None, tools: Any) -> str:
    """transformers' `get_chat_template`: a template by name (or given whole), the `tool_use` one with tools, else
    the default. ValueError where there is none to pick."""
    if isinstance(templates, dict):
        if name is not None and name in templates:
            return templates[name]
        if name is None:
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(f"this tokenizer has several chat templates and no default: {sorted(templates)}")
    if name is not None:
        return name
    if not isinstance(templates, str):
        raise ValueError("this tokenizer has no chat template")
    return templates


def render(
    template: str,
    messages: list[Any],
    variables: dict[str, Any],
    tools: list[Any] | None = None,
    documents: list[Any] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """One conversation through `template`. `variables`: the special tokens (bos_token, ...) and the caller's extra
    template arguments, which override them. jinja2's TemplateError where the template fails or refuses."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    chat = []
    for message in _plain(messages):
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        # keys whose value is None are dropped: templates handle a missing key, not always a null one
        chat.append(_alias_reasoning({k: v for k, v in message.items() if v is not None}))
    schemas = None if tools is None else [_tool_schema(tool) for tool in tools]
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    return str(
        _compile(template).render(
            messages=chat, tools=_plain(schemas), documents=_plain(documents),
            add_generation_prompt=add_generation_prompt, **_plain(variables),
        )
    )  # fmt: skip


def _tool_schema(tool: Any) -> Any:
    if isinstance(tool, dict):
        return tool
    if callable(tool):  # a Python function described by its type hints and docstring: transformers' own parser
        from transformers.utils.chat_template_utils import get_json_schema

        return get_json_schema(tool)
    raise ValueError(
        "Tools should either be a JSON schema, or a callable function with type hints "
        "and a docstring suitable for auto-conversion to a schema."
    )


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    """What a template may see: plain JSON types rebuilt from the input (sandbox-safe), anything else a
    placeholder naming its type, as transformers' `_plain_template_data`."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and hasattr(value, "item"):  # a numpy scalar
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def syntax_problem(templates: str | dict[str, str] | None) -> str | None:
    """Why a chat template (or one of several named ones) does not parse, in one line; None where every one does.
    Checked at load: such a template failed only at the first chat request, which blamed the request."""
    from jinja2 import TemplateSyntaxError

    for name, template in templates.items() if isinstance(templates, dict) else [("", templates or "")]:
        try:
            _compile(template)
        except TemplateSyntaxError as e:
            return f"{'the ' + repr(name) + ' ' if name else ''}chat template does not parse (line {e.lineno}: {e})"
    return None


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        raise ImportError(f"chat templates need jinja2>=3.1.6 (older ones have sandbox escapes); {jinja2.__version__}")
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_block(), jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _namespace_class()
    return env.from_string(template)


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """jinja2's own `tojson` escapes HTML characters; transformers' does not, and takes json.dumps' options."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` inside a template: builds dicts, and offers nothing else to reach through."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _generation_block() -> type:
    """`{% generation %}...{% endgeneration %}` marks an assistant's text (transformers tracks it for training
    masks); rendered, it is its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}  # noqa: RUF012  (jinja2 declares it so)

        def parse(self, parser: Any) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    return GenerationBlock


def _namespace_class() -> type:
    """jinja2's `namespace`, refusing attribute names that start with "_" (a way towards CPython internals)."""
    from jinja2.exceptions import SecurityError
    from jinja2.utils import Namespace

    def check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute."
            )

    class TemplateNamespace(Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's signature: `namespace(self=...)` works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            Namespace.__setitem__(self, name, value)

    return TemplateNamespace
