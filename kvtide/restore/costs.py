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
    flat = t.ravel()
    if flat.size == 1 or bool(np.all(flat[1:] > flat[:-1])):
        uniq, inv = flat, None  # already strictly increasing (the planner's grid): skip the sort
    else:
        uniq, inv = np.unique(flat, return_inverse=True)
    if getattr(fn, "vectorized", False):
        vals = np.asarray(fn(uniq), dtype=np.float64).reshape(uniq.shape)
    else:
        vals = np.fromiter((float(fn(int(x))) for x in uniq), dtype=np.float64, count=uniq.size)
    if not np.all(np.isfinite(vals)) or np.any(vals < 0):
        raise ValueError("replay_time must return finite values >= 0")
    if uniq.size > 1:
        drop = vals[1:] - vals[:-1]
        if np.any(drop < 0):
            scale = max(float(vals.max()), 1e-300)
            if np.any(drop < -1e-9 * scale):
                i = int(np.argmin(drop))
                raise ValueError(
                    f"replay_time must be nondecreasing: F({uniq[i]})={vals[i]!r} > F({uniq[i + 1]})={vals[i + 1]!r}"
                )
            vals = np.maximum.accumulate(vals)
    out = vals if inv is None else vals[inv.ravel()]
    return out.reshape(t.shape)


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
) -> np.ndarray:
    """Check shape, order and grid of a staircase; returns it as an int64 array [request, block]."""
    if len(boundaries) != len(requests):
        raise ValueError(f"need one boundary list per request: {len(boundaries)} != {len(requests)}")
    for r, js in enumerate(boundaries):
        if len(js) != num_blocks:
            raise ValueError(f"request {r}: need {num_blocks} boundaries, got {len(js)}")
    J = np.asarray(boundaries, dtype=np.int64).reshape(len(requests), num_blocks)
    if not np.array_equal(J, np.asarray(boundaries, dtype=np.float64).reshape(J.shape)):
        raise TypeError("boundaries must be integers")
    N = np.array([r.cached_tokens for r in requests], dtype=np.int64)[:, None]
    bad = (J < 0) | (J > N)
    if chunk is not None:
        bad |= (J != N) & (J % chunk != 0)
    if bad.any():
        r, i = map(int, np.argwhere(bad)[0])
        raise ValueError(
            f"request {r} block {i}: boundary {J[r, i]} must be in [0, {N[r, 0]}] and on the "
            f"{chunk}-token grid or equal to N"
        )
    if num_blocks > 1 and np.any(J[:, 1:] > J[:, :-1]):
        r = int(np.argwhere(np.any(J[:, 1:] > J[:, :-1], 1))[0, 0])
        raise ValueError(f"request {r}: boundaries must be non-increasing in the block index, got {J[r].tolist()}")
    return J


def price_staircase(
    N: np.ndarray, J: np.ndarray, FJ: np.ndarray, sigma: np.ndarray, cost: BlockCost, bandwidth: float
) -> StaircaseCost:
    """Objective parts from arrays: N [r], boundaries J and their F values FJ [r, block], sigma [r]."""
    s, R = cost.kv_bytes_per_token, cost.state_bytes
    Nc = N[:, None]
    P_r = FJ.sum(1)
    Q_r = (s * (Nc - J) + R * (J < Nc)).sum(1)
    rec_tok = J.sum(1)
    load_tok = (Nc - J).sum(1)
    per = tuple(
        RequestCost(
            recompute_seconds=float(P_r[i]),
            load_bytes=float(Q_r[i]),
            load_seconds=float(Q_r[i]) / bandwidth,
            suffix_seconds_per_block=float(sigma[i]),
            recomputed_tokens=int(rec_tok[i]),
            loaded_tokens=int(load_tok[i]),
        )
        for i in range(N.size)
    )
    P, Q, sig = float(P_r.sum()), float(Q_r.sum()), float(sigma.sum())
    return StaircaseCost(
        compute_seconds=P + cost.num_blocks * sig,
        load_seconds=Q / bandwidth + sig,
        recompute_seconds=P,
        load_bytes=Q,
        suffix_seconds_per_block=sig,
        per_request=per,
    )


def evaluate_staircase(
    requests: Sequence[RestoreRequest],
    boundaries: Sequence[Sequence[int]],
    cost: BlockCost,
    bandwidth: float,
    chunk: int | None = None,
) -> StaircaseCost:
    """Price any staircase under the planner's model (used by the planner itself, baselines and tests)."""
    bandwidth = _as_pos_float("bandwidth", bandwidth)
    J = validate_staircase(requests, boundaries, cost.num_blocks, chunk)
    N = np.array([r.cached_tokens for r in requests], dtype=np.int64)
    Ns = np.array([r.suffix_tokens for r in requests], dtype=np.int64)
    vals = replay_times(cost.replay_time, np.concatenate([J.ravel(), N, N + Ns]))
    n = J.size
    FJ = vals[:n].reshape(J.shape)
    sigma = vals[n + N.size :] - vals[n : n + N.size]
    return price_staircase(N, J, FJ, sigma, cost, bandwidth)
