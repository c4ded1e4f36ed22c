"""Inputs and the cost model of a restoration: requests, per-block costs, and the staircase objective.

Kept apart from the DP so baselines, tests and the executor can price any staircase with the same code
the planner optimises (CacheFlow §3.2 / appendix A.1, dense blocks, additive costs).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Sequence

import numpy as np

ReplayTime = Callable[[int], float]


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def _as_pos_float(name: str, value: object, *, allow_zero: bool = False) -> float:
    v = float(value)  # type: ignore[arg-type]
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return v


@dataclass(frozen=True)
class AnalyticReplayTime:
    """Placeholder F(t) (overhead + linear + quadratic) until an online profile has data.

    The overhead makes F(0)=0 but F(t>0) >= overhead: the per-call cost that favours layer-wise plans.
    """

    overhead: float = 2e-5
    per_token: float = 2e-6
    per_token_sq: float = 1e-10
    vectorized: ClassVar[bool] = True

    def __call__(self, t):  # type: ignore[no-untyped-def]
        x = np.asarray(t, dtype=np.float64)
        out = np.where(x > 0, self.overhead + self.per_token * x + self.per_token_sq * x * x, 0.0)
        return float(out) if out.ndim == 0 else out


@dataclass(frozen=True)
class RestoreRequest:
    """One request: N cached prefix tokens to restore, plus N_s uncached suffix tokens to prefill."""

    cached_tokens: int
    suffix_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("cached_tokens", "suffix_tokens"):
            v = _as_int(name, getattr(self, name))
            if v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
            object.__setattr__(self, name, v)


@dataclass(frozen=True)
class BlockCost:
    """Per-block costs of a dense model: s bytes/token of KV, R bytes of fixed state, replay time F(t)."""

    num_blocks: int
    kv_bytes_per_token: float
    state_bytes: float = 0.0
    replay_time: ReplayTime = field(default_factory=AnalyticReplayTime)

    def __post_init__(self) -> None:
        n = _as_int("num_blocks", self.num_blocks)
        if n < 1:
            raise ValueError(f"num_blocks must be >= 1, got {n}")
        object.__setattr__(self, "num_blocks", n)
        object.__setattr__(self, "kv_bytes_per_token", _as_pos_float("kv_bytes_per_token", self.kv_bytes_per_token))
        object.__setattr__(self, "state_bytes", _as_pos_float("state_bytes", self.state_bytes, allow_zero=True))
        if not callable(self.replay_time):
            raise TypeError("replay_time must be callable F(tokens) -> seconds")
        f0 = float(self.replay_time(0))
        if not math.isfinite(f0) or abs(f0) > 1e-12:
            raise ValueError(f"replay_time(0) must be 0 (nothing to replay), got {f0!r}")

    def transfer_bytes(self, cached_tokens: int, boundary: int) -> float:
        """d(j) = s (N - j) + R [j < N]: bytes one block loads when it recomputes [0, j)."""
        if boundary >= cached_tokens:
            return 0.0
        return self.kv_bytes_per_token * (cached_tokens - boundary) + self.state_bytes


def replay_times(fn: ReplayTime, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """F at many token counts, validated (finite, >= 0, nondecreasing) and made monotone.

    A callable with a truthy ``vectorized`` attribute is called once on an array (profiles are).
    """
    t = np.asarray(tokens, dtype=np.int64)
    if t.size == 0:
        return np.zeros(0)
    uniq, inv = np.unique(t, return_inverse=True)
    if getattr(fn, "vectorized", False):
        vals = np.asarray(fn(uniq), dtype=np.float64).reshape(uniq.shape)
    else:
        vals = np.fromiter((float(fn(int(x))) for x in uniq), dtype=np.float64, count=uniq.size)
    if not np.all(np.isfinite(vals)) or np.any(vals < 0):
        raise ValueError("replay_time must return finite values >= 0")
    if uniq.size > 1:
        drop = np.diff(vals)
        scale = max(float(vals.max()), 1e-300)
        if np.any(drop < -1e-9 * scale):
            i = int(np.argmin(drop))
            raise ValueError(
                f"replay_time must be nondecreasing: F({uniq[i]})={vals[i]!r} > F({uniq[i + 1]})={vals[i + 1]!r}"
            )
        vals = np.maximum.accumulate(vals)
    return vals[inv].reshape(t.shape)


@dataclass(frozen=True)
class RequestCost:
    """One request's share of a staircase: recompute seconds, load bytes/seconds, suffix time per block."""

    recompute_seconds: float
    load_bytes: float
    load_seconds: float
    suffix_seconds_per_block: float
    recomputed_tokens: int  # sum over blocks of j_i
    loaded_tokens: int  # sum over blocks of N - j_i


@dataclass(frozen=True)
class StaircaseCost:
    """The objective's parts: compute = P + L*sum(sigma), load = Q/B + sum(sigma), total = max."""

    compute_seconds: float
    load_seconds: float
    recompute_seconds: float  # P
    load_bytes: float  # Q
    suffix_seconds_per_block: float  # sum_r sigma_r
    per_request: tuple[RequestCost, ...]

    @property
    def total_seconds(self) -> float:
        return max(self.compute_seconds, self.load_seconds)


def validate_staircase(
    requests: Sequence[RestoreRequest], boundaries: Sequence[Sequence[int]], num_blocks: int, chunk: int | None
) -> list[list[int]]:
    """Check shape, order and grid of a staircase; returns it as plain int lists."""
    if len(boundaries) != len(requests):
        raise ValueError(f"need one boundary list per request: {len(boundaries)} != {len(requests)}")
    out: list[list[int]] = []
    for r, (req, js) in enumerate(zip(requests, boundaries)):
        js = [_as_int("boundary", j) for j in js]
        n = req.cached_tokens
        if len(js) != num_blocks:
            raise ValueError(f"request {r}: need {num_blocks} boundaries, got {len(js)}")
        for i, j in enumerate(js):
            if not 0 <= j <= n:
                raise ValueError(f"request {r} block {i}: boundary {j} outside [0, {n}]")
            if chunk is not None and j != n and j % chunk:
                raise ValueError(f"request {r} block {i}: boundary {j} not on the {chunk}-token grid nor = N")
            if i and j > js[i - 1]:
                raise ValueError(f"request {r}: boundaries must be non-increasing in the block index, got {js}")
        out.append(js)
    return out


def evaluate_staircase(
    requests: Sequence[RestoreRequest],
    boundaries: Sequence[Sequence[int]],
    cost: BlockCost,
    bandwidth: float,
    chunk: int | None = None,
) -> StaircaseCost:
    """Price any staircase under the planner's model (used by the planner itself, baselines and tests)."""
    bandwidth = _as_pos_float("bandwidth", bandwidth)
    js = validate_staircase(requests, boundaries, cost.num_blocks, chunk)
    pts: list[int] = []
    for req, row in zip(requests, js):
        pts.extend(row)
        pts.append(req.cached_tokens)
        pts.append(req.cached_tokens + req.suffix_tokens)
    vals = replay_times(cost.replay_time, pts)
    k = 0
    per: list[RequestCost] = []
    for req, row in zip(requests, js):
        L = len(row)
        p = float(vals[k : k + L].sum())
        sigma = float(vals[k + L + 1] - vals[k + L])
        k += L + 2
        q = sum(cost.transfer_bytes(req.cached_tokens, j) for j in row)
        per.append(
            RequestCost(
                recompute_seconds=p,
                load_bytes=q,
                load_seconds=q / bandwidth,
                suffix_seconds_per_block=sigma,
                recomputed_tokens=sum(row),
                loaded_tokens=sum(req.cached_tokens - j for j in row),
            )
        )
    P = sum(x.recompute_seconds for x in per)
    Q = sum(x.load_bytes for x in per)
    sig = sum(x.suffix_seconds_per_block for x in per)
    L = cost.num_blocks
    return StaircaseCost(
        compute_seconds=P + L * sig,
        load_seconds=Q / bandwidth + sig,
        recompute_seconds=P,
        load_bytes=Q,
        suffix_seconds_per_block=sig,
        per_request=tuple(per),
    )
