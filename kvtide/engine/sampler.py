"""Next-token choice per row: greedy, or temperature / top-k / top-p with per-request seeded generators.

A row whose logits hold NaN or +-Inf everywhere that matters (or whose probabilities come out non-finite) gets
``BAD_TOKEN`` instead of a token: the engine ends that request with an error and the rest of the batch goes on.
"""
from __future__ import annotations

import torch

from .sampling_params import SamplingParams

# A sampled "token" meaning: this row's logits were not finite. Never an input id (the engine finishes the request).
BAD_TOKEN = -2


def greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax per row, the same with ``BAD_TOKEN`` where the row's maximum is not finite), on the logits' device.

    The first feeds the next step's input ids (in range even for a bad row, whose request is ended when its token
    reaches the host); the second is what the host reads. One ``max`` gives both the index and the NaN check."""
    values, tokens = logits.max(dim=-1)
    return tokens, torch.where(torch.isfinite(values), tokens, BAD_TOKEN)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits: [S, V] (one row per sequence that samples this step); ``BAD_TOKEN`` for a row that cannot be sampled."""
    values, best = logits.max(dim=-1)
    out = torch.where(torch.isfinite(values), best, BAD_TOKEN).tolist()
    for i, p in enumerate(params):
        if p.greedy or out[i] == BAD_TOKEN:
            continue
        row = logits[i].float() / p.temperature
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
        if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
            out[i] = BAD_TOKEN
            continue
        gen = generators[i]
        if gen is not None and gen.device != probs.device:
            probs = probs.to(gen.device)
        out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return out
