"""Batch-aware staircase planner (CacheFlow §3.2, appendix A.1).

Each (request r, block i) recomputes tokens [0, j_ri) and loads [j_ri, N_r). With P = sum F(j_ri),
Q = sum d_r(j_ri), sigma_r = F(N_r + Ns_r) - F(N_r), the plan minimises

    T = max(P + L * sum_r sigma_r,  Q / B + sum_r sigma_r).

Costs are additive and blocks identical, so any multiset of boundaries sorts into a valid staircase: the planner
searches multisets and sorts at the end. Solvers of the same quantised problem: ``dp`` (the paper's DP, coarsened
above ``max_dp_work``), ``single`` (one request, exact) and ``fast`` (R = 0, chunk-aligned prefixes, convex F;
exact). Every plan carries ``quantisation_bound_seconds``, the most it can lose to the best staircase on the chunk
grid (appendix A.1, Theorem 4, generalised to a batch). How each solver works and why it is exact:
docs/design/planner.md.
"""

from __future__ import annotations

import functools
import itertools
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

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
_BASE_OFFSETS = np.array([[2], [1], [0]])  # candidate base levels below the crossing (``_solve_fast``)


# Shape-only constants of the solvers, built once per shape (plans repeat shapes) and read-only: each np.arange or
# table costs about what the arithmetic on it does at these sizes.


@functools.lru_cache(maxsize=128)
def _frange(n: int) -> np.ndarray:
    """0.0, 1.0, ..., n - 1."""
    a = np.arange(n, dtype=np.float64)
    a.setflags(write=False)
    return a


@functools.lru_cache(maxsize=64)
def _single_table(L: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """For ``_solve_single``: chunks loaded at m = k q, L K - k q for k = 1..L (rows) and q = 1..K, and the flat
    index where each row starts."""
    left = L * K - _frange(L + 1)[1:, None] * np.arange(1, K + 1)
    rows = np.arange(0, L * K, K)
    for a in (left, rows):
        a.setflags(write=False)
    return left, rows


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
    Nl: list[int]  # the same, as Python ints: batches are small, and plain Python beats a numpy call on them
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

    Nl = [r.cached_tokens for r in requests]
    Nsl = [r.suffix_tokens for r in requests]
    n = len(Nl)
    N = np.array(Nl, dtype=np.int64)
    # a loaded token costs s/B of link plus t of decode: the solvers see (s + t B)/B, the same objective
    s, R = cost.load_bytes_per_token(B), cost.state_bytes
    kmax = -(-max(Nl) // C)
    # F in one call (it may be a profile) at the grid min(i C, max N) for i = 0..kmax, then at N, then at N + Ns
    grid_tokens = [*range(0, kmax * C, C), max(Nl)]
    vals = replay_times(cost.replay_time, grid_tokens + Nl + [a + b for a, b in zip(Nl, Nsl)])
    # replay_times raises unless F is nondecreasing in the tokens (and evens out float noise), so F(N + Ns) >= F(N)
    f_grid, fN, fNs = vals[: kmax + 1], vals[kmax + 1:kmax + 1 + n], vals[kmax + 1 + n:]
    sigma = (fNs - fN) * cost.suffix_scale
    has_suffix = any(Nsl)
    sig = float(sigma.sum()) + suffix_call(cost, has_suffix)
    full_load = s * N + R * (N > 0) if R else s * N  # bytes a block loads with no recompute (same floats)
    A0 = float(L * full_load.sum())
    st = _Setup(N=N, Nl=Nl, L=L, s=s, R=R, B=B, C=C, c1=L * sig, c2=sig, A0=A0)

    fast_ok = method != "dp" and _fast_applies(st, f_grid)
    if method == "fast" or (method == "auto" and fast_ok):
        if not fast_ok:
            raise ValueError("method='fast' needs R == 0, N_r % chunk == 0 and F convex on the grid for t > 0")
        cnt = _solve_single(st, f_grid) if n == 1 and method == "auto" else _solve_fast(st, f_grid)
        bound = 0.0
        name = "fast"
    else:
        cnt, bound = _solve_dp(st, f_grid, fN, max_dp_work)
        name = "dp"
    # cnt: grid index per [request, block], non-increasing along each row (already a staircase), at most
    # ceil(N_r / C) <= kmax; only the DP's last grid point of an off-grid N is past N
    Nc = N[:, None]
    J = cnt * C if name == "fast" else np.minimum(cnt * C, Nc)
    FJ = np.where(J == Nc, fN[:, None], f_grid[cnt])
    ev = price_staircase(N, J, FJ, sigma, cost, B, has_suffix, sig=sig)
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
    if st.R != 0.0 or any(v % st.C for v in st.Nl):
        return False
    h = f[1:]
    if h.size < 3:
        return True
    d2 = h[2:] - 2.0 * h[1:-1] + h[:-2]  # 2.0: numpy converts a Python int operand at more cost (same floats)
    # d2[argmin]: the min without a ufunc reduction, which costs several times more on an array this small
    return float(d2[d2.argmin()]) >= -1e-12 * max(float(h[-1]), 1e-300)


def _solve_single(st: _Setup, f: np.ndarray) -> np.ndarray:
    """One request, ``fast`` conditions: min over k on-blocks and m chunks of max(compute, load), exactly.

    h[c-1] = F(cC) is the cost of a block that recomputes c >= 1 chunks; with k such blocks and m chunks in all,
    water-filling gives compute k h(q) + e (h(q+1) - h(q)) at q = m // k. At m = k q compute and load are
    tabulated for all (k, q); per k the crossing lies in the last segment [kq, k(q+1)] where compute <= load,
    and the best m there is the floor or ceil of the linear crossing. Returns chunks per block, [1, L].
    """
    L, C = st.L, st.C
    K = st.Nl[0] // C
    out = np.zeros((1, L), dtype=np.int64)
    if K == 0:
        return out
    u = st.s * C / st.B  # load seconds per chunk
    h = f[1:K + 1]
    k = _frange(L + 1)[1:]
    left, rows = _single_table(L, K)
    comp = st.c1 + k[:, None] * h  # [L, K], at m = k q
    load = st.c2 + left * u
    # compute rises and load falls in q, so levels with compute <= load are a prefix; the segment starts at
    # level qi = q0 + 1 (none: at q = 1, m = k), where compute and load are the table entries [k, q0]; q0 counts
    # the prefix among levels 2..K only (with level 1 in it or not, the segment starts there at the earliest)
    q0 = (comp[:, 1:] <= load[:, 1:]).sum(1)
    at = q0 + rows
    c0, l0 = comp.take(at), load.take(at)
    top = q0 < K - 1  # a level above qi exists
    # slope per extra chunk above level qi; 0 where there is no level above it, where t is capped at 0 below and
    # T takes no slope
    dh = np.zeros(K)
    np.subtract(h[1:], h[:-1], out=dh[:-1])
    dh = dh.take(q0)
    # the linear crossing, in [0, k] chunks above level qi (>= 0, so only the upper clip matters, and floor
    # and ceil of a value in [0, k] stay in it)
    t = np.minimum(np.maximum(l0 - c0, 0.0) / (dh + u), k * top)
    cand = np.empty((2, L))
    np.floor(t, out=cand[0])
    np.ceil(t, out=cand[1])
    T = np.maximum(c0 + cand * dh, l0 - cand * u)  # [2, L]
    row, col = divmod(int(T.argmin()), L)
    all_load = max(st.c1, st.c2 + L * K * u)
    if all_load <= float(T[row, col]):
        return out
    level, extra = int(q0[col]) + 1, int(cand[row, col])  # extra <= k = col + 1
    out[0, :extra] = level + 1
    out[0, extra:col + 1] = level
    return out


def _solve_fast(st: _Setup, f: np.ndarray) -> np.ndarray:
    """Exact for setup-convex f: min over k (blocks that recompute) of a convex water-filling problem.

    Items are grouped by cap K_r = N_r / C (largest first); for k on-blocks the on-set is the first k items.
    At level q every on-block holds 1 + min(K_g - 1, q) chunks; between levels q-1 and q the least
    recompute rises linearly (dh[q-1] per avoided chunk), so each k's optimum is at the level where
    compute overtakes load, refined to the best integer point inside that segment. Returns chunks per block.

    Work is vectorised over k; m[g, k] (on-blocks of group g) is full before group grp[k], pk[k] in it and 0
    after it, so a sum over g taken in group order is a prefix over the full groups (a small [group, level]
    table) plus pk times the grp[k] term: the same floats as summing m over every group, for less work. With
    one cap (a batch of equal requests, the usual call) there are no full groups and pk = k: that case skips
    the tables and computes the same floats directly (each table sum only added 0.0 to a term >= 0).
    """
    L, C, n = st.L, st.C, len(st.Nl)
    K = [v // C for v in st.Nl]
    out = np.zeros((n, L), dtype=np.int64)
    caps_l = sorted(set(K) - {0}, reverse=True)  # largest caps first
    if not caps_l:
        return out
    sizes_l = [L * K.count(c) for c in caps_l]
    ends_l = list(itertools.accumulate(sizes_l))
    ng, total, Q = len(caps_l), ends_l[-1], caps_l[0]  # Q levels 0..qtop
    qtop = Q - 1
    h = f[1:]  # h[c'] = F((c'+1) C)
    # dh[q] = h[q+1] - h[q], 0 at the top: read where an on-block is below its cap (q < cap <= h.size - 1), and
    # elsewhere only times a zero step (h is finite and nondecreasing, so 0 * dh adds exactly 0)
    dh = np.zeros(h.size)
    np.subtract(h[1:], h[:-1], out=dh[:-1])
    unit_s = st.s * C / st.B  # seconds of load per avoided chunk
    kf = _frange(total + 1)

    # Crossing level per k: compute >= load  <=>  Psi_k(q) = sum_g m_gk psi(min(capp_g, q)) >= rhs_k with
    # psi(q) = h(q) + u q strictly increasing, so one searchsorted per k inside the right cap interval.
    psi = h + unit_s * _frange(h.size)
    rhs = st.A0 / st.B + st.c2 - st.c1 - unit_s * kf
    if ng == 1:
        # one interval [0, qtop], Psi_k(qtop) = k psi(qtop), and no full groups before the one group
        crosses = kf * psi[qtop] >= rhs - 1e-12 * np.abs(rhs)
        target = rhs / np.maximum(kf, 1.0)
        target[0] = -np.inf  # k = 0: nothing to place
        qs = np.where(crosses, np.minimum(psi.searchsorted(target), qtop), Q)
        base = np.minimum(np.maximum(qs - _BASE_OFFSETS, 0), qtop)  # [3, k], as below
        comp0 = kf * h[base] + st.c1
        X0 = kf + kf * base
        seg = kf * (base < qtop)
    else:
        # per cap interval j: [lowest level, highest level (capp_j = K_j - 1), on-blocks up to group j]
        by_j = np.array([caps_l[1:] + [0], [c - 1 for c in caps_l], ends_l])
        capp, ends = by_j[1], by_j[2]
        sizes = np.array(sizes_l, dtype=np.float64)
        ks = np.arange(total + 1)
        grp = np.minimum(ends.searchsorted(ks, side="right"), ng - 1)
        pk = kf - (ends - sizes).take(grp)  # on-blocks in group grp[k]
        at_caps = psi[np.minimum(capp[:, None], capp)]  # [j, g] = [g, j]: psi(min(capp_g, capp_j))
        pref = np.zeros((ng, ng + 1))  # [j, p]: sum over the full groups g < p
        np.add.accumulate(at_caps * sizes, axis=1, out=pref[:, 1:])
        Psi_caps = pref.take(grp, axis=1) + pk * at_caps.take(grp, axis=1)  # [j, k] = Psi_k(capp_j)
        # intervals in increasing q: j = ng-1 covers [0, capp_{ng-1}], j < ng-1 covers [capp_{j+1}+1, capp_j];
        # Psi_caps falls in j, so the j where it reaches rhs are a prefix and the crossing is in the last of them
        first = (Psi_caps >= rhs - 1e-12 * np.abs(rhs)).sum(0) - 1
        j = np.maximum(first, 0)
        lo_j, cap_j, end_j = by_j.take(j, axis=1)
        free = np.minimum(kf, end_j)  # on-blocks still below their cap in interval j (>= 1 for k >= 1)
        # sum over the groups after j of m psi(capp_g), accumulated from the last group
        m = np.minimum(np.maximum(kf - (ends - sizes)[:, None], 0.0), sizes[:, None])  # [g, k]
        mv = m * psi.take(capp)[:, None]
        acc = np.zeros((ng + 1, total + 1))
        for g in range(ng - 1, -1, -1):
            np.add(acc[g + 1], mv[g], out=acc[g])
        sat = acc.take((j + 1) * (total + 1) + ks)
        free[0] = 1.0
        target = (rhs - sat) / free
        target[0] = -np.inf  # k = 0: nothing to place
        qs = np.where(first >= 0, np.minimum(np.maximum(psi.searchsorted(target), lo_j), cap_j), Q)

        # rows are the three candidate base levels, columns k; [group, level] tables read at (grp[k], base).
        base = np.minimum(np.maximum(qs - _BASE_OFFSETS, 0), qtop)
        levels = np.arange(Q)
        # per group g and level q, for one on-block (odd rows) and summed over the full groups before g in group
        # order (even rows): recompute, chunks above its first, and whether it is below its cap
        tab = np.empty((6, ng, Q))
        lvl = np.minimum(capp[:, None], levels)
        tab[1] = h[lvl]
        tab[3] = lvl
        tab[5] = capp[:, None] > levels
        tab[0:6:2, 0] = 0.0
        np.add.accumulate(tab[1:6:2, :-1] * sizes[:-1, None], axis=1, out=tab[0:6:2, 1:])
        G = tab.reshape(6, -1).take(grp * Q + base, axis=1)  # [6, 3, k]
        if ng < 8:  # numpy adds fewer than 8 terms in order: this is its sum of m * recompute over the groups
            comp0 = G[0] + pk * G[1] + st.c1
        else:  # it adds 8 or more pairwise: sum all [3, k, g] terms the same way
            terms = tab[1].T.take(base, axis=0)
            terms *= m.T
            comp0 = terms.sum(2) + st.c1
        X0 = kf + (G[2] + pk * G[3])  # integers: exact in any order
        seg = G[4] + pk * G[5]

    # Refine inside the segment below the crossing (and its neighbours, against rounding at the boundary): rows
    # of base are the three candidate base levels, columns k.
    load0 = (st.A0 - st.s * C * X0) / st.B + st.c2
    slope = dh.take(base)
    tstar = np.maximum(load0 - comp0, 0.0) / (slope + unit_s)
    tt = np.empty((2,) + tstar.shape)  # floor and ceil of the crossing, at most the segment
    np.floor(tstar, out=tt[0])
    np.ceil(tstar, out=tt[1])
    np.minimum(tt, seg, out=tt)
    Tt = np.maximum(comp0 + tt * slope, load0 - tt * unit_s).reshape(6, -1)  # [floor/ceil x base, k]
    # the least k, then the first of its six candidates, that reaches the minimum: argmin over [k, candidate]
    kb, pick = divmod(int(Tt.T.argmin()), 6)
    q = int(base[pick % 3, kb])
    extra = int(tt.reshape(6, -1)[pick, kb])

    # Hand the chosen multiset back to requests: on-blocks go to the largest caps first.
    left = kb
    for r in sorted(range(n), key=lambda r: -K[r]):
        if left == 0 or K[r] == 0:
            break
        n_on = min(L, left)
        left -= n_on
        cg = K[r] - 1
        add = min(extra, n_on) if cg > q else 0  # blocks one chunk above the level (few: most rows have none)
        if add:
            out[r, :add] = 2 + q
        out[r, add:n_on] = 1 + min(cg, q)
        extra -= add
    return out


# ------------------------------------------------------------------------------------------------ the DP

_CUT = 1e-10  # the DP keeps only states that can beat the incumbent by more than this fraction of it
_COLLINEAR = 1e-13  # a grid point this close (relative to the item's largest cost) to a hull edge lies on it
_BLOCK = 1 << 21  # elements per block of a min-plus product (16 MiB)
_SPARSE = 0.25  # leaves with fewer states per unit than this are added one item at a time


def _solve_dp(st: _Setup, f: np.ndarray, fN: np.ndarray, max_work: int) -> tuple[np.ndarray, float]:
    """The paper's DP over all (request, block) items; returns grid indices [request, block] (each row
    non-increasing) and the bound. Requests of one prefix length share a type; the exact tables, their pruning
    and the reconstruction are in ``_Units``."""
    L, C, s = st.L, st.C, st.s
    tau = int(np.gcd.reduce(np.concatenate([[C], st.N])))
    types: dict[int, list[int]] = {}  # prefix length -> its requests; N = 0 has nothing to choose
    for r, n in enumerate(st.Nl):
        if n:
            types.setdefault(n, []).append(r)
    out = np.zeros((len(st.Nl), L), dtype=np.int64)
    if not types:
        return out, 0.0
    # Per type: recompute cost and exact avoided bytes a(j) = d(0) - d(j) at the grid points min(k C, N).
    costs, avoided = [], []
    for n, rs in types.items():
        kk = -(-n // C)
        cost = f[: kk + 1].copy()
        cost[-1] = fN[rs[0]]
        a = s * np.minimum(np.arange(kk + 1, dtype=np.int64) * C, n).astype(np.float64)
        a[-1] += st.R
        costs.append(cost)
        avoided.append(a)
    mult = [L * len(rs) for rs in types.values()]

    # Exact units first; coarser whole-chunk units only when even the pruned DP would be too slow (the bound
    # accounts for it).
    top = max(max(types), C)
    units = sorted({tau, *(C << i for i in range(48) if (C << i) <= 2 * top)})
    for i, unit_tokens in enumerate(units):
        unit_bytes = s * unit_tokens
        us = [np.rint(a / unit_bytes).astype(np.int64) for a in avoided]
        picks = _Units(st, costs, us, mult, unit_bytes).solve(max_work if i < len(units) - 1 else sys.maxsize)
        if picks is not None:
            break

    bound = 0.0
    for a, u, rs in zip(avoided, us, types.values()):
        e = u * unit_bytes - a
        e[np.abs(e) <= 1e-9 * float(a.max(initial=s))] = 0.0  # float noise of s*j, not a model rounding
        bound += len(rs) * L * (max(float(e.max()), 0.0) + max(float(-e.min()), 0.0)) / st.B

    # Any split of a type's picks among its (identical) requests has the same cost: deal them out in turn.
    for rs, k in zip(types.values(), picks):
        k = -np.sort(-k)
        for i, r in enumerate(rs):
            out[r] = k[i :: len(rs)]
    return out, bound


@dataclass(eq=False)
class _Node:
    """D[x], the least recompute of ``counts`` items (per type) that avoid exactly lo + i units, for x in the band
    [lo, lo + len(vals)); a leaf is one item of type ``typ``, a product node the min-plus product of ``kids``."""

    counts: np.ndarray
    kids: tuple[_Node, _Node] | None = None
    typ: int = -1
    window: tuple[int, int] | None = None  # the x that can hold part of a plan that beats the incumbent
    lo: int = 0
    vals: np.ndarray = field(default_factory=lambda: np.zeros(0))
    queries: list[np.ndarray] = field(default_factory=list)


class _Units:
    """The DP's problem in whole units of avoided transfer, solved exactly with few states.

    Items of a type (one prefix length) are identical, so a type's table is the min-plus power of one item's,
    built by repeated squaring; the types' tables are then multiplied together. The incumbent is the best plan
    with every item on its lower convex hull (all items walk their hulls together, one item one segment at a
    time in slope order). A table keeps only the states x that can still beat it: D[x] plus a lower bound on
    the other items' least recompute, for the units they must still avoid, within the incumbent. The bound is
    the other items' convex minorant (their hull segments merged by slope), so with a convex F nothing beats
    the incumbent and the tables stay empty, and otherwise they stay near the balance point. Ties between
    identical items (moving units from one to another at the same cost) are cut by windows (``__init__``).
    What is pruned could beat the incumbent by at most ``_CUT`` of it: the result is the optimum up to that.
    """

    def __init__(self, st: _Setup, costs: list[np.ndarray], units: list[np.ndarray], mult: list[int],
                 unit_bytes: float) -> None:
        self.c1, self.c2, self.A0, self.B, self.unit = st.c1, st.c2, st.A0, st.B, unit_bytes
        self.M = np.array(mult, dtype=np.float64)
        self.leaf_vals: list[np.ndarray] = []
        self.kmap: list[np.ndarray] = []
        self.knots: list[list[int]] = []  # per type, the units of its hull knots in order
        dx: list[float] = []
        dp: list[float] = []
        key: list[float] = []
        typ: list[int] = []
        slack = 0.0  # most the merged hulls can lie above the true minorant (collinear knots)
        for t, (g, u) in enumerate(zip(costs, units)):
            pu, pg, pk = _collapse(u.tolist(), g.tolist())
            vals = np.full(pu[-1] + 1, np.inf)
            vals[pu] = pg
            kmap = np.full(pu[-1] + 1, -1, dtype=np.int64)
            kmap[pu] = pk
            self.leaf_vals.append(vals)
            self.kmap.append(kmap)
            tol = _COLLINEAR * pg[-1]
            slack += mult[t] * tol
            hx, hy, hk = _hull_knots(pu, pg, tol)
            self.knots.append(hx)
            dx += [b - a for a, b in itertools.pairwise(hx)]
            dp += [b - a for a, b in itertools.pairwise(hy)]
            key += hk
            typ += [t] * (len(hx) - 1)
        order = np.argsort(np.array(key), kind="stable")  # a type's segments keep their order on equal keys
        self.dx, self.dp = np.array(dx, dtype=np.float64)[order], np.array(dp)[order]
        self.typ = np.array(typ, dtype=np.int64)[order]
        # The incumbent: the best prefix of the walk along the hulls (one item one segment at a time).
        m = self.M[self.typ].astype(np.int64)
        x = np.concatenate(([0.0], np.cumsum(np.repeat(self.dx, m))))
        p = np.concatenate(([0.0], np.cumsum(np.repeat(self.dp, m))))
        T = np.maximum(p + self.c1, (self.A0 - self.unit * x) / self.B + self.c2)
        self.steps, self.ends = int(T.argmin()), np.cumsum(m)
        self.T_inc = float(T[self.steps])
        self.U = self.T_inc * (1.0 - _CUT) + slack  # what a state's bound must not exceed
        self.xneed = (self.A0 - self.B * (self.U - self.c2)) / self.unit  # least units of a plan within U

        # The tables: per type, powers of its leaf by squaring, multiplied along the bits of its count; then the
        # types' results one after another. On a unit much finer than a chunk a leaf holds few states in a wide
        # table, and a product of two wide tables costs more than adding the items one at a time (the paper's
        # order, one shifted min per grid point): then one chain over every item. ``order`` lists children
        # before parents.
        self.order: list[_Node] = []
        root: _Node | None = None
        states = sum(int(np.count_nonzero(v < np.inf)) for v in self.leaf_vals)
        chain = states < _SPARSE * sum(v.size for v in self.leaf_vals)
        for t, mt in enumerate(mult):
            cnt = np.zeros(len(mult))
            cnt[t] = 1.0
            p2 = self._node(cnt, typ=t)
            if chain:
                for _ in range(mt):
                    root = p2 if root is None else self._node(root.counts + cnt, (root, p2))
                continue
            res: _Node | None = None
            while True:
                if mt & 1:
                    res = p2 if res is None else self._node(res.counts + p2.counts, (res, p2))
                mt >>= 1
                if not mt:
                    break
                p2 = self._node(2.0 * p2.counts, (p2, p2))
            assert res is not None
            root = res if root is None else self._node(root.counts + res.counts, (root, res))
        assert root is not None
        self.root = root
        # Windows, parents first. The root, and each table under a product across types, lies where the hull
        # bound stays within U (``_band``). Inside a type, items are identical: sorting a node's picks and
        # cutting out a run of consecutive ones gives a child whose total is within half an item's range (umax)
        # of its share of the node's (the runs' sums move by at most umax a step, from above the share to below
        # it), and recursing from the top gives every node such a total at once. So some optimal plan has, at
        # each node, a total within its share of the parent's window widened by umax / 2.
        self.root.window = self._band(self.root.counts)
        for nd in reversed(self.order):
            if nd.kids is None:
                continue
            assert nd.window is not None
            t = int(nd.counts.argmax())
            one_type = np.count_nonzero(nd.counts) == 1
            half = 0.5 * (self.leaf_vals[t].size - 1)
            for kid in nd.kids:
                if one_type:
                    share = kid.counts[t] / nd.counts[t]
                    w = (int(np.floor(share * nd.window[0] - half)), int(np.ceil(share * nd.window[1] + half)))
                else:
                    w = self._band(kid.counts)
                kid.window = w if kid.window is None else (min(kid.window[0], w[0]), max(kid.window[1], w[1]))

    def _band(self, counts: np.ndarray) -> tuple[int, int]:
        """The integer totals x of ``counts`` items where the bound on the hulls alone stays within U."""
        xn, pn = self._curve(counts)
        xc, pc = self._curve(self.M - counts)
        lo_d, hi_d = max(0.0, self.xneed - xc[-1]), xn[-1]
        if lo_d > hi_d:
            return 0, -1
        # phi(x) = hull(x) + hull_other(max(0, xneed - x)) + c1 is convex and piecewise linear: its level set
        # {phi <= U} is an interval, found from phi at the knots of both pieces
        b = np.unique(np.clip(np.concatenate((xn, self.xneed - xc, [lo_d, hi_d])), lo_d, hi_d))
        phi = np.interp(b, xn, pn) + np.interp(np.maximum(self.xneed - b, 0.0), xc, pc) + self.c1
        ok = np.flatnonzero(phi <= self.U)
        if ok.size == 0:
            return 0, -1
        i0, i1 = int(ok[0]), int(ok[-1])
        xl, xr = float(b[i0]), float(b[i1])
        if i0 > 0:
            xl -= (b[i0] - b[i0 - 1]) * (self.U - phi[i0]) / (phi[i0 - 1] - phi[i0])
        if i1 < b.size - 1:
            xr += (b[i1 + 1] - b[i1]) * (self.U - phi[i1]) / (phi[i1 + 1] - phi[i1])
        return max(int(np.floor(xl)) - 1, 0), min(int(np.ceil(xr)) + 1, int(hi_d))

    def _curve(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Convex minorant of ``counts`` items' least recompute: knots (units, seconds)."""
        m = counts[self.typ]
        keep = m > 0
        x = np.concatenate(([0.0], np.cumsum(self.dx[keep] * m[keep])))
        p = np.concatenate(([0.0], np.cumsum(self.dp[keep] * m[keep])))
        return x, p

    def _node(self, counts: np.ndarray, kids: tuple[_Node, _Node] | None = None, typ: int = -1) -> _Node:
        """A new table, after its children in ``order``."""
        nd = _Node(counts=counts, kids=kids, typ=typ)
        self.order.append(nd)
        return nd

    def solve(self, max_work: int) -> list[np.ndarray] | None:
        """Build the tables, each trimmed to the states that can still beat the incumbent; if the root holds a
        plan better than the incumbent, trace the best back, else take the incumbent. Per type, its items' grid
        indices (any order); None once the products' work passes ``max_work`` (the caller coarsens the unit)."""
        work = 0
        for nd in self.order:
            if nd.kids is None:
                vals, lo = self.leaf_vals[nd.typ], 0
            else:
                a, b = nd.kids
                if not (a.vals.size and b.vals.size):
                    continue
                (vals, ops), lo = _minplus(a.vals, b.vals), a.lo + b.lo
                work += ops
                if work > max_work:
                    return None
            assert nd.window is not None
            w0, w1 = max(nd.window[0], lo), min(nd.window[1], lo + vals.size - 1)
            if w0 > w1:
                continue
            vals, lo = vals[w0 - lo : w1 + 1 - lo], w0
            xc, pc = self._curve(self.M - nd.counts)  # the other items' lower bound
            y = np.maximum(np.ceil(self.xneed - (lo + _frange(vals.size))), 0.0)
            keep = np.flatnonzero((vals + np.interp(y, xc, pc) + self.c1 <= self.U) & (y <= xc[-1]))
            if keep.size:
                nd.lo, nd.vals = lo + int(keep[0]), vals[keep[0] : keep[-1] + 1]

        r = self.root
        if r.vals.size:
            T = np.maximum(r.vals + self.c1, (self.A0 - self.unit * (r.lo + _frange(r.vals.size))) / self.B + self.c2)
            best = int(T.argmin())
            if T[best] < self.T_inc:
                return self._trace(r.lo + best)
        return self._incumbent()

    def _trace(self, x: int) -> list[np.ndarray]:
        """Grid indices per type of the root's plan at x: each product's split, recomputed where it is read."""
        self.root.queries = [np.array([x], dtype=np.int64)]
        picks: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * len(self.leaf_vals)
        for nd in reversed(self.order):  # parents before children
            if not nd.queries:
                continue
            xs = np.concatenate(nd.queries)
            if nd.kids is None:
                picks[nd.typ] = self.kmap[nd.typ][xs]
                continue
            a, b = nd.kids
            j = (xs - a.lo - b.lo)[:, None] - np.arange(a.vals.size)  # b's index for each of a's
            inside = (j >= 0) & (j < b.vals.size)
            tot = np.where(inside, a.vals + b.vals.take(np.clip(j, 0, b.vals.size - 1)), np.inf)
            x1 = a.lo + tot.argmin(1)
            a.queries.append(x1)
            b.queries.append(xs - x1)
        return picks

    def _incumbent(self) -> list[np.ndarray]:
        """Grid indices per type of the incumbent: the walk's first ``steps`` moves done."""
        done = int(self.ends.searchsorted(self.steps, side="right"))  # segments every item of its type passed
        part = self.steps - (int(self.ends[done - 1]) if done else 0)  # items past the next segment
        picks = []
        for t, kn in enumerate(self.knots):
            f = int(np.count_nonzero(self.typ[:done] == t))
            p = part if done < self.typ.size and self.typ[done] == t else 0
            at = [kn[f]] * (int(self.M[t]) - p) + ([kn[f + 1]] * p if p else [])
            picks.append(self.kmap[t][np.array(at, dtype=np.int64)])
        return picks


def _collapse(u: list[int], g: list[float]) -> tuple[list[int], list[float], list[int]]:
    """One item's choices by unit: the cheapest grid index at each (g is nondecreasing in the index; on a tie,
    the later index, which avoids more)."""
    pu: list[int] = []
    pg: list[float] = []
    pk: list[int] = []
    for k, (x, c) in enumerate(zip(u, g)):
        if pu and x == pu[-1]:
            if c <= pg[-1]:
                pg[-1], pk[-1] = c, k
            continue
        pu.append(x)
        pg.append(c)
        pk.append(k)
    return pu, pg, pk


def _hull_knots(x: list[int], y: list[float], tol: float) -> tuple[list[int], list[float], list[float]]:
    """Knots of the lower convex hull of points with increasing x: its vertices (a point within ``tol`` of an
    edge is not one) and the points on its edges (within ``tol``), and per segment between knots its edge's
    slope, shared by the segments of one edge (the merge order of the hulls)."""
    vx, vy, vi = [x[0]], [y[0]], [0]
    for i in range(1, len(x)):
        a, b = x[i], y[i]
        # pop the last vertex while it lies above, or within tol below, the chord to the new point
        while len(vx) >= 2 and ((vy[-1] - vy[-2]) * (a - vx[-2])
                                >= (b - vy[-2]) * (vx[-1] - vx[-2]) - tol * (a - vx[-2])):
            vx.pop()
            vy.pop()
            vi.pop()
        vx.append(a)
        vy.append(b)
        vi.append(i)
    kx, ky, key = [x[0]], [y[0]], []
    for (i0, x0, y0), (i1, x1, y1) in itertools.pairwise(zip(vi, vx, vy)):
        slope = (y1 - y0) / (x1 - x0)
        for i in range(i0 + 1, i1 + 1):
            if i == i1 or y[i] <= y0 + slope * (x[i] - x0) + tol:
                kx.append(x[i])
                ky.append(y[i])
                key.append(slope)
    return kx, ky, key


def _minplus(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int]:
    """c[k] = min_i a[i] + b[k - i] (inf: no state), and the element operations it took. Dense: row i of a
    skewed block holds a[i] + b shifted by i, so one min down the columns gives c. When one side has few states
    (a leaf on a fine unit: its grid points only), one shifted min per state instead."""
    out = np.full(a.size + b.size - 1, np.inf)
    fa, fb = np.flatnonzero(a < np.inf), np.flatnonzero(b < np.inf)
    if fa.size > fb.size:
        a, b, fa, fb = b, a, fb, fa
    dense = min(a.size, b.size) * (a.size + b.size)
    if fa.size * (b.size + 1000) < dense:
        for i, v in zip(fa.tolist(), a[fa].tolist()):
            seg = out[i : i + b.size]
            np.minimum(seg, v + b, out=seg)
        return out, fa.size * b.size
    if a.size > b.size:
        a, b = b, a
    wb = b.size
    rows = max(1, _BLOCK // (a.size + wb))
    for i0 in range(0, a.size, rows):
        blk = a[i0 : i0 + rows]
        w = blk.size + wb  # one spare column, so that row i starts at column i
        Z = np.full((blk.size, w), np.inf)
        np.add(blk[:, None], b, out=as_strided(Z, shape=(blk.size, wb), strides=((w + 1) * Z.itemsize, Z.itemsize)))
        seg = out[i0 : i0 + w - 1]
        np.minimum(seg, Z.min(0)[: w - 1], out=seg)
    return out, dense
