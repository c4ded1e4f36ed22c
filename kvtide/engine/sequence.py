"""A request's state as the engine sees it: tokens, pages, progress, output text."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .sampling_params import SamplingParams

# In ``Sequence.output_token_ids``: a token its step sampled on the device that has not reached the host yet (the
# engine's async scheduling launches the next step first). Only ever the last token; never hashed or detokenized.
PENDING = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # block table: page ids in token order
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache at admission
    num_preemptions: int = 0
    text: str = ""
    emitted_chars: int = 0  # of `text`, already handed out by streaming
    finish_reason: str | None = None
    first_scheduled_time: float | None = None  # when a step first took it in (prefill or restoration)
    first_token_time: float | None = None
    finish_time: float | None = None
    detok: object | None = None
    generator: object | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, stop: int) -> list[int]:
        """token_ids[start:stop] without building token_ids (a long prompt's copy every step is host time for nothing)."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n:stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival
