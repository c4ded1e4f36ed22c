"""Malformed and hostile requests for the serving soak: each is sent, and its answer's status is checked.

Every kind names the statuses a correct server answers with; anything 5xx other than 503 is a server fault whatever
the kind. ``disconnect`` opens a stream and drops it after its first chunks (the server must abort and free it);
``poison`` is valid (a temperature far below float precision) and must succeed.
"""
from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Awaitable, Callable

from ..extras import require

httpx = require("httpx", "bench", "kvtide bench serve-soak")


@dataclass(frozen=True)
class Target:
    base: str  # http://host:port
    model: str
    max_model_len: int
    max_request_bytes: int


Sender = Callable[[httpx.AsyncClient, Target, random.Random], Awaitable[int | None]]


async def _post_raw(c: httpx.AsyncClient, t: Target, body: bytes, path: str = "/v1/completions") -> int:
    r = await c.post(t.base + path, content=body, headers={"content-type": "application/json"})
    return r.status_code


async def _post(c: httpx.AsyncClient, t: Target, body: dict, path: str = "/v1/completions") -> int:
    return await _post_raw(c, t, json.dumps(body).encode(), path)


def _ok_body(t: Target, rng: random.Random, **over) -> dict:
    body = {"model": t.model, "prompt": [rng.randrange(100, 10000) for _ in range(8)], "max_tokens": 4,
            "temperature": 0}
    body.update(over)
    return body


async def _disconnect(c: httpx.AsyncClient, t: Target, rng: random.Random) -> int | None:
    body = _ok_body(t, rng, max_tokens=64, stream=True, ignore_eos=True)
    async with c.stream("POST", t.base + "/v1/completions", json=body) as r:
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                seen += 1
                if seen >= 2:
                    break  # leaving the block closes the connection mid-stream
        return r.status_code


async def _slow_body(c: httpx.AsyncClient, t: Target, rng: random.Random) -> int | None:
    """Declares a body, sends a part of it, stalls, then gives up."""
    host, port = t.base.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 5000\r\n\r\n{\"model\": ")
        await writer.drain()
        await asyncio.sleep(rng.uniform(0.5, 2.0))
    finally:
        writer.close()
    return None


KINDS: dict[str, tuple[Sender, frozenset[int | None]]] = {
    "malformed_json": (lambda c, t, r: _post_raw(c, t, b'{"model": "x", "prompt": [1, 2'), frozenset({400})),
    "empty_body": (lambda c, t, r: _post_raw(c, t, b""), frozenset({400})),
    "not_utf8": (lambda c, t, r: _post_raw(c, t, b'{"prompt": "\xff\xfe"}'), frozenset({400})),
    "deep_nesting": (lambda c, t, r: _post_raw(c, t, b"[" * 50_000 + b"]" * 50_000), frozenset({400, 413})),
    "oversize_body": (lambda c, t, r: _post_raw(c, t, b'{"prompt": "' + b"a" * (t.max_request_bytes + 1024) + b'"}'),
                      frozenset({413})),
    "wrong_type": (lambda c, t, r: _post(c, t, _ok_body(t, r, temperature="hot")), frozenset({400})),
    "negative_max_tokens": (lambda c, t, r: _post(c, t, _ok_body(t, r, max_tokens=-5)), frozenset({400})),
    "huge_max_tokens": (lambda c, t, r: _post(c, t, _ok_body(t, r, max_tokens=10**12)), frozenset({400})),
    "zero_n": (lambda c, t, r: _post(c, t, _ok_body(t, r, n=0)), frozenset({400})),
    "bad_top_p": (lambda c, t, r: _post(c, t, _ok_body(t, r, top_p=2.0)), frozenset({400})),
    "nan_temperature": (lambda c, t, r: _post_raw(c, t, json.dumps(_ok_body(t, r)).replace(
        '"temperature": 0', '"temperature": NaN').encode()), frozenset({400})),
    "unknown_model": (lambda c, t, r: _post(c, t, _ok_body(t, r, model="no-such-model")), frozenset({404})),
    "beyond_context": (lambda c, t, r: _post(c, t, _ok_body(t, r, prompt=[100] * (t.max_model_len + 1))),
                       frozenset({400, 413})),
    "token_out_of_vocab": (lambda c, t, r: _post(c, t, _ok_body(t, r, prompt=[100, 10**9])), frozenset({400})),
    "too_many_stops": (lambda c, t, r: _post(c, t, _ok_body(t, r, stop=[f"s{i}" for i in range(500)])),
                       frozenset({400})),
    "bad_messages": (lambda c, t, r: _post(c, t, {"model": t.model, "messages": [{"content": "hi"}]},
                                            "/v1/chat/completions"), frozenset({400})),
    "unsupported_field": (lambda c, t, r: _post(c, t, _ok_body(t, r, logprobs=5)), frozenset({400})),
    "poison_temperature": (lambda c, t, r: _post(c, t, _ok_body(t, r, temperature=1e-300)), frozenset({200})),
    "disconnect": (_disconnect, frozenset({200})),
    "slow_body": (_slow_body, frozenset({None})),
}


async def send_hostile(c: httpx.AsyncClient, t: Target, kind: str, rng: random.Random) -> tuple[int | None, str]:
    """(status or None, error text) of one hostile request of ``kind``."""
    sender, _ = KINDS[kind]
    try:
        return await sender(c, t, rng), ""
    except (httpx.HTTPError, OSError) as e:
        return None, f"{type(e).__name__}: {e}"[:200]
