"""The official `openai` SDK, sync and async, streaming and not, against a real `tokenmill serve` subprocess.

The model name is the MODEL argument as given (no --served-model-name here). Expected texts come from the
offline `LLM` in this process: the server must produce exactly what the engine produces for the same request.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from tests.server.helpers import FORWARD_PATHS, Server, offline, offline_chat
from tokenmill import LLM, SamplingParams

PROMPT = "The quick brown fox"
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello world!"},
]
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=60, max_retries=0)


def _async_client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=60, max_retries=0)


def _complete(client: openai.OpenAI, server: Server, prompt: Any = PROMPT, **kwargs: Any) -> Any:
    """A completion request, greedy with ignore_eos unless overridden."""
    kwargs = {"temperature": 0, "extra_body": IGNORE_EOS, **kwargs}
    return client.completions.create(model=server.model, prompt=prompt, **kwargs)


def _chat(client: openai.OpenAI, server: Server, **kwargs: Any) -> Any:
    kwargs = {"messages": MESSAGES, "temperature": 0, "extra_body": IGNORE_EOS, **kwargs}
    return client.chat.completions.create(model=server.model, **kwargs)


def test_completion_greedy_equals_offline_with_usage(client: openai.OpenAI, server: Server, llm: LLM) -> None:
    expected = offline(llm, PROMPT, 12)
    r = _complete(client, server, max_tokens=12)
    assert r.object == "text_completion" and r.model == server.model and r.id and isinstance(r.created, int)
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert (choice.index, choice.text, choice.finish_reason) == (0, expected.text, "length")
    n_prompt = len(llm.tokenizer.encode(PROMPT))
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 12, n_prompt + 12)


def test_completion_stream_equals_offline(client: openai.OpenAI, server: Server, llm: LLM) -> None:
    expected = offline(llm, PROMPT, 10)
    chunks = list(_complete(client, server, max_tokens=10, stream=True))
    assert chunks and all(c.object == "text_completion" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage anywhere


def test_prompt_forms_strings_and_token_ids(client: openai.OpenAI, server: Server, llm: LLM) -> None:
    prompts = [PROMPT, "To be, or not to be", "café"]
    expected = [offline(llm, p, 6).text for p in prompts]
    r = _complete(client, server, prompts, max_tokens=6)
    assert [(c.index, c.text) for c in r.choices] == list(enumerate(expected))
    ids = [llm.tokenizer.encode(p) for p in prompts]
    assert _complete(client, server, ids[0], max_tokens=6).choices[0].text == expected[0]
    r = _complete(client, server, ids, max_tokens=6)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == expected
    assert r.usage.prompt_tokens == sum(map(len, ids))


def test_n_greater_than_one(client: openai.OpenAI, server: Server, llm: LLM) -> None:
    expected = offline(llm, PROMPT, 5).text
    r = _complete(client, server, max_tokens=5, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.text == expected for c in r.choices)
    assert r.usage.completion_tokens == 15
    finished = {}
    for chunk in _complete(client, server, max_tokens=5, temperature=1, seed=3, n=2, stream=True):
        finished.update({c.index: c.finish_reason for c in chunk.choices if c.finish_reason})
    assert finished == {0: "length", 1: "length"}
    chat = _chat(client, server, max_tokens=4, n=2)
    want = offline_chat(llm, MESSAGES, 4).text
    assert sorted((c.index, c.message.content) for c in chat.choices) == [(0, want), (1, want)]


def test_completion_logprobs_match_engine(client: openai.OpenAI, server: Server, llm: LLM) -> None:
    expected = offline(llm, PROMPT, 6, logprobs=2)
    assert expected.logprobs is not None
    lp = _complete(client, server, max_tokens=6, logprobs=2).choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    want = [step[tok] for step, tok in zip(expected.logprobs, expected.token_ids)]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-3)
    for got, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and all(v <= 0 for v in top.values())
        # greedy: the sampled token is the most likely one (>=: distinct tokens decoding to the same string, like
        # two partial UTF-8 bytes shown as U+FFFD, share one key in this dict)
        assert got >= max(top.values()) - 1e-4
        # ... and the shared key keeps the likeliest value: at least the sampled token's own
        assert max(top.values()) >= got - 1e-4


def test_chat_logprobs(client: openai.OpenAI, server: Server, llm: LLM) -> None:
    expected = offline_chat(llm, MESSAGES, 5, logprobs=2)
    assert expected.logprobs is not None
    content = _chat(client, server, max_tokens=5, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert content is not None and len(content) == 5
    want = [step[tok] for step, tok in zip(expected.logprobs, expected.token_ids)]
    assert [c.logprob for c in content] == pytest.approx(want, abs=1e-3)
    for entry in content:
        assert isinstance(entry.token, str) and 1 <= len(entry.top_logprobs) <= 2
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-4)
    # each token's own bytes, parts of characters included: together they decode to the reply's text (a random
    # model's bytes need not be UTF-8, so both sides replace what is not)
    raw = bytes(b for c in content for b in c.bytes or [])
    assert raw.decode(errors="replace") == llm.tokenizer.decode(expected.token_ids)


def test_chat_equals_offline_chat(client: openai.OpenAI, server: Server, llm: LLM) -> None:
    expected = offline_chat(llm, MESSAGES, 8)
    r = _chat(client, server, max_completion_tokens=8)
    assert r.object == "chat.completion" and r.model == server.model and r.id
    msg = r.choices[0].message
    assert (msg.role, msg.content, r.choices[0].finish_reason) == ("assistant", expected.text, "length")
    n_prompt = len(llm.tokenizer.apply_chat_template(MESSAGES))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 8, n_prompt + 8)
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Hello world!"}]}]
    assert _chat(client, server, messages=parts, max_tokens=8).choices[0].message.content == expected.text


def test_chat_stream_equals_offline(client: openai.OpenAI, server: Server, llm: LLM) -> None:
    expected = offline_chat(llm, MESSAGES, 8)
    chunks = list(_chat(client, server, max_tokens=8, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_stop_strings(client: openai.OpenAI, server: Server, llm: LLM) -> None:
    full = offline(llm, PROMPT, 16).text
    # two characters from the second half, clear of U+FFFD (a partial UTF-8 sequence in a random model's text)
    starts = [i for i in range(len(full) // 2, len(full) - 1) if "\ufffd" not in full[i : i + 2]]
    assert starts, f"no usable stop string in {full!r}"
    stop = full[starts[0] : starts[0] + 2]
    want = full[: full.find(stop)]
    for stops in (stop, [stop, "never-generated"]):
        r = _complete(client, server, max_tokens=16, stop=stops)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    chunks = [c for c in _complete(client, server, max_tokens=16, stop=[stop], stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproduces_at_temperature_one(client: openai.OpenAI, server: Server) -> None:
    def sample(seed: int) -> str:
        return str(_complete(client, server, max_tokens=12, temperature=1, seed=seed).choices[0].text)

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2)}) > 1, "different seeds should not all give the same sample"


def test_echo(client: openai.OpenAI, server: Server, llm: LLM) -> None:
    expected = offline(llm, PROMPT, 6).text
    assert _complete(client, server, max_tokens=6, echo=True).choices[0].text == PROMPT + expected


def test_chat_streams_open_each_choice_in_order_for_the_sdks_stream_helper(client: openai.OpenAI,
                                                                            server: Server) -> None:  # fmt: skip
    """n > 1: each choice's role chunk comes first, in index order, as OpenAI's and vLLM's do: the SDK's
    `chat.completions.stream` builds its choices as their first chunks come (a stop string held one choice's text
    back, and a later index went first: IndexError), and takes a first chunk's logprobs into its snapshot before it
    adds them again. Its final completion is the non-streamed one's, logprobs included."""
    kw: Any = dict(model=server.model, messages=MESSAGES, max_tokens=12, n=3, temperature=1, seed=31,
                   stop=["zzzzzzzz"], logprobs=True, top_logprobs=1)  # fmt: skip
    whole = client.chat.completions.create(**kw)
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:  # (get_final_completion would refuse the choices that ran to max_tokens)
            pass
        final = stream.current_completion_snapshot
    assert [c.message.content for c in final.choices] == [c.message.content for c in whole.choices]
    for got, want in zip(final.choices, whole.choices, strict=True):
        assert got.logprobs and want.logprobs and got.logprobs.content and want.logprobs.content
        assert [t.token for t in got.logprobs.content] == [t.token for t in want.logprobs.content]
    firsts = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True)][:3]
    assert [(c.index, c.delta.role, c.delta.content, c.logprobs) for c in firsts] == [
        (i, "assistant", "", None) for i in range(3)
    ]


def test_streamed_completion_logprobs_are_the_whole_ones(client: openai.OpenAI, server: Server) -> None:
    """A stream's `text_offset`s go on from the text already sent, and `echo` leads the first chunk with the prompt's
    tokens and their logprobs: joined, the chunks are the non-streamed response. Echoed or generated, a token has
    `logprobs` alternatives (and its own), however many `prompt_logprobs` asks for."""
    for echo in (False, True):
        kw: Any = dict(max_tokens=6, logprobs=1, echo=echo, extra_body=IGNORE_EOS)
        whole = _complete(client, server, **kw).choices[0]
        chunks = [c.choices[0] for c in _complete(client, server, **kw, stream=True) if c.choices]
        assert "".join(c.text for c in chunks) == whole.text
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            joined = [x for c in chunks if c.logprobs for x in getattr(c.logprobs, field)]
            assert joined == getattr(whole.logprobs, field), (echo, field)
        if echo:
            assert chunks[0].text.startswith(PROMPT) and chunks[0].logprobs.token_logprobs[0] is None
    wide = _complete(client, server, max_tokens=6, logprobs=1, echo=True,
                     extra_body={**IGNORE_EOS, "prompt_logprobs": 4}).choices[0]  # fmt: skip
    assert wide.logprobs.top_logprobs[0] is None and all(1 <= len(t) <= 2 for t in wide.logprobs.top_logprobs[1:])


def test_echo_with_max_tokens_zero_scores_the_prompt(client: openai.OpenAI, server: Server, llm: LLM) -> None:
    """echo with max_tokens 0 (how lm-eval asks for a prompt's loglikelihood): the prompt's text and its tokens'
    logprobs, the engine's prompt logprobs, and no token generated."""
    r = _complete(client, server, max_tokens=0, echo=True, logprobs=1)
    choice, ids = r.choices[0], llm.tokenizer.encode(PROMPT)
    assert (choice.text, choice.finish_reason, r.usage.completion_tokens) == (PROMPT, "length", 0)
    assert choice.logprobs is not None and len(choice.logprobs.tokens) == len(ids)
    want = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=1))[0].prompt_logprobs
    assert want is not None and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([e[t] for e, t in zip(want[1:], ids[1:])], abs=1e-3)


def test_stream_include_usage_final_chunk(client: openai.OpenAI, server: Server, llm: LLM) -> None:
    *body, last = list(_complete(client, server, max_tokens=7, stream=True, stream_options={"include_usage": True}))
    assert last.choices == [] and last.usage is not None
    n_prompt = len(llm.tokenizer.encode(PROMPT))
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        n_prompt, 7, n_prompt + 7,
    )  # fmt: skip
    assert body and all(c.usage is None for c in body)


def test_stream_continuous_usage_in_every_chunk(client: openai.OpenAI, server: Server, llm: LLM) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(_complete(client, server, max_tokens=7, stream=True, stream_options=options))
    n_prompt = len(llm.tokenizer.encode(PROMPT))
    assert all(c.usage is not None and c.usage.prompt_tokens == n_prompt for c in chunks)
    completed = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert completed == sorted(completed) and completed[0] <= 1 and completed[-1] == 7
    assert all(c.usage.total_tokens == n_prompt + c.usage.completion_tokens for c in chunks if c.usage is not None)


def test_async_client_streaming_and_not(server: Server, llm: LLM) -> None:
    want_text = offline(llm, PROMPT, 9).text
    want_chat = offline_chat(llm, MESSAGES, 6).text
    greedy: dict[str, Any] = {"model": server.model, "temperature": 0, "extra_body": IGNORE_EOS}

    async def main() -> tuple[str, str, str, Any]:
        async with _async_client(server) as client:
            r = await client.completions.create(prompt=PROMPT, max_tokens=9, **greedy)
            stream = await client.completions.create(prompt=PROMPT, max_tokens=9, stream=True, **greedy)
            streamed = "".join([c.choices[0].text async for c in stream if c.choices])
            chat = await client.chat.completions.create(
                messages=MESSAGES, max_tokens=6, stream=True, stream_options={"include_usage": True}, **greedy
            )
            chunks = [c async for c in chat]
            chat_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return r.choices[0].text, streamed, chat_text, chunks[-1].usage

    text, streamed, chat_text, usage = asyncio.run(main())
    assert text == streamed == want_text
    assert chat_text == want_chat
    assert usage is not None and usage.completion_tokens == 6
    assert usage.prompt_tokens == len(llm.tokenizer.apply_chat_template(MESSAGES))


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(client: openai.OpenAI, server: Server) -> None:
    """`usage.prompt_tokens_details.cached_tokens`, as OpenAI and vLLM report it (what an agent loop's benchmark
    reads for its prefix hit rate): none for a prompt never seen, whole blocks of it the second time, streamed too."""
    prompt = " ".join(f"word{i}" for i in range(80))  # several KV blocks
    first = _complete(client, server, prompt=prompt, max_tokens=2)
    again = _complete(client, server, prompt=prompt, max_tokens=2)
    *_, last = _complete(client, server, prompt=prompt, max_tokens=2, stream=True,
                         stream_options={"include_usage": True})  # fmt: skip
    assert first.usage is not None and again.usage is not None and last.usage is not None
    assert first.usage.prompt_tokens_details is not None and first.usage.prompt_tokens_details.cached_tokens == 0
    for usage in (again.usage, last.usage):
        details = usage.prompt_tokens_details
        assert details is not None and 0 < (details.cached_tokens or 0) < usage.prompt_tokens


def test_the_usage_chunk_carries_the_calls_timings(client: openai.OpenAI, server: Server) -> None:
    """tokenmill's `timings` beside the usage (docs/api.md): an extra field the SDK keeps, streamed and not."""
    *_, last = _chat(client, server, max_tokens=7, stream=True, stream_options={"include_usage": True})
    whole = _chat(client, server, max_tokens=7)
    for timings in (last.model_extra["timings"], whole.model_extra["timings"]):
        assert timings["ttft_ms"] > 0 and timings["decode_tokens_per_sec"] > 0
        assert timings["draft_tokens"] == timings["accepted_tokens"] == 0  # no drafting on this server
        steps = timings["forward_steps"]
        # one step of prefill, then decodes: at least two steps and at most one per token
        assert steps and set(steps) <= FORWARD_PATHS and 2 <= sum(steps.values()) <= 7, steps
