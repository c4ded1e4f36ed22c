"""What the engine returns for a request: one ``RequestOutput`` per step that made progress, and the last one."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" (EOS, stop string or stop token), "length", "abort", "error"
    new_text: str = ""  # text made visible since the previous output of this request
    new_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    queue_time: float | None = None  # seconds from arrival to the first step that took the request in
    ttft: float | None = None  # seconds from arrival to the first token
    latency: float | None = None  # seconds from arrival to the last token (set when finished)
    num_preemptions: int = 0
    error: str | None = None  # why the request failed (finish_reason "error"); None otherwise
