"""The OpenAI routes against a live server with the real `openai` client: the same greedy text as LLM.generate."""
from __future__ import annotations

import asyncio

from kvtide import __version__
from tests.server.conftest import MAX_TOKENS, MODEL, PROMPTS

EXTRA = {"ignore_eos": True}


def test_completions_whole_and_streamed_equal_generate(live):
    client = live.client()
    for prompt in PROMPTS[:2]:
        ref = live.reference(prompt)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body=EXTRA)
        assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == MAX_TOKENS
        assert r.usage.total_tokens == r.usage.prompt_tokens + MAX_TOKENS
        assert r.model == MODEL and r.object == "text_completion"
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, extra_body=EXTRA))
        assert "".join(c.choices[0].text for c in chunks) == ref.text
        assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1
    live.wait_idle()


def test_chat_whole_and_streamed_equal_generate(live):
    client = live.client()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    ref = live.reference(live.llm.chat_prompt(messages))
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=MAX_TOKENS,
                                       temperature=0, extra_body=EXTRA)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == MAX_TOKENS
    # content parts are joined; max_tokens is the older name of max_completion_tokens
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "Name a "},
                                                        {"type": "text", "text": "colour."}]}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=parts, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=EXTRA))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    u = chunks[-1].usage
    assert (u.prompt_tokens, u.completion_tokens) == (len(ref.prompt_token_ids), MAX_TOKENS)
    live.wait_idle()


def test_sixteen_concurrent_streams_each_get_their_sequential_result(live):
    prompts = (PROMPTS + PROMPTS)[:16]
    refs = {p: live.reference(p) for p in set(prompts)}

    async def one(client, prompt):
        text, reasons = "", []
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, extra_body=EXTRA)
        async for c in stream:
            text += c.choices[0].text
            reasons.append(c.choices[0].finish_reason)
        return text, reasons[-1]

    async def run():
        async with live.async_client() as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(run())
    for p, (text, reason) in zip(prompts, results):
        assert text == refs[p].text, p
        assert reason == "length"
    live.wait_idle()


def test_prompt_lists_token_ids_and_n(live):
    client = live.client()
    a, b = PROMPTS[2], PROMPTS[3]
    ra, rb = live.reference(a), live.reference(b)
    r = client.completions.create(model=MODEL, prompt=[a, b], n=2, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body=EXTRA)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [ra.text, ra.text, rb.text, rb.text]  # choice i: prompt i // n
    assert r.usage.prompt_tokens == len(ra.prompt_token_ids) + len(rb.prompt_token_ids)
    assert r.usage.completion_tokens == 4 * MAX_TOKENS
    r = client.completions.create(model=MODEL, prompt=ra.prompt_token_ids, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body=EXTRA)
    assert r.choices[0].text == ra.text
    # sampled copies: seeds derived per copy, so the same request with the same seed repeats itself
    sampled = dict(model=MODEL, prompt=a, n=3, max_tokens=MAX_TOKENS, temperature=1.0, seed=7, extra_body=EXTRA)
    first = [c.text for c in client.completions.create(**sampled).choices]
    assert [c.text for c in client.completions.create(**sampled).choices] == first
    assert len(set(first)) > 1, "n copies of one prompt must not all share one seed"
    live.wait_idle()


def test_stop_strings_end_the_text(live):
    ref = live.reference(PROMPTS[2])
    word = ref.text.split()[2]  # a later word of the greedy text
    r = live.client().completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
                                         stop=[word])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == ref.text[:ref.text.index(word)]


def test_models_health_version(live):
    models = live.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    with live.http() as http:
        card = http.get("/v1/models").json()["data"][0]
        assert card["max_model_len"] == live.llm.engine.max_seq_len and card["owned_by"] == "kvtide"
        assert http.get("/health").status_code == 200
        assert http.get("/version").json() == {"version": __version__}
