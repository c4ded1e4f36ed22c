"""Inputs and the cost model of a restoration: requests, per-block costs, and the staircase objective.

Kept apart from the DP so baselines, tests and the executor can price any staircase with the same code
the planner optimises (CacheFlow §3.2 / appendix A.1, dense blocks, additive costs).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace
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
class ExecutorReplayTime:
    """F as the executor pays it, for one of ``batch`` requests planned together.

    The executor runs each layer once for every request that recomputes in it, so a layer call's fixed cost c
    (``call_overhead``; on a CPU mostly streaming the layer's weights) is paid once, not once per request: each
    request is charged F(t) - c (1 - 1/n) for t > 0, exact when the requests recompute in the same blocks (what
    the batch plans do) and never below F(t) - c. ``scale`` is the measured/modelled compute ratio
    (``LatencyProfile.compute_scale``). F(0) = 0; nondecreasing, and convex for t > 0 when F is.
    """

    base: ReplayTime
    call_overhead: float = 0.0
    batch: int = 1
    scale: float = 1.0
    vectorized: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if _as_int("batch", self.batch) < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        _as_pos_float("call_overhead", self.call_overhead, allow_zero=True)
        _as_pos_float("scale", self.scale)

    def __call__(self, t):  # type: ignore[no-untyped-def]
        share = self.call_overhead * (1.0 - 1.0 / self.batch)
        if np.ndim(t) == 0:
            v = float(self.base(t))
            return self.scale * max(v - share, 0.0) if float(t) > 0 else 0.0
        x = np.asarray(t)
        v = np.asarray(self.base(x) if getattr(self.base, "vectorized", False)
                       else [float(self.base(int(a))) for a in x.ravel()], dtype=np.float64).reshape(x.shape)
        if share:  # none for one request (v - 0.0 is v)
            v = v - share
        return np.where(x > 0, self.scale * np.maximum(v, 0.0), 0.0)


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
    """Per-block costs of a dense model: s bytes/token of KV, R bytes of fixed state, replay time F(t).

    Two optional terms make the prediction match an executor (both 0 by default: the paper's objective):

    * ``suffix_overhead`` c: seconds per block that the batch's suffix call costs beyond sum_r sigma_r. sigma_r =
      F(N + Ns) - F(N) is a difference, so the fixed cost of one more layer call (on a CPU: streaming the block's
      weights; on a GPU: launches) cancels out of it, yet the executor pays it once per block.
      It enters like sigma: compute P + L (sum sigma + c), load Q/B + sum sigma + c (only with suffix tokens).
    * ``fixed_seconds``: time of every restoration outside both paths (thread start, logits, final sync); added
      to the predicted total, it moves no boundary.
    * ``suffix_scale`` k: sigma_r is taken as k (F(N + Ns) - F(N)). F comes from replays from position 0 (its top
      knots possibly from whole prefills), so a long suffix call need not run at that difference, and a sigma that
      is too high makes the plan load everything where recomputing part would be free.
    * ``decode_seconds_per_token`` t: seconds the load path spends decoding each loaded token of a block (entries
      stored under a KVServe profile; 0 for plain and ZipFusion entries): the load side is Q/B + t * sum (N - j),
      i.e. each token loads at s + t B bytes' worth of link time (``load_bytes_per_token``).
    """

    num_blocks: int
    kv_bytes_per_token: float
    state_bytes: float = 0.0
    replay_time: ReplayTime = field(default_factory=AnalyticReplayTime)
    suffix_overhead: float = 0.0
    fixed_seconds: float = 0.0
    suffix_scale: float = 1.0
    decode_seconds_per_token: float = 0.0

    def __post_init__(self) -> None:
        n = _as_int("num_blocks", self.num_blocks)
        if n < 1:
            raise ValueError(f"num_blocks must be >= 1, got {n}")
        object.__setattr__(self, "num_blocks", n)
        object.__setattr__(self, "kv_bytes_per_token", _as_pos_float("kv_bytes_per_token", self.kv_bytes_per_token))
        object.__setattr__(self, "state_bytes", _as_pos_float("state_bytes", self.state_bytes, allow_zero=True))
        for name in ("suffix_overhead", "fixed_seconds", "decode_seconds_per_token"):
            object.__setattr__(self, name, _as_pos_float(name, getattr(self, name), allow_zero=True))
        object.__setattr__(self, "suffix_scale", _as_pos_float("suffix_scale", self.suffix_scale))
        if not callable(self.replay_time):
            raise TypeError("replay_time must be callable F(tokens) -> seconds")
        f0 = float(self.replay_time(0))
        if not math.isfinite(f0) or abs(f0) > 1e-12:
            raise ValueError(f"replay_time(0) must be 0 (nothing to replay), got {f0!r}")

    def load_bytes_per_token(self, bandwidth: float) -> float:
        """s + t B: a loaded token's link bytes plus its decode time in bytes of the link (what the solvers use)."""
        return self.kv_bytes_per_token + self.decode_seconds_per_token * bandwidth

    def transfer_bytes(self, cached_tokens: int, boundary: int) -> float:
        """d(j) = s (N - j) + R [j < N]: bytes one block loads when it recomputes [0, j)."""
        if boundary >= cached_tokens:
            return 0.0
        return self.kv_bytes_per_token * (cached_tokens - boundary) + self.state_bytes


def replay_times(fn: ReplayTime, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """F at many token counts, validated (finite, >= 0, nondecreasing) and made monotone.

    A callable with a truthy ``vectorized`` attribute is called once on the array as given (profiles are; the
    planner calls this on every plan, so it stays a few numpy calls); others once per distinct count.
    """
    t = np.asarray(tokens, dtype=np.int64)
    if t.size == 0:
        return np.zeros(0)
    flat = t.ravel()
    if getattr(fn, "vectorized", False):
        vals = np.asarray(fn(flat), dtype=np.float64).reshape(flat.shape)
    else:
        uniq, inv = np.unique(flat, return_inverse=True)
        u = np.fromiter((float(fn(int(x))) for x in uniq), dtype=np.float64, count=uniq.size)
        vals = u[inv.ravel()]
    # the values at argmin/argmax, not min()/max(): a ufunc reduction costs several times more on arrays this small
    # (the planner calls this on every plan); both pick a NaN, which fails both tests
    if not (vals[vals.argmin()] >= 0 and vals[vals.argmax()] < np.inf):
        raise ValueError("replay_time must return finite values >= 0")
    if flat.size > 1:
        order = flat.argsort(kind="stable")  # equal counts keep their order; cheaper than testing for sorted input
        sv = vals[order]
        if np.count_nonzero(sv[1:] < sv[:-1]):  # no NaN here: the same test as "not all >="
            drop = sv[1:] - sv[:-1]
            scale = max(float(sv.max()), 1e-300)
            if (drop < -1e-9 * scale).any():
                i = int(np.argmin(drop))
                st = flat[order]
                raise ValueError(
                    f"replay_time must be nondecreasing: F({st[i]})={sv[i]!r} > F({st[i + 1]})={sv[i + 1]!r}"
                )
            vals = np.empty_like(vals)
            vals[order] = np.maximum.accumulate(sv)
    return vals.reshape(t.shape)


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
    suffix_seconds_per_block: float  # sum_r sigma_r (+ the suffix call's overhead)
    per_request: tuple[RequestCost, ...]
    fixed_seconds: float = 0.0

    @property
    def total_seconds(self) -> float:
        return max(self.compute_seconds, self.load_seconds) + self.fixed_seconds


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
    N: np.ndarray, J: np.ndarray, FJ: np.ndarray, sigma: np.ndarray, cost: BlockCost, bandwidth: float,
    has_suffix: bool = False, sig: float | None = None,
) -> StaircaseCost:
    """Objective parts from arrays: N [r], boundaries J and their F values FJ [r, block], sigma [r]; ``sig``, the
    suffix seconds per block (sum sigma + the suffix call), where the caller has it already (the planner does)."""
    s, R = cost.kv_bytes_per_token, cost.state_bytes
    Nc = N[:, None]
    # recompute seconds and load bytes per [request, block] side by side, so that each level of sums is one numpy
    # call (their fixed cost dominates at these sizes); every row is still summed alone: the same floats
    parts = np.empty((2,) + J.shape)
    parts[0] = FJ
    loaded = Nc - J
    if R:
        parts[1] = s * loaded + R * (J < Nc)
    else:  # the same floats, fewer numpy calls
        np.multiply(s, loaded, out=parts[1])
    rows = parts.sum(2)  # [P_r, Q_r]
    (P, Q), (P_r, Q_r) = rows.sum(1).tolist(), rows.tolist()
    L = J.shape[1]
    per = tuple(
        RequestCost(
            recompute_seconds=p,
            load_bytes=q,
            load_seconds=q / bandwidth,
            suffix_seconds_per_block=sg,
            recomputed_tokens=rt,
            loaded_tokens=L * n - rt,  # sum of N - j, exactly (integers)
        )  # Python scalars from .tolist(): batches are small and indexing arrays per field costs more
        for p, q, sg, rt, n in zip(P_r, Q_r, sigma.tolist(), J.sum(1).tolist(), N.tolist())
    )
    t = cost.decode_seconds_per_token
    if t:  # the decode of every loaded token, on the load path
        per = tuple(replace(rc, load_seconds=rc.load_seconds + t * rc.loaded_tokens) for rc in per)
    if sig is None:
        sig = float(sigma.sum()) + suffix_call(cost, sigma.size > 0 and has_suffix)
    return StaircaseCost(
        compute_seconds=P + cost.num_blocks * sig,
        load_seconds=Q / bandwidth + sig + (t * sum(rc.loaded_tokens for rc in per) if t else 0.0),
        recompute_seconds=P,
        load_bytes=Q,
        suffix_seconds_per_block=sig,
        per_request=per,
        fixed_seconds=cost.fixed_seconds,
    )


def suffix_call(cost: BlockCost, has_suffix: bool) -> float:
    """Seconds per block the suffix call adds beyond sum_r sigma_r (once per block, when there is a suffix)."""
    return cost.suffix_overhead if has_suffix else 0.0


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
    sigma = (vals[n + N.size :] - vals[n : n + N.size]) * cost.suffix_scale
    return price_staircase(N, J, FJ, sigma, cost, bandwidth, bool((Ns > 0).any()))
