"""OpenAI response bodies and stream chunks for completions and chat, from the engine's outputs.

Choice ``i`` is copy ``i % n`` of prompt ``i // n`` (OpenAI's order). ``usage`` counts each prompt once (its copies
share it), every choice's generated tokens, and under ``prompt_tokens_details.cached_tokens`` the prompt tokens that
were not computed: found in the prefix cache or restored from a KV store.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


DONE = sse("[DONE]")


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def body(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class ResponseBuilder:
    """The ids, timestamps and shapes of one request's response (completion or chat, whole or streamed)."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, texts: list[str], reasons: list[str | None], usage: Usage) -> dict[str, Any]:
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                        "finish_reason": r} for i, (t, r) in enumerate(zip(texts, reasons))]
            return {**self._head("chat.completion"), "choices": choices, "usage": usage.body()}
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
        return {**self._head("text_completion"), "choices": choices, "usage": usage.body()}

    def chunk(self, index: int, text: str | None, reason: str | None, *, role: bool = False,
              include_usage: bool = False) -> dict[str, Any]:
        """A stream chunk for one choice: ``text`` added (chat: ``role`` opens the message), ``reason`` when it
        ends. With ``include_usage`` every chunk carries ``usage: null`` and `usage_chunk` the totals."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if role else (
                {"content": text} if text else {})
            out = {**self._head("chat.completion.chunk"),
                   "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}]}
        else:
            out = {**self._head("text_completion"),
                   "choices": [{"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}]}
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage.body()}
