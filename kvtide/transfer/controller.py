"""Analytical profile selection (KVServe section 6.1).

A profile p = (cr_p, s_p, q_p); moving V bytes at bandwidth B costs T_p = T_model + V/s_p + V/(cr_p B), with
s_p the harmonic combination of encode and decode throughput. Decisions of this module:

* ``ratio`` may be below 1 (a codec can expand tiny inputs): such a profile is legal but never beneficial.
* Throughputs are > 0 and may be ``math.inf`` (no coding cost); quality is finite and >= 0 (relative
  accuracy may exceed 1 by noise); ``min_quality`` is in [0, 1] so BF16 (quality 1) is always feasible.
* ``select`` returns a ``Selection``: a Profile (compares and hashes equal to the profile it wraps) with
  ``predicted_time`` and ``slo_miss`` (True when nothing quality-feasible met the SLO and the fastest
  quality-feasible profile was returned anyway).
* Ties in T_p go to higher quality, then higher ratio, then input order (BF16 last).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np


def _pos(name: str, v: float, inf_ok: bool = True) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v <= 0 or (not inf_ok and math.isinf(v)):
        raise ValueError(f"{name} must be a positive{'' if inf_ok else ' finite'} number, got {v!r}")


@dataclass(frozen=True)
class Profile:
    """One operating point of a pipeline; ``name`` is usually its spec string."""

    name: str
    ratio: float
    encode_throughput: float
    decode_throughput: float
    quality: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("profile name must be a non-empty str")
        _pos(f"{self.name}: ratio", self.ratio, inf_ok=False)
        _pos(f"{self.name}: encode_throughput", self.encode_throughput)
        _pos(f"{self.name}: decode_throughput", self.decode_throughput)
        q = self.quality
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not math.isfinite(q) or q < 0:
            raise ValueError(f"{self.name}: quality must be finite and >= 0, got {q!r}")

    @property
    def throughput(self) -> float:
        """s_p = (1/enc + 1/dec)^-1 bytes/s, so V/s_p is the total coding time."""
        inv = 1.0 / self.encode_throughput + 1.0 / self.decode_throughput
        return math.inf if inv == 0 else 1.0 / inv

    def time(self, bandwidth: float, volume: float, model_time: float = 0.0) -> float:
        """T_p: model time + coding time + wire time for ``volume`` raw bytes."""
        wire = 0.0 if math.isinf(bandwidth) else volume / (self.ratio * bandwidth)
        return model_time + volume / self.throughput + wire

    def _key(self) -> tuple:
        return (self.name, self.ratio, self.encode_throughput, self.decode_throughput, self.quality)


BF16 = Profile("bf16", 1.0, math.inf, math.inf, 1.0)


@dataclass(frozen=True, eq=False)
class Selection(Profile):
    """The chosen profile plus why: its predicted T_p and whether the SLO had to be missed."""

    predicted_time: float = math.nan
    slo_miss: bool = False

    @property
    def profile(self) -> Profile:
        return Profile(*self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Profile) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(Profile(*self._key()))


def benefit_threshold(p: Profile) -> float:
    """B* = s_p (1 - 1/cr_p): compression beats sending BF16 iff bandwidth < B* (independent of V)."""
    gain = 1.0 - 1.0 / p.ratio
    if gain == 0.0:
        return 0.0
    return math.copysign(math.inf, gain) if math.isinf(p.throughput) else p.throughput * gain


def pareto_front(profiles: Iterable[Profile]) -> list[Profile]:
    """Profiles not dominated in (quality, ratio, throughput), all maximised; input order kept, exact
    duplicates all kept (neither dominates the other)."""
    ps = list(profiles)
    if not ps:
        return []
    m = np.array([[p.quality, p.ratio, p.throughput] for p in ps], dtype=np.float64)
    ge = (m[:, None, :] >= m[None, :, :]).all(-1)  # ge[j, i]: j >= i everywhere
    gt = (m[:, None, :] > m[None, :, :]).any(-1)
    dominated = (ge & gt).any(0)
    return [p for p, d in zip(ps, dominated) if not d]


def check_context(bandwidth: float, volume: float, slo: float | None, min_quality: float, model_time: float) -> None:
    _pos("bandwidth", bandwidth)
    for name, v in (("volume", volume), ("model_time", model_time)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
    if slo is not None and (isinstance(slo, bool) or not isinstance(slo, (int, float)) or math.isnan(slo) or slo < 0):
        raise ValueError(f"slo must be None or >= 0 seconds, got {slo!r}")
    if isinstance(min_quality, bool) or not isinstance(min_quality, (int, float)) or not 0.0 <= min_quality <= 1.0:
        raise ValueError(f"min_quality must be in [0, 1] (BF16 has quality 1), got {min_quality!r}")


def select(profiles: Sequence[Profile], bandwidth: float, volume: float, slo: float | None,
           min_quality: float, model_time: float = 0.0) -> Selection:
    """Least-T_p profile with quality >= min_quality and T_p <= slo; BF16 always competes.

    When no quality-feasible profile meets the SLO, the least-T_p one comes back with ``slo_miss=True``.
    """
    check_context(bandwidth, volume, slo, min_quality, model_time)
    best: tuple | None = None
    cands = list(profiles) + [BF16]
    for i, p in enumerate(cands):
        if not isinstance(p, Profile):
            raise TypeError(f"profiles must be Profile, got {type(p).__name__}")
        if p.quality < min_quality:
            continue
        t = p.time(bandwidth, volume, model_time)
        key = (t, -p.quality, -p.ratio, i)
        if best is None or key < best[0]:
            best = (key, p)
    assert best is not None  # BF16 is always quality-feasible
    (t, *_), p = best
    return Selection(*p._key(), predicted_time=t, slo_miss=slo is not None and t > slo)
