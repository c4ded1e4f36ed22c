"""Bad input, overload, engine failures and departing clients: each gets its own answer, and the server goes on."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MAX_REQUEST_BYTES, MODEL, PROMPTS

GOOD = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1, "temperature": 0}
CHAT = {"model": MODEL, "max_tokens": 1, "temperature": 0}
LONG = 2000  # tokens a request would take minutes to make: it must be cut, not finished


def _window(live) -> int:
    return live.llm.engine.max_seq_len


# (path, raw body or JSON-able object, status, param, words the message must hold)
CASES = [
    ("/v1/completions", b"{bad", 400, None, "not valid JSON"),
    ("/v1/completions", b"", 400, None, "empty"),
    ("/v1/completions", b"\xff\xfe{}", 400, None, "UTF-8"),
    ("/v1/completions", b"[" * 30_000 + b"]" * 30_000, 400, None, "cannot be decoded"),
    ("/v1/completions", [1, 2], 400, None, "JSON object"),
    ("/v1/completions", {**GOOD, "max_tokens": "abc"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("/v1/completions", {**GOOD, "max_tokens": 1.5}, 400, "max_tokens", "integer"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None, "cannot be decoded"),
    ("/v1/completions", {**GOOD, "temperature": -1}, 400, "temperature", ">= 0"),
    ("/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature", "number"),
    ("/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {**GOOD, "top_k": -2}, 400, "top_k", ">= -1"),
    ("/v1/completions", {**GOOD, "n": 0}, 400, "n", ">= 1"),
    ("/v1/completions", {**GOOD, "n": 65}, 400, "n", "at most 64"),
    ("/v1/completions", {**GOOD, "prompt": ["a"] * 65}, 400, "prompt", "at most 64"),
    ("/v1/completions", {**GOOD, "seed": -1}, 400, "seed", "integer"),
    ("/v1/completions", {**GOOD, "stop": 5}, 400, "stop", "string"),
    ("/v1/completions", {**GOOD, "stop": ["x"] * 17}, 400, "stop", "at most 16"),
    ("/v1/completions", {**GOOD, "ignore_eos": "yes"}, 400, "ignore_eos", "true or false"),
    ("/v1/completions", {**GOOD, "stream": 1}, 400, "stream", "true or false"),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ("/v1/completions", {**GOOD, "logprobs": 2}, 400, "logprobs", "not supported"),
    ("/v1/completions", {**GOOD, "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ("/v1/completions", {**GOOD, "model": 3}, 400, "model", "string"),
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/v1/completions", {k: v for k, v in GOOD.items() if k != "prompt"}, 400, "prompt", "required"),
    ("/v1/completions", {**GOOD, "prompt": []}, 400, "prompt", "non-empty"),
    ("/v1/completions", {**GOOD, "prompt": ["ok", ""]}, 400, "prompt", "prompt[1]"),
    ("/v1/completions", {**GOOD, "prompt": [1, True]}, 400, "prompt", "prompt[0]"),
    ("/v1/completions", {**GOOD, "prompt": [10**9]}, 400, "prompt", "vocabulary"),
    ("/v1/completions", lambda live: {**GOOD, "prompt": [1] * _window(live)}, 400, "prompt", "context length"),
    ("/v1/completions", lambda live: {**GOOD, "prompt": [1] * 10, "max_tokens": _window(live)}, 400, "max_tokens",
     "context length"),
    ("/v1/chat/completions", CHAT, 400, "messages", "required"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", "non-empty"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", "role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 7}]}, 400, "messages", "content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages", "text part"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
     400, "max_completion_tokens", ">= 1"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]},
     400, "tools", "not supported"),
]


@pytest.mark.parametrize("path,body,status,param,words", CASES, ids=[f"{i}-{c[3]}" for i, c in enumerate(CASES)])
def test_bad_input_gets_its_status_and_error_and_the_next_request_is_served(live, path, body, status, param, words):
    if callable(body):
        body = body(live)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with live.http() as http:
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == status and err["param"] == param and words in err["message"], err
        assert err["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
        ok = http.post("/v1/completions", json=GOOD)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    live.wait_idle()


def test_the_openai_client_sees_the_errors(live):
    client = live.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-3)
    assert e.value.body["param"] == "temperature" and "-3" in e.value.body["message"]


def test_body_size_and_routes(live):
    with live.http() as http:
        big = {**GOOD, "prompt": "a" * MAX_REQUEST_BYTES}
        r = http.post("/v1/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLargeError"

        def chunks():  # no Content-Length: the bound holds while reading
            yield b'{"prompt": "'
            for _ in range(MAX_REQUEST_BYTES // 1024 + 1):
                yield b"a" * 1024
            yield b'"}'

        r = http.post("/v1/completions", content=chunks())
        assert r.status_code == 413 and "more than" in r.json()["error"]["message"]
        r = http.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["message"] == "no route GET /v1/nothing"
        r = http.get("/v1/completions")
        assert r.status_code == 405 and r.json()["error"]["code"] == 405
        assert http.post("/v1/completions", json=GOOD).status_code == 200


def _stream_first_event(http: httpx.Client, body: dict):
    """Open a streamed request and read up to its first data line; returns the context, the open response and its
    line iterator (dropping the iterator closes the response)."""
    cm = http.stream("POST", "/v1/completions", json={**body, "stream": True})
    r = cm.__enter__()
    assert r.status_code == 200
    lines = r.iter_lines()
    for line in lines:
        if line.startswith("data: "):
            break
    return cm, r, lines


def test_overload_gets_503_with_retry_after(live, monkeypatch):
    monkeypatch.setattr(live.serving.admission, "limit", 1)
    with live.http() as http:
        cm, r, lines = _stream_first_event(http, {**GOOD, "max_tokens": LONG, "ignore_eos": True})
        busy = http.post("/v1/completions", json=GOOD)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["type"] == "ServiceUnavailableError"
        cm.__exit__(None, None, None)
        live.wait_idle()
        assert http.post("/v1/completions", json=GOOD).status_code == 200


def test_a_request_the_engine_fails_gets_its_own_error(live, monkeypatch):
    eng = live.llm.engine
    marker = live.llm.tokenizer.encode("Poison pill:")
    real = eng._append_token

    def failing(seq, slot, token, now):
        if seq.prompt_token_ids[:len(marker)] == marker:
            raise RuntimeError("injected failure")
        return real(seq, slot, token, now)

    monkeypatch.setattr(eng, "_append_token", failing)
    client = live.client()
    ref = live.reference(PROMPTS[4], max_tokens=6)
    done = {}

    def bystander():
        done["text"] = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=6, temperature=0,
                                                 extra_body={"ignore_eos": True}).choices[0].text

    t = threading.Thread(target=bystander)
    t.start()
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt="Poison pill: x", max_tokens=4)
    assert "injected failure" in e.value.body["message"]
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                            stream=True)  # the chat template puts no marker first: it succeeds
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    with pytest.raises(openai.APIError) as e:
        for _ in client.completions.create(model=MODEL, prompt="Poison pill: y", max_tokens=4, stream=True):
            pass
    assert "injected failure" in str(e.value.message)
    t.join(120)
    assert done["text"] == ref.text  # the request beside them was not touched
    live.wait_idle()


def _running(live) -> float:
    with live.http() as http:
        text = http.get("/metrics").text
    for fam in text_string_to_metric_families(text):
        if fam.name == "kvtide:num_requests_running":
            return fam.samples[0].value
    raise AssertionError("kvtide:num_requests_running missing")


def _wait_running(live, value: float, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while _running(live) != value:
        assert time.monotonic() < deadline, f"num_requests_running did not reach {value}"
        time.sleep(0.05)


def test_a_client_that_disconnects_mid_stream_frees_its_request(live):
    t0 = time.monotonic()
    with live.http() as http:
        cm, r, lines = _stream_first_event(http, {**GOOD, "max_tokens": LONG, "ignore_eos": True})
        _wait_running(live, 1)
        r.close()  # the client goes away mid-stream
        cm.__exit__(None, None, None)
    _wait_running(live, 0)
    live.wait_idle(timeout=10)
    assert time.monotonic() - t0 < 60, "the stream ran on after its client left"


def test_a_client_that_leaves_before_a_whole_answer_frees_its_request(live):
    t0 = time.monotonic()
    with httpx.Client(base_url=live.url, timeout=httpx.Timeout(120, read=1.0)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={**GOOD, "max_tokens": LONG, "ignore_eos": True})
    live.wait_idle(timeout=10)
    _wait_running(live, 0)
    assert time.monotonic() - t0 < 60
