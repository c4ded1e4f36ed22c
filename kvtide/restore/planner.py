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
* ``single`` -- the ``fast`` conditions with one request (the common case): for each number k of blocks that
  recompute, water-filling makes the least recompute of m chunks k h(q) + e (h(q+1) - h(q)) (q = m // k, e = m % k),
  increasing and convex in m while the load falls linearly, so the best m sits where they cross: one [L, K]
  table of level crossings, a handful of numpy calls (~20 us), exact.
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
    price_staircase,
    replay_times,
    suffix_call,
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
    vals = replay_times(cost.replay_time, np.concatenate([grid_tokens, N, N + Ns]))  # one call: F may be a profile
    f_grid, fN, fNs = vals[: kmax + 1], vals[kmax + 1:kmax + 1 + N.size], vals[kmax + 1 + N.size:]
    if np.any(fNs < fN):
        raise ValueError("replay_time must be nondecreasing (F(N + Ns) < F(N))")
    sigma = (fNs - fN) * cost.suffix_scale
    has_suffix = bool((Ns > 0).any())
    sig = float(sigma.sum()) + suffix_call(cost, has_suffix)
    A0 = float(L * (s * N + R * (N > 0)).sum())
    st = _Setup(N=N, L=L, s=s, R=R, B=B, C=C, c1=L * sig, c2=sig, A0=A0)

    fast_ok = method != "dp" and _fast_applies(st, f_grid)
    if method == "fast" or (method == "auto" and fast_ok):
        if not fast_ok:
            raise ValueError("method='fast' needs R == 0, N_r % chunk == 0 and F convex on the grid for t > 0")
        counts = _solve_single(st, f_grid) if N.size == 1 and method == "auto" else _solve_fast(st, f_grid)
        bound = 0.0
        name = "fast"
    else:
        counts, bound = _solve_dp(st, f_grid, fN, max_dp_work)
        name = "dp"
    cnt = -np.sort(-np.asarray(counts, dtype=np.int64).reshape(len(requests), L), axis=1)
    J = np.minimum(cnt * C, N[:, None])
    FJ = np.where(J == N[:, None], fN[:, None], f_grid[np.minimum(cnt, kmax)])
    ev = price_staircase(N, J, FJ, sigma, cost, B, has_suffix)
    return Plan.from_cost(
        J.tolist(),
        ev,
        method=name,
        exact=bound == 0.0,
        quantisation_bound_seconds=bound,
        planning_seconds=time.perf_counter() - t0,
        chunk=C,
    )


# ---------------------------------------------------------------------------------------------- fast path


def _fast_applies(st: _Setup, f: np.ndarray) -> bool:
    if st.R != 0.0 or (st.N % st.C).any():
        return False
    h = f[1:]
    if h.size < 3:
        return True
    d2 = h[2:] - 2 * h[1:-1] + h[:-2]
    return bool((d2 >= -1e-12 * max(float(h[-1]), 1e-300)).all())


def _solve_single(st: _Setup, f: np.ndarray) -> list[list[int]]:
    """One request, ``fast`` conditions: min over k on-blocks and m chunks of max(compute, load), exactly.

    h[c-1] = F(cC) is the cost of a block that recomputes c >= 1 chunks; with k such blocks and m chunks in all,
    water-filling gives compute k h(q) + e (h(q+1) - h(q)) at q = m // k. At m = k q compute and load are
    tabulated for all (k, q); per k the crossing lies in the last segment [kq, k(q+1)] where compute <= load,
    and the best m there is the floor or ceil of the linear crossing.
    """
    L, C = st.L, st.C
    K = int(st.N[0] // C)
    if K == 0:
        return [[0] * L]
    u = st.s * C / st.B  # load seconds per chunk
    h = f[1:K + 1]
    k = np.arange(1, L + 1, dtype=np.float64)[:, None]  # [L, 1]
    q = np.arange(1, K + 1, dtype=np.float64)[None, :]  # [1, K]
    comp = st.c1 + k * h[None, :]  # at m = k q
    load = st.c2 + (L * K - k * q) * u
    below = comp <= load
    q0 = below.sum(1)  # levels q <= q0 have compute <= load (compute rises, load falls in q)
    qi = np.maximum(q0, 1).astype(np.int64)  # segment start level (q0 = 0: start at q = 1, m = k)
    kk = k[:, 0]
    dh = np.append(np.diff(h), np.inf)[qi - 1]  # slope per extra chunk above level qi (none above K)
    c0 = st.c1 + kk * h[qi - 1]
    l0 = st.c2 + (L * K - kk * qi) * u
    t = np.clip(np.maximum(l0 - c0, 0.0) / np.where(np.isfinite(dh), dh + u, np.inf), 0, np.where(qi < K, kk, 0))
    cand = np.stack([np.floor(t), np.ceil(t)])  # [2, L]
    cand = np.minimum(cand, np.where(qi < K, kk, 0)[None, :])
    dhc = np.where(np.isfinite(dh), dh, 0.0)
    T = np.maximum(c0 + cand * dhc, l0 - cand * u)  # [2, L]
    i = np.unravel_index(int(np.argmin(T)), T.shape)
    best = float(T[i])
    all_load = max(st.c1, st.c2 + L * K * u)
    if all_load <= best:
        return [[0] * L]
    nk, level, extra = int(i[1]) + 1, int(qi[i[1]]), int(cand[i])
    row = [level + 1] * extra + [level] * (nk - extra) + [0] * (L - nk)
    return [row]


def _solve_fast(st: _Setup, f: np.ndarray) -> list[list[int]]:
    """Exact for setup-convex f: min over k (blocks that recompute) of a convex water-filling problem.

    Items are grouped by cap K_r = N_r / C (largest first); for k on-blocks the on-set is the first k items.
    At level q every on-block holds 1 + min(K_g - 1, q) chunks; between levels q-1 and q the least
    recompute rises linearly (dh[q-1] per avoided chunk), so each k's optimum is at the level where
    compute overtakes load, refined to the best integer point inside that segment.
    """
    L, C = st.L, st.C
    K = (st.N // C).astype(np.int64)
    caps, counts_per_cap = np.unique(K[K > 0], return_counts=True)
    if caps.size == 0:
        return [[0] * L for _ in st.N]
    caps, sizes = caps[::-1], counts_per_cap[::-1] * L  # largest caps first
    capp = caps - 1
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    h = f[1:]  # h[c'] = F((c'+1) C)
    dh = np.diff(h) if h.size > 1 else np.zeros(1)
    unit_s = st.s * C / st.B  # seconds of load per avoided chunk
    ks = np.arange(int(sizes.sum()) + 1, dtype=np.int64)
    m = np.minimum(np.maximum(ks[:, None] - starts[None, :], 0), sizes[None, :]).astype(np.float64)  # [k, g]
    qtop = int(capp[0])
    kf = ks.astype(np.float64)

    # Crossing level per k: compute >= load  <=>  Psi_k(q) = sum_g m_kg psi(min(capp_g, q)) >= rhs_k with
    # psi(q) = h(q) + u q strictly increasing, so one searchsorted per k inside the right cap interval.
    psi = h + unit_s * np.arange(h.size)
    rhs = st.A0 / st.B + st.c2 - st.c1 - unit_s * kf
    ng = capp.size
    at_caps = psi[np.minimum(capp[:, None], capp[None, :])]  # [g, j]: psi(min(capp_g, capp_j))
    Psi_caps = (m[:, :, None] * at_caps[None, :, :]).sum(1)  # [k, j]
    ok = Psi_caps >= rhs[:, None] - 1e-12 * np.abs(rhs[:, None])
    # intervals in increasing q: j = ng-1 covers [0, capp_{ng-1}], j < ng-1 covers [capp_{j+1}+1, capp_j]
    first = np.where(ok[:, 0], ng - 1 - ok[:, ::-1].argmax(1), -1)  # ok is monotone: ok[:, 0] = any
    j = np.maximum(first, 0)
    lo_j = np.where(j == ng - 1, 0, capp[np.minimum(j + 1, ng - 1)] + 1)
    free = np.cumsum(m, 1)[ks, j]  # on-blocks still below their cap in interval j
    sat_all = np.cumsum((m * psi[capp][None, :])[:, ::-1], 1)[:, ::-1]  # [k, g]: sum_{g' >= g}
    sat = np.where(j + 1 < ng, sat_all[ks, np.minimum(j + 1, ng - 1)], 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        target = np.where(free > 0, (rhs - sat) / free, -np.inf)
    q_in = np.minimum(np.maximum(np.searchsorted(psi, target, side="left"), lo_j), capp[j])
    qs = np.where(first >= 0, q_in, qtop + 1)

    # Refine inside the segment below the crossing (and its neighbours, against rounding at the boundary);
    # rows are the three candidate base levels, columns k.
    base = np.minimum(np.maximum(qs[None, :] - np.array([[2], [1], [0]]), 0), qtop)
    lv = np.minimum(capp[None, None, :], base[:, :, None])
    X0 = kf + (m[None] * lv).sum(2)
    comp0 = (m[None] * h[lv]).sum(2) + st.c1
    load0 = (st.A0 - st.s * C * X0) / st.B + st.c2
    seg = (m[None] * (capp[None, None, :] > base[:, :, None])).sum(2)
    slope = np.where(seg > 0, dh[np.minimum(base, dh.size - 1)], 0.0)
    tstar = np.maximum(load0 - comp0, 0.0) / (slope + unit_s)
    tt = np.minimum(np.concatenate([np.floor(tstar), np.ceil(tstar)]), np.concatenate([seg, seg]))
    slope2, comp2, load2 = (np.concatenate([x, x]) for x in (slope, comp0, load0))
    Tt = np.maximum(comp2 + tt * slope2, load2 - tt * unit_s)  # [6, k]
    pick = Tt.argmin(0)
    T = Tt[pick, ks]
    best_base = np.concatenate([base, base])[pick, ks]
    best_t = tt[pick, ks].astype(np.int64)
    kb = int(np.argmin(T))
    q = int(best_base[kb])
    extra = int(best_t[kb])

    # Hand the chosen multiset back to requests: on-blocks go to the largest caps first.
    out = np.zeros((len(st.N), L), dtype=np.int64)
    left = kb
    for r in np.argsort(-K, kind="stable"):
        if left == 0 or K[r] == 0:
            break
        n_on = min(L, left)
        left -= n_on
        cg = int(K[r]) - 1
        out[r, :n_on] = 1 + min(cg, q)
        if cg > q and extra:
            add = min(extra, n_on)
            out[r, :add] += 1
            extra -= add
    return out.tolist()


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
    top = max(int(st.N.max()), C)
    for unit_tokens in [tau] + [C << i for i in range(48) if (C << i) <= 2 * top]:
        us = units_for(s * unit_tokens)
        if work(us) <= max_work:
            break
    unit_bytes = s * unit_tokens

    bound = 0.0
    for (tok, cost, a), u in zip(grids, us):
        e = u * unit_bytes - a
        e[np.abs(e) <= 1e-9 * float(a.max(initial=s))] = 0.0  # float noise of s*j, not a model rounding
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
