"""Next-token choice per row: greedy, or temperature / top-k / top-p with per-request seeded generators."""
from __future__ import annotations

import torch

from .sampling_params import SamplingParams


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Argmax per row, left on the logits' device (the next step reads it there; the host copy is the caller's)."""
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits: [S, V] float32 (one row per sequence that samples this step)."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k and p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            cum = sorted_p.cumsum(0)
            drop = (cum - sorted_p) >= p.top_p  # keep the smallest set whose mass reaches top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        gen = generators[i]
        if gen is not None and gen.device != probs.device:
            probs = probs.to(gen.device)
        out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return out
