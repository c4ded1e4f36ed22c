"""One streamed completion against an OpenAI-compatible server, timed chunk by chunk.

TTFT is the arrival of the first chunk that carries a token, ITL the gaps between such chunks, output tokens the
server's ``usage.completion_tokens`` (the chunk count where it sends no usage). A failed request keeps its error
text and HTTP status; nothing is retried.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field


from .datasets import BenchRequest
from ..extras import require

httpx = require("httpx", "bench", "kvtide bench serve")


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int  # asked for
    ok: bool = False
    status: int | None = None
    error: str = ""
    ttft: float = 0.0  # seconds from send to the first token
    latency: float = 0.0  # seconds from send to the end of the stream
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int = 0
    send_s: float = 0.0  # when it was sent, from the run's start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for one token)."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def completion_body(model: str, req: BenchRequest, ignore_eos: bool = True) -> dict:
    return {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}


async def stream_completion(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest,
                            ignore_eos: bool = True) -> RequestResult:
    res = RequestResult(prompt_len=len(req.prompt), output_len=req.output_len)
    chunks = 0
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.stream("POST", url, json=completion_body(model, req, ignore_eos)) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread())[:500].decode("utf-8", "replace")
                res.error = f"HTTP {resp.status_code}: {body}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = f"stream error: {json.dumps(msg['error'])[:300]}"
                    return res
                now = time.perf_counter()
                if msg.get("choices"):
                    chunks += 1
                    if chunks == 1:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                usage = msg.get("usage")
                if usage:
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:500]
        return res
    res.latency = time.perf_counter() - t0
    if not res.output_tokens:
        res.output_tokens = chunks
    if chunks == 0:
        res.error = "the stream ended without a token"
        return res
    res.ok = True
    return res
