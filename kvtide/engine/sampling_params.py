"""Per-request sampling settings, validated when made so a bad request fails before it reaches the engine."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# Temperatures below this are greedy (as in vLLM): dividing logits by a tiny temperature overflows to Inf/NaN.
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 (or below MIN_TEMPERATURE) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    # the least relative quality of KV a restoration may give this request (1.0: lossless entries only; below 1, it
    # may be restored from entries stored under a KVServe profile of at least this quality, RestoreConfig.store_profiles)
    kv_min_quality: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not _number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63) or None, got {self.seed!r}")
        if not _number(self.kv_min_quality) or not 0.0 <= self.kv_min_quality <= 1.0:
            raise ValueError(f"kv_min_quality must be a number in [0, 1] (1: lossless), got {self.kv_min_quality!r}")

    @property
    def greedy(self) -> bool:
        """Temperatures below ``MIN_TEMPERATURE`` (0 included) choose the argmax."""
        return self.temperature < MIN_TEMPERATURE


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
