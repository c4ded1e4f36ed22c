"""Transforms: invertible reshaping of KV values before quantisation.

All work on float32 tensors shaped [layers, 2, tokens, kv_heads, head_dim], on the input's device. ``gain`` bounds how much an
error in the transformed domain (max abs) can grow through ``decode`` (max abs), so the pipeline can state
an error bound for the whole chain.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import numpy as np
import torch

from .errors import SpecError
from .stage import Stage, check_int, register

Side = dict[str, np.ndarray | torch.Tensor]  # encode writes tensors on the input's device; decode may get either


class Transform(Stage):
    registry: ClassVar[dict[str, type]] = {}

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, Side]:
        raise NotImplementedError

    def decode(self, y: torch.Tensor, side: Side) -> torch.Tensor:
        raise NotImplementedError

    def gain(self, shape: tuple[int, ...], side: Side) -> float:
        return 1.0


@register(Transform)
@dataclass(frozen=True)
class Bypass(Transform):
    name: ClassVar[str] = "none"

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, Side]:
        return x, {}

    def decode(self, y: torch.Tensor, side: Side) -> torch.Tensor:
        return y


@register(Transform)
@dataclass(frozen=True)
class Delta(Transform):
    """Token-wise delta against an anchor every ``a`` tokens (CacheGen): errors never accumulate past one step."""

    name: ClassVar[str] = "delta"
    a: int = 16

    def __post_init__(self) -> None:
        check_int("delta anchor interval a", self.a, 1, 1 << 20)

    def _anchor(self, x: torch.Tensor) -> torch.Tensor:
        idx = (torch.arange(x.shape[2], device=x.device) // self.a) * self.a
        return x[:, :, idx]

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, Side]:
        y = x - self._anchor(x)
        y[:, :, :: self.a] = x[:, :, :: self.a]
        return y, {}

    def decode(self, y: torch.Tensor, side: Side) -> torch.Tensor:
        x = y + self._anchor(y)
        x[:, :, :: self.a] = y[:, :, :: self.a]
        return x

    def gain(self, shape: tuple[int, ...], side: Side) -> float:
        return 2.0  # anchor error + delta error


@lru_cache(maxsize=8)
def _hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


ROTATE = ("kv", "k")  # which of K|V a rotation applies to


@register(Transform)
@dataclass(frozen=True)
class Hadamard(Transform):
    """Orthonormal Hadamard rotation along head_dim (QuaRot): spreads outlier channels before quantising.

    ``on=k`` rotates the keys only (outlier channels live in K; values are left as they are)."""

    name: ClassVar[str] = "hadamard"
    on: str = "kv"

    def __post_init__(self) -> None:
        if self.on not in ROTATE:
            raise SpecError(f"hadamard: on must be one of {ROTATE}, got {self.on!r}")

    def _h(self, d: int) -> torch.Tensor:
        if d & (d - 1):
            raise SpecError(f"hadamard needs a power-of-two head_dim, got {d}")
        return _hadamard(d)

    def _hx(self, x: torch.Tensor) -> torch.Tensor:
        h = self._h(x.shape[-1]).to(x.device)
        if self.on == "kv":
            return x @ h
        return torch.cat([x[:, :1] @ h, x[:, 1:]], 1)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, Side]:
        return self._hx(x), {}

    def decode(self, y: torch.Tensor, side: Side) -> torch.Tensor:
        return self._hx(y)  # symmetric and orthogonal: its own inverse

    def gain(self, shape: tuple[int, ...], side: Side) -> float:
        return math.sqrt(shape[-1]) * (1 + 1e-5)


@register(Transform)
@dataclass(frozen=True)
class Affine(Transform):
    """Per-channel standardisation over tokens (SmoothQuant-like): equalises channel ranges for per-token quantisers."""

    name: ClassVar[str] = "affine"

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, Side]:
        mu = x.mean(dim=2, keepdim=True)
        sd = x.std(dim=2, keepdim=True, correction=0) if x.shape[2] > 1 else torch.ones_like(mu)
        sd = torch.where(sd > 1e-12, sd, torch.ones_like(sd))
        return (x - mu) / sd, {"mu": mu, "sd": sd}

    def decode(self, y: torch.Tensor, side: Side) -> torch.Tensor:
        return y * torch.as_tensor(side["sd"], device=y.device) + torch.as_tensor(side["mu"], device=y.device)

    def gain(self, shape: tuple[int, ...], side: Side) -> float:
        sd = torch.as_tensor(side["sd"])
        return float(sd.max()) * (1 + 1e-5) if sd.numel() else 1.0


KSCALE_EXP = 100  # |log2| of a key scale is clamped to this: scaled values stay normal float32 numbers


@register(Transform)
@dataclass(frozen=True)
class KeyScale(Transform):
    """Per-channel key scaling (KIVI/SmoothQuant-style): K of each (layer, head, channel) divided by a power of two
    near (max over tokens of |K|) ** ``a``, so per-token quantisation groups see balanced channel ranges.

    Scales are powers of two, so scaling and its inverse are exact in float32; V passes through. The side
    stream ``e`` holds the exponents + 128 as uint8, [layers, 1, 1, kv_heads, head_dim].
    """

    name: ClassVar[str] = "kscale"
    a: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.a, bool) or not isinstance(self.a, (int, float)) or not 0.0 <= self.a <= 1.0:
            raise SpecError(f"kscale: a must be a number in [0, 1], got {self.a!r}")

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, Side]:
        amax = x[:, :1].abs().amax(dim=2, keepdim=True)  # [L, 1, 1, H, D]
        e = torch.where(amax > 0, torch.log2(amax.clamp_min(1e-30)) * float(self.a), torch.zeros_like(amax))
        e = e.round().clamp(-KSCALE_EXP, KSCALE_EXP)
        y = x.clone()
        y[:, :1] = x[:, :1] * torch.exp2(-e)
        return y, {"e": (e + 128).to(torch.uint8)}

    @staticmethod
    def _exponents(side: Side, device: torch.device) -> torch.Tensor:
        raw = side["e"]
        t = raw if isinstance(raw, torch.Tensor) else torch.from_numpy(np.array(raw, dtype=np.uint8))
        e = t.to(device=device, dtype=torch.float32) - 128
        if e.numel() and float(e.abs().max()) > KSCALE_EXP:
            raise ValueError(f"kscale exponent {float(e.abs().max())} outside [-{KSCALE_EXP}, {KSCALE_EXP}]")
        return e

    def decode(self, y: torch.Tensor, side: Side) -> torch.Tensor:
        x = y.clone()
        x[:, :1] = y[:, :1] * torch.exp2(self._exponents(side, y.device))
        return x

    def gain(self, shape: tuple[int, ...], side: Side) -> float:
        e = self._exponents(side, torch.device("cpu"))
        return max(1.0, float(torch.exp2(e.max()))) if e.numel() else 1.0
