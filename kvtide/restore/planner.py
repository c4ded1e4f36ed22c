"""Batch-aware staircase planner (CacheFlow §3.2, appendix A.1).

Each (request r, block i) recomputes tokens [0, j_ri) and loads [j_ri, N_r). With P = sum F(j_ri),
Q = sum d_r(j_ri), sigma_r = F(N_r + Ns_r) - F(N_r), the plan minimises

    T = max(P + L * sum_r sigma_r,  Q / B + sum_r sigma_r).

Costs are additive and blocks identical, so the order of boundaries does not change T: any multiset of
boundaries sorts into a valid staircase. The planner therefore searches multisets and sorts at the end.

Two exact solvers of the same quantised problem:

* ``dp`` -- the paper's DP: for each achievable avoided transfer x (in units of s*tau bytes, tau =
  gcd(C, all N_r), so every KV amount is exact and only R is rounded), the least recompute D[x], over all
  (request, block) items; then argmin over x of the objective, choosing between states by their exact bytes.
  Work ~ sum over items of (states so far) x (grid points); above ``max_dp_work`` the unit is coarsened to
  whole chunks (1, 2, 4, ... chunks), which the returned ``quantisation_bound_seconds`` accounts for.
* ``fast`` -- used when R = 0, every N_r is a multiple of C and f(c) = F(cC) is convex on c >= 1 (F convex
  for t > 0 with any per-call overhead jump at 0, which is what a profile of overhead + attention gives).
  Then, for a fixed number k of blocks that recompute anything, the best such blocks are the k with the
  largest caps and the least recompute for a given avoided amount is water-filling (all levels within one
  chunk), which is convex in x; the objective is minimised by a vectorised binary search on the level,
  for all k at once. O((#requests * L) * #requests * log K) numpy work; exact.

Quantisation bound (appendix A.1, Theorem 4, generalised to a batch and to per-choice rounding): if
e_r(j) = (rounded avoided bytes) - (exact avoided bytes) for grid point j of request r, the returned plan
satisfies T(plan) <= T*_C + sum_r L * (max_j e_r(j)^+ + max_j e_r(j)^-) / B, where T*_C is the best
staircase on the chunk grid. With only R rounded (tau divides every N_r) this is sum_r L |e_r| / B with
|e_r| <= s*tau/2 <= s*C/2: the paper's L|e|/B per request. It is 0 when R = 0.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kvtide.restore.costs import (
    AnalyticReplayTime,
    BlockCost,
    RequestCost,
    RestoreRequest,
    StaircaseCost,
    _as_int,
    _as_pos_float,
    evaluate_staircase,
    replay_times,
)

__all__ = [
    "AnalyticReplayTime",
    "BlockCost",
    "Plan",
    "RestoreRequest",
    "evaluate",
    "plan",
]

DEFAULT_MAX_DP_WORK = 20_000_000


@dataclass
class Plan:
    """A staircase per request plus what the model predicts for it."""

    boundaries: list[list[int]]
    predicted_seconds: float
    predicted_compute_seconds: float = 0.0  # P + L * sum(sigma)
    predicted_load_seconds: float = 0.0  # Q / B + sum(sigma)
    recompute_seconds: float = 0.0  # P
    load_bytes: float = 0.0  # Q
    per_request: list[RequestCost] = field(default_factory=list)
    method: str = ""
    exact: bool = True  # optimal over every staircase on the chunk grid
    quantisation_bound_seconds: float = 0.0
    planning_seconds: float = 0.0
    chunk: int = 0

    @classmethod
    def from_cost(cls, boundaries: list[list[int]], c: StaircaseCost, **kw: object) -> "Plan":
        return cls(
            boundaries=boundaries,
            predicted_seconds=c.total_seconds,
            predicted_compute_seconds=c.compute_seconds,
            predicted_load_seconds=c.load_seconds,
            recompute_seconds=c.recompute_seconds,
            load_bytes=c.load_bytes,
            per_request=list(c.per_request),
            **kw,  # type: ignore[arg-type]
        )


def evaluate(
    requests: Sequence[RestoreRequest],
    boundaries: Sequence[Sequence[int]],
    cost: BlockCost,
    bandwidth: float,
    chunk: int | None = None,
) -> StaircaseCost:
    """Objective of any staircase (same model as ``plan``); ``.total_seconds`` is T."""
    return evaluate_staircase(requests, boundaries, cost, bandwidth, chunk)


@dataclass
class _Setup:
    """Per-batch numbers shared by both solvers."""

    N: np.ndarray  # cached tokens per request
    L: int
    s: float
    R: float
    B: float
    C: int
    c1: float  # L * sum sigma
    c2: float  # sum sigma
    A0: float  # bytes loaded if everything is loaded


def plan(
    requests: Sequence[RestoreRequest],
    cost: BlockCost,
    bandwidth: float,
    chunk: int,
    *,
    method: str = "auto",
    max_dp_work: int = DEFAULT_MAX_DP_WORK,
) -> Plan:
    """Optimal staircase per request for a batch sharing one compute resource and one link."""
    t0 = time.perf_counter()
    requests = list(requests)
    for r in requests:
        if not isinstance(r, RestoreRequest):
            raise TypeError(f"requests must be RestoreRequest, got {type(r).__name__}")
    if not isinstance(cost, BlockCost):
        raise TypeError(f"cost must be a BlockCost, got {type(cost).__name__}")
    B = _as_pos_float("bandwidth", bandwidth)
    C = _as_int("chunk", chunk)
    if C <= 0:
        raise ValueError(f"chunk must be > 0 tokens, got {C}")
    if method not in ("auto", "fast", "dp"):
        raise ValueError(f"method must be 'auto', 'fast' or 'dp', got {method!r}")
    L = cost.num_blocks
    if not requests:
        return Plan(boundaries=[], predicted_seconds=0.0, method="empty", chunk=C)

    N = np.array([r.cached_tokens for r in requests], dtype=np.int64)
    Ns = np.array([r.suffix_tokens for r in requests], dtype=np.int64)
    s, R = cost.kv_bytes_per_token, cost.state_bytes
    kmax = int(-(-N.max() // C))
    grid_tokens = np.minimum(np.arange(kmax + 1, dtype=np.int64) * C, N.max())
    allf = replay_times(cost.replay_time, np.concatenate([grid_tokens, N, N + Ns]))
    f_grid = allf[: kmax + 1]
    fN = allf[kmax + 1 : kmax + 1 + len(N)]
    fNs = allf[kmax + 1 + len(N) :]
    sig = float((fNs - fN).sum())
    A0 = float(L * (s * N + R * (N > 0)).sum())
    st = _Setup(N=N, L=L, s=s, R=R, B=B, C=C, c1=L * sig, c2=sig, A0=A0)

    use_fast = method == "fast" or (method == "auto" and _fast_applies(st, f_grid))
    if use_fast:
        if not _fast_applies(st, f_grid):
            raise ValueError("method='fast' needs R == 0, N_r % chunk == 0 and F convex on the grid for t > 0")
        counts = _solve_fast(st, f_grid)
        bound = 0.0
        name = "fast"
    else:
        counts, bound = _solve_dp(st, f_grid, fN, max_dp_work)
        name = "dp"
    boundaries = [
        sorted((min(int(c) * C, int(n)) for c in row), reverse=True) for row, n in zip(counts, N.tolist())
    ]
    ev = evaluate_staircase(requests, boundaries, cost, B, C)
    return Plan.from_cost(
        boundaries,
        ev,
        method=name,
        exact=bound == 0.0,
        quantisation_bound_seconds=bound,
        planning_seconds=time.perf_counter() - t0,
        chunk=C,
    )


# ---------------------------------------------------------------------------------------------- fast path


def _fast_applies(st: _Setup, f: np.ndarray) -> bool:
    if st.R != 0.0 or np.any(st.N % st.C):
        return False
    h = f[1:]
    if h.size < 3:
        return True
    d2 = np.diff(h, 2)
    return bool(np.all(d2 >= -1e-12 * max(float(h[-1]), 1e-300)))


def _solve_fast(st: _Setup, f: np.ndarray) -> list[list[int]]:
    """Exact for setup-convex f: min over k (blocks that recompute) of a convex water-filling problem."""
    L, C = st.L, st.C
    K = (st.N // C).astype(np.int64)
    order = np.argsort(-K, kind="stable")
    Kg = K[order]
    on_groups = int((Kg > 0).sum())
    if on_groups == 0:
        return [[0] * L for _ in st.N]
    capp = Kg[:on_groups] - 1  # shifted caps: an on-block holds 1 + min(capp, level) chunks
    h = f[1:]  # h[c'] = F((c'+1) C)
    dh = np.diff(h)
    S_B = st.s * C / st.B  # seconds of load per avoided chunk unit
    ks = np.arange(on_groups * L + 1, dtype=np.int64)
    m = np.clip(ks[:, None] - np.arange(on_groups)[None, :] * L, 0, L)  # on-blocks per group, [k, g]
    qtop = int(capp[0])

    def level(q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lev = np.minimum(capp[None, :], q[:, None])
        X = ks + (m * lev).sum(1)
        comp = (m * h[lev]).sum(1) + st.c1
        load = (st.A0 - st.s * C * X) / st.B + st.c2
        return X, comp, load

    lo = np.zeros_like(ks)
    hi = np.full_like(ks, qtop + 1)
    while True:
        act = lo < hi
        if not act.any():
            break
        mid = (lo + hi) // 2
        _, comp, load = level(np.minimum(mid, qtop))
        ok = comp >= load
        hi = np.where(act & ok, mid, hi)
        lo = np.where(act & ~ok, mid + 1, lo)
    qs = lo  # first level where compute >= load (qtop + 1: never)
    base = np.clip(qs - 1, 0, qtop)
    X0, comp0, load0 = level(base)
    inner = (qs >= 1) & (qs <= qtop)
    seg = (m * (capp[None, :] >= np.minimum(qs, qtop)[:, None])).sum(1)
    slope_c = np.where(inner, dh[np.clip(base, 0, max(len(dh) - 1, 0))] if len(dh) else 0.0, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        tstar = np.where(inner, (load0 - comp0) / (slope_c + S_B), 0.0)
    t_lo = np.clip(np.floor(tstar), 0, np.where(inner, seg, 0))
    t_hi = np.clip(np.ceil(tstar), 0, np.where(inner, seg, 0))

    def obj(t: np.ndarray) -> np.ndarray:
        return np.maximum(comp0 + t * slope_c, load0 - t * S_B)

    T_lo, T_hi = obj(t_lo), obj(t_hi)
    t_best = np.where(T_hi < T_lo, t_hi, t_lo).astype(np.int64)
    T = np.minimum(T_lo, T_hi)
    kb = int(np.argmin(T))
    q, extra = int(base[kb]), int(t_best[kb])

    counts = np.zeros((len(st.N), L), dtype=np.int64)
    left = kb
    for g in range(on_groups):
        r = int(order[g])
        n_on = min(L, left)
        left -= n_on
        cg = int(capp[g])
        vals = np.zeros(L, dtype=np.int64)
        vals[:n_on] = 1 + min(cg, q)
        if cg > q and extra:
            add = min(extra, n_on)
            vals[:add] += 1
            extra -= add
        counts[r] = vals
    return counts.tolist()


# ------------------------------------------------------------------------------------------------ the DP


def _solve_dp(st: _Setup, f: np.ndarray, fN: np.ndarray, max_work: int) -> tuple[list[list[int]], float]:
    """The paper's DP over all (request, block) items; returns grid indices per item and the bound."""
    L, C, s = st.L, st.C, st.s
    tau = int(np.gcd.reduce(np.concatenate([[C], st.N])))
    # Per request: grid points (tokens), their recompute cost and exact avoided bytes a(j) = d(0) - d(j).
    grids: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for r, n in enumerate(st.N.tolist()):
        if n == 0:
            grids.append((np.zeros(1, np.int64), np.zeros(1), np.zeros(1)))
            continue
        kk = -(-n // C)
        tok = np.minimum(np.arange(kk + 1, dtype=np.int64) * C, n)
        cost = f[: kk + 1].copy()
        cost[-1] = fN[r]
        avoided = s * tok.astype(np.float64)
        avoided[-1] += st.R
        grids.append((tok, cost, avoided))

    def units_for(unit_bytes: float) -> list[np.ndarray]:
        return [np.rint(a / unit_bytes).astype(np.int64) for (_, _, a) in grids]

    def work(us: list[np.ndarray]) -> int:
        total, length = 0, 1
        for u in us:
            for _ in range(L):
                total += length * len(u)
                length += int(u.max())
        return total

    # Exact units first; coarser whole-chunk units only when the DP would be too slow (bound accounts for it).
    for unit_tokens in [tau] + [C << i for i in range(48)]:
        us = units_for(s * unit_tokens)
        if work(us) <= max_work:
            break
    unit_bytes = s * unit_tokens

    bound = 0.0
    for (tok, cost, a), u in zip(grids, us):
        e = u * unit_bytes - a
        bound += L * (max(float(e.max()), 0.0) + max(float(-e.min()), 0.0)) / st.B

    D = np.zeros(1)
    X = np.zeros(1)  # exact avoided bytes of the plan that D holds
    choice_tables: list[np.ndarray] = []
    item_req: list[int] = []
    for r, ((tok, cost, a), u) in enumerate(zip(grids, us)):
        for _ in range(L):
            n_old = D.size
            n_new = n_old + int(u.max())
            Dn = np.full(n_new, np.inf)
            Xn = np.full(n_new, -np.inf)
            ch = np.full(n_new, -1, dtype=np.int32)
            for idx in range(len(u)):
                off = int(u[idx])
                cand = D + cost[idx]
                cx = X + a[idx]
                sl = slice(off, off + n_old)
                cur, curx = Dn[sl], Xn[sl]
                better = (cand < cur) | ((cand == cur) & (cx > curx))
                cur[better] = cand[better]
                curx[better] = cx[better]
                ch[sl][better] = idx
            D, X = Dn, Xn
            choice_tables.append(ch)
            item_req.append(r)
    finite = np.isfinite(D)
    T = np.where(finite, np.maximum(D + st.c1, (st.A0 - X) / st.B + st.c2), np.inf)
    x = int(np.argmin(T))
    counts: list[list[int]] = [[] for _ in grids]
    for ch, r in zip(reversed(choice_tables), reversed(item_req)):
        idx = int(ch[x])
        counts[r].append(idx)
        x -= int(us[r][idx])
    assert x == 0
    return counts, bound
