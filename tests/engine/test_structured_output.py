"""Structured output in the engine: every constrained output parses and validates (JSON schemas, regexes, choices,
grammars), at temperature 0 and 1, in batches mixed with free requests; the constraint holds through n > 1,
stop strings, max_tokens, preemption, prefix caching and speculation; bad grammars are one clear error."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.sampling.sampler import apply_bitmask

_S = {"type": "string", "maxLength": 12}
_OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS: list[dict[str, Any]] = [
    {**_OBJ, "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["a"]},
    {**_OBJ, "properties": {"name": _S, "ok": {"type": "boolean"}}, "required": ["name", "ok"]},
    {**_OBJ, "properties": {"x": {"enum": [0.5, -1.25, 3]}}, "required": ["x"]},
    {**_OBJ, "properties": {"e": {"enum": ["red", "green", "blue"]}}, "required": ["e"]},
    {**_OBJ, "properties": {"c": {"const": "fixed"}, "n": {"type": "null"}}, "required": ["c", "n"]},
    {**_OBJ, "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}},
     "required": ["tags"]},
    {**_OBJ, "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                   "minItems": 2, "maxItems": 3}}, "required": ["xs"]},
    {**_OBJ, "properties": {"inner": {**_OBJ, "properties": {"v": _S}, "required": ["v"]}}, "required": ["inner"]},
    {**_OBJ, "properties": {"deep": {**_OBJ, "properties": {"deeper": {**_OBJ, "properties": {
        "k": {"type": "integer", "minimum": 1, "maximum": 3}}, "required": ["k"]}}, "required": ["deeper"]}},
     "required": ["deep"]},
    {**_OBJ, "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, _S]}},
     "required": ["v"]},
    {**_OBJ, "properties": {"v": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}, "required": ["v"]},
    {**_OBJ, "properties": {"req": _S, "opt": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["req"]},
    {**_OBJ, "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}}, "required": []},
    {**_OBJ, "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]},
    {**_OBJ, "properties": {"t": {"type": "string", "format": "time"}}, "required": ["t"]},
    {**_OBJ, "properties": {"u": {"type": "string", "format": "uuid"}}, "required": ["u"]},
    {**_OBJ, "properties": {"ip": {"type": "string", "format": "ipv4"}}, "required": ["ip"]},
    {**_OBJ, "properties": {"dt": {"type": "string", "format": "date-time"}}, "required": ["dt"]},
    {**_OBJ, "properties": {"s": {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{2}$"}}, "required": ["s"]},
    {**_OBJ, "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 6}}, "required": ["s"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 50}, "maxItems": 5},
    {"enum": ["alpha", "beta", 3, None]},
    {**_OBJ, "properties": {"people": {"type": "array", "maxItems": 2, "items": {
        **_OBJ, "properties": {"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]}}}, "required": ["people"]},
    {**_OBJ, "properties": {"kind": {"enum": ["circle", "square"]}, "size": {"type": "integer", "minimum": 1,
                                                                               "maximum": 10}},
     "required": ["kind", "size"]},
    {"$defs": {"p": {**_OBJ, "properties": {"q": {"type": "boolean"}}, "required": ["q"]}},
     **_OBJ, "properties": {"one": {"$ref": "#/$defs/p"}, "two": {"$ref": "#/$defs/p"}}, "required": ["one", "two"]},
]  # fmt: skip


def _json(schema: dict[str, Any], temperature: float, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=7, max_tokens=300,
                          structured_outputs=StructuredOutputsParams(json=schema), **kw)  # fmt: skip


@pytest.fixture(scope="module")
def tiny(make_checkpoint: Callable[..., Path]) -> LLM:
    return LLM(str(make_checkpoint("llama", initializer_range=0.1)), dtype="float32")


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM()


def _check_batch(llm: LLM, prompt: str) -> None:
    """Every schema at temperature 0 and 1, interleaved with free requests, in one generate call."""
    params: list[SamplingParams] = []
    for schema in SCHEMAS:
        params += [_json(schema, 0.0), _json(schema, 1.0), SamplingParams(temperature=1.0, seed=3, max_tokens=12)]
    outs = llm.generate([prompt] * len(params), params)
    for p, out in zip(params, outs):
        c = out.outputs[0]
        if p.structured_outputs is None:
            continue
        assert c.finish_reason == "stop", (p.structured_outputs.json, c.text)
        jsonschema.validate(json.loads(c.text), p.structured_outputs.json)  # type: ignore[arg-type]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_every_schema_validates_on_the_demo_model(demo: LLM) -> None:
    _check_batch(demo, "ROMEO:")


def test_every_schema_validates_on_a_tiny_random_model(tiny: LLM) -> None:
    _check_batch(tiny, "hello")


def test_regex_choice_and_grammars(tiny: LLM) -> None:
    # [0-9], not \d: the grammar's \d takes every Unicode digit of its own (newer) tables, and a draw of one that
    # Python 3.11's Unicode 14 lacks (U+1E4F7, Nag Mundari) failed re's check of a valid output
    regexes = [r"[a-z]{3,8}", r"(yes|no)-[0-9]{2}", r"[0-9]{3}-[0-9]{4}", r"[A-Z][a-z]{1,5} [A-Z][a-z]{1,5}"]
    lark = 'start: "(" item ("," item)* ")"\nitem: /[a-c]{1,3}/'
    gbnf = 'root ::= "[" digit digit? "]"\ndigit ::= [0-9]'
    cases = [StructuredOutputsParams(regex=r) for r in regexes] + [
        StructuredOutputsParams(choice=["north", "south", "east west"]),
        StructuredOutputsParams(grammar=lark), StructuredOutputsParams(grammar=gbnf),
        StructuredOutputsParams(json_object=True),
    ]  # fmt: skip
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=5, max_tokens=200, structured_outputs=c) for c in cases]
        outs = [o.outputs[0] for o in tiny.generate(["hello"] * len(params), params)]
        for r, out in zip(regexes, outs):
            assert re.fullmatch(r, out.text), (r, out.text)
        choice, lark_out, gbnf_out, obj = outs[len(regexes) :]
        assert choice.text in ("north", "south", "east west")
        assert re.fullmatch(r"\([a-c]{1,3}(,[a-c]{1,3})*\)", lark_out.text), lark_out.text
        assert re.fullmatch(r"\[\d\d?\]", gbnf_out.text), gbnf_out.text
        if obj.finish_reason == "stop":  # any object: unbounded, so it may run out of tokens
            assert isinstance(json.loads(obj.text), dict)
        assert all(o.finish_reason in ("stop", "length") for o in outs)


def test_the_grammar_ends_the_output(tiny: LLM) -> None:
    """EOS only where the grammar can end, and the grammar's end is a stop: `a{3,5}` gives 3-5 a's, never more,
    even with ignore_eos; min_tokens yields where the grammar can only end."""
    for kw in ({}, {"ignore_eos": True}, {"min_tokens": 8}):
        so = StructuredOutputsParams(regex="a{3,5}")
        out = tiny.generate(["hello"], SamplingParams(temperature=1.0, seed=1, max_tokens=50, structured_outputs=so,
                                                      **kw))[0].outputs[0]  # fmt: skip
        assert re.fullmatch("a{3,5}", out.text) and out.finish_reason == "stop", (kw, out.text)


def test_n_stop_strings_and_max_tokens(tiny: LLM) -> None:
    schema = SCHEMAS[5]
    out = tiny.generate(["hello"], _json(schema, 1.0, n=4))[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), schema)
    cut = tiny.generate(["hello"], _json(SCHEMAS[1], 0.0, stop=['", ']))[0].outputs[0]  # lands mid-JSON
    assert cut.finish_reason == "stop" and cut.text.startswith('{"name": "') and '", ' not in cut.text
    with_lp = tiny.generate(["hello"], _json(SCHEMAS[3], 1.0, logprobs=2))[0].outputs[0]  # the raw distribution's
    assert with_lp.logprobs is not None and len(with_lp.logprobs) == len(with_lp.token_ids)
    assert all(t in lp and lp[t] > float("-inf") for t, lp in zip(with_lp.token_ids, with_lp.logprobs))
    short = tiny.generate(["hello"], SamplingParams(temperature=0, max_tokens=3,
                          structured_outputs=StructuredOutputsParams(json=SCHEMAS[1])))[0].outputs[0]  # fmt: skip
    assert short.finish_reason == "length" and len(short.token_ids) == 3 and short.text.startswith("{")


@pytest.mark.parametrize(
    "engine",
    [{"num_kv_blocks": 40, "block_size": 4}, {"enable_prefix_caching": True},
     {"speculative_model": "ngram", "num_speculative_tokens": 3, "speculative_disable_by_batch_size": 64}],
    ids=["preempted", "prefix-cached", "speculating"],
)  # fmt: skip
def test_constraints_hold_through_preemption_caching_and_speculation(
    make_checkpoint: Callable[..., Path], tiny: LLM, engine: dict[str, Any]
) -> None:
    """Greedy constrained outputs (and free ones beside them) are what a plain engine gives. Matchers follow
    the generated tokens, so recompute after preemption does not disturb them; constrained requests get no
    drafts, the free ones do."""
    prompts = ["hello there " * k for k in range(1, 7)]
    params = [_json(SCHEMAS[i % 8], 0.0) if i % 2 == 0 else SamplingParams(temperature=0, max_tokens=40,
              ignore_eos=True) for i in range(len(prompts))]  # fmt: skip
    params = [replace(p, max_tokens=40) for p in params]
    want = [o.outputs[0].token_ids for o in tiny.generate(prompts, params)]
    llm = LLM(str(make_checkpoint("llama", initializer_range=0.1)), dtype="float32", **engine)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    if "num_kv_blocks" in engine:
        assert llm.engine.scheduler.num_preemptions > 0
    if "speculative_model" in engine:  # the free requests drafted (their repeats are lookup material)
        assert llm.engine.stats.spec_draft_tokens > 0
    kv = llm.engine.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_bad_grammars_are_one_clear_error(tiny: LLM) -> None:
    bad = [({"json": {"type": "objec"}}, "invalid JSON schema"), ({"json": "{not json"}, "not valid JSON"),
           ({"regex": "a(b"}, "invalid regex"), ({"grammar": "start: foo"}, "invalid grammar"),
           ({"json": {"type": "string", "format": "no-such-format"}}, "invalid JSON schema"),
           ({"json": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}},
            r'Unimplemented keys: \["if", "then"\]')]  # fmt: skip
    for fields, message in bad:
        with pytest.raises(ValueError, match=message):
            tiny.generate(["hello"], SamplingParams(structured_outputs=StructuredOutputsParams(**fields)))
    for fields in ({}, {"regex": "a", "choice": ["a"]}, {"choice": []}):
        with pytest.raises(ValueError, match="structured_outputs needs exactly one|choice="):
            StructuredOutputsParams(**fields)
    out = tiny.generate(["hello"], SamplingParams(temperature=0, max_tokens=4))[0]  # the engine carries on
    assert len(out.outputs[0].token_ids) == 4


def test_a_grammar_that_ends_on_the_last_token_allowed_is_a_stop(tiny: LLM) -> None:
    """`a{3}` in exactly 3 tokens ends where the grammar ends: "stop", as EOS in the last slot is, not "length"."""
    so = StructuredOutputsParams(regex="a{3}")
    for max_tokens in (3, 4):
        out = tiny.generate(["hello"], SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so))
        assert (out[0].outputs[0].text, out[0].outputs[0].finish_reason) == ("aaa", "stop"), max_tokens


def test_a_grammar_no_output_matches_is_refused(tiny: LLM) -> None:
    """A regex whose language is empty is refused when it compiles (once a request that ended in "error")."""
    with pytest.raises(ValueError, match="invalid regex: no output matches it"):
        tiny.generate(["hello"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a&&b]")))


def test_required_tool_calls_keep_each_tools_own_references(tiny: LLM) -> None:
    """tool_choice="required" puts every tool's parameters in one array schema; a tool's "#/$defs/..." and a
    recursive "#" still mean its own schema (pydantic writes such tools), not the array's."""
    from tokenmill.server import tools
    from tokenmill.server.protocol import ChatCompletionRequest

    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    typed = {"$defs": {"I": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/I"}}}
    functions = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in (("f", tree), ("g", typed))]
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], tools=functions, tool_choice="required"
    )
    constraint = tools.constraint(tools.chat_plan(request, "auto", ""))
    assert constraint is not None
    manager = tiny.engine.structured
    grammar = manager.compile(constraint)
    texts = {'[{"name": "f", "parameters": {"kids": [{}]}}]': True, '[{"name": "g", "parameters": {"a": 5}}]': True,
             '[{"name": "f", "parameters": {"kids": [[{"name": "f", "parameters": {}}]]}}]': False}  # fmt: skip
    for text, valid in texts.items():
        manager.add("t", grammar)
        ok = all(manager.accept("t", t) for t in tiny.tokenizer.encode(text, add_special_tokens=False))
        assert (ok and manager.finished("t")) == valid, text
        manager.remove("t")


def test_apply_bitmask_matches_a_boolean_mask() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, generator=gen)
    allowed = torch.rand(3, 70, generator=gen) < 0.3  # [B, V]
    words = torch.zeros(3, 3, dtype=torch.int64)  # 96 bits per row; bits past 70 left clear
    for b, v in allowed.nonzero().tolist():
        words[b, v // 32] |= 1 << (v % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    got = apply_bitmask(logits, bitmask)
    assert torch.equal(got, logits.masked_fill(~allowed, float("-inf")))
    wide = apply_bitmask(torch.randn(1, 100), torch.full((1, 2), -1, dtype=torch.int32))  # past the mask: banned
    assert torch.isneginf(wide[0, 64:]).all() and not torch.isneginf(wide[0, :64]).any()
