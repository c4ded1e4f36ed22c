"""KVServe pipelines as the codec of store entries kept under a profile (``kvtide.store.profile_entry``).

The store knows no pipeline (it sits below ``transfer``): importing this module registers the pipelines with it.
An entry [2, tokens, kv_heads, head_dim] is coded as one layer, [1, 2, tokens, kv_heads, head_dim]; decoding bounds
the values the container may declare by the entry's size before anything is allocated.
"""
from __future__ import annotations

from typing import Any

import torch

from ..store import profile_entry
from .pipeline import Pipeline

_PIPES: dict[str, Pipeline] = {}


def pipeline(spec: str) -> Pipeline:
    """The pipeline of ``spec``, built once per spec (building parses the spec and its stages)."""
    p = _PIPES.get(spec)
    if p is None:
        p = Pipeline(spec)
        if len(_PIPES) < 64:
            _PIPES[spec] = p
    return p


class PipelineCodec:
    def encode(self, kv: torch.Tensor, spec: str) -> bytes:
        return pipeline(spec).encode(kv[None])

    def decode(self, blob: Any, spec: str, max_values: int, device: Any) -> torch.Tensor:
        data = blob if isinstance(blob, (bytes, bytearray, memoryview)) else bytes(blob)
        return pipeline(spec).decode(data, max_values=max_values, device=device)


profile_entry.register_codec(PipelineCodec())
