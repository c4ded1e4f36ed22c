"""A file cache of windows' BF16 prefix KV, so a profiling run pays each long prefix pass once per machine.

Keyed by the model's weights and config fingerprints and the prefix's token ids: other weights or other text
never hit. A file is read only when its size is within what the expected tensor needs (it is untrusted bytes:
it may be truncated or replaced) and used only when it decodes to the expected shape and dtype; anything else
is recomputed and rewritten. Writes are atomic (temp file + rename).
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from kvtide.models.fingerprint import config_fingerprint, model_fingerprint

log = logging.getLogger("kvtide")

CACHE_VERSION = 1
_SLACK = 1 << 16  # bytes of torch.save framing allowed beyond the tensor's own


class PrefixCache:
    """``get(model, ids, compute)``: the cached KV [layers, 2, P, kv_heads, head_dim] of prefix ``ids``."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.hits = self.misses = 0
        self._models: dict[int, str] = {}

    def _model_key(self, model: torch.nn.Module) -> str:
        if id(model) not in self._models:
            self._models[id(model)] = f"{model_fingerprint(model)}-{config_fingerprint(model.args)}"
        return self._models[id(model)]

    def path(self, model: torch.nn.Module, ids: torch.Tensor) -> Path:
        h = hashlib.sha256(f"kvtide-prefix-kv/v{CACHE_VERSION}/{self._model_key(model)}/".encode())
        h.update(ids.to(torch.int64).contiguous().numpy().tobytes())
        return self.dir / f"{h.hexdigest()[:40]}.pt"

    @staticmethod
    def expected_shape(model: torch.nn.Module, tokens: int) -> tuple[int, ...]:
        a = model.args
        return (a.num_layers, 2, tokens, a.num_kv_heads, a.head_dim)

    def _read(self, path: Path, shape: tuple[int, ...]) -> torch.Tensor | None:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return None
        if size > math.prod(shape) * 2 + _SLACK:
            log.warning("prefix cache: %s is %d bytes, more than a %s BF16 tensor needs; recomputing", path, size, shape)
            return None
        try:
            kv = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as ex:  # noqa: BLE001 - a damaged file is recomputed
            log.warning("prefix cache: %s unreadable (%s); recomputing", path, ex)
            return None
        if not isinstance(kv, torch.Tensor) or kv.dtype != torch.bfloat16 or tuple(kv.shape) != shape:
            log.warning("prefix cache: %s holds no BF16 tensor of shape %s; recomputing", path, shape)
            return None
        return kv

    def get(self, model: torch.nn.Module, ids: torch.Tensor, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        path = self.path(model, ids)
        shape = self.expected_shape(model, int(ids.numel()))
        kv = self._read(path, shape)
        if kv is not None:
            self.hits += 1
            return kv
        self.misses += 1
        kv = compute()
        if tuple(kv.shape) != shape or kv.dtype != torch.bfloat16:
            raise ValueError(f"computed prefix KV is {kv.dtype} {tuple(kv.shape)}, expected bfloat16 {shape}")
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(kv.contiguous().clone(), tmp)
        os.replace(tmp, path)
        return kv
