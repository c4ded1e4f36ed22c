"""Baseline restoration policies, expressed as staircases so the same model, executor and stores run them.

* recompute-only (vLLM default): j = N in every block.
* load-only (LMCache): j = 0 in every block.
* Cake (token-wise, Jin et al. 2025): recompute chunks from the front while loading chunks from the back
  until they meet; every block shares the meeting point j. The meeting is simulated: whichever side would
  finish its next chunk (through all L blocks) sooner claims it.
* layer-wise: recompute the first k blocks fully, load the rest; k from the same meeting simulation over
  layers (recompute forward, load backward).

Both hybrids are request-centric, as published: each request's split is chosen as if it ran alone.
``best_*`` variants instead pick the shared split that minimises the batch objective, so a comparison
with the DP can separate "staircase shape" from "how the split was chosen".
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from kvtide.restore.costs import BlockCost, RestoreRequest, _as_int, _as_pos_float, evaluate_staircase, replay_times
from kvtide.restore.planner import Plan

__all__ = [
    "recompute_only",
    "load_only",
    "cake",
    "layerwise",
    "best_tokenwise",
    "best_layerwise",
    "BASELINES",
]


def _finish(
    name: str, requests: Sequence[RestoreRequest], rows: list[list[int]], cost: BlockCost, bw: float, chunk: int, t0: float
) -> Plan:
    ev = evaluate_staircase(requests, rows, cost, bw, chunk)
    return Plan.from_cost(
        rows, ev, method=name, exact=False, planning_seconds=time.perf_counter() - t0, chunk=chunk
    )


def _check(bandwidth: float, chunk: int) -> tuple[float, int]:
    bw = _as_pos_float("bandwidth", bandwidth)
    c = _as_int("chunk", chunk)
    if c <= 0:
        raise ValueError(f"chunk must be > 0 tokens, got {c}")
    return bw, c


def recompute_only(requests: Sequence[RestoreRequest], cost: BlockCost, bandwidth: float, chunk: int) -> Plan:
    """Replay the whole prefix in every block; the link stays idle."""
    t0 = time.perf_counter()
    bw, c = _check(bandwidth, chunk)
    rows = [[r.cached_tokens] * cost.num_blocks for r in requests]
    return _finish("recompute-only", requests, rows, cost, bw, c, t0)


def load_only(requests: Sequence[RestoreRequest], cost: BlockCost, bandwidth: float, chunk: int) -> Plan:
    """Load the whole prefix in every block; compute only runs the suffix."""
    t0 = time.perf_counter()
    bw, c = _check(bandwidth, chunk)
    rows = [[0] * cost.num_blocks for _ in requests]
    return _finish("load-only", requests, rows, cost, bw, c, t0)


def _cake_split(n: int, cost: BlockCost, bw: float, chunk: int) -> int:
    """Token where front recompute and back loading meet (all L blocks per chunk on both sides)."""
    if n == 0:
        return 0
    L, s, R = cost.num_blocks, cost.load_bytes_per_token(bw), cost.state_bytes
    n_chunks = -(-n // chunk)
    bounds = [min(i * chunk, n) for i in range(n_chunks + 1)]
    F = replay_times(cost.replay_time, bounds)
    front = back = 0
    while front + back < n_chunks:
        t_front = L * F[front + 1]
        start = bounds[n_chunks - back - 1]
        t_back = L * (s * (n - start) + R) / bw
        if t_front <= t_back:
            front += 1
        else:
            back += 1
    return bounds[front]


def _layer_split(n: int, cost: BlockCost, bw: float) -> int:
    """Number of leading blocks recomputed when forward replay and backward loading meet."""
    if n == 0:
        return cost.num_blocks
    L = cost.num_blocks
    f = float(replay_times(cost.replay_time, [n])[0])
    d = cost.transfer_bytes(n, 0) / bw + cost.decode_seconds_per_token * n
    front = back = 0
    while front + back < L:
        if (front + 1) * f <= (back + 1) * d:
            front += 1
        else:
            back += 1
    return front


def cake(requests: Sequence[RestoreRequest], cost: BlockCost, bandwidth: float, chunk: int) -> Plan:
    """Token-wise hybrid: one split per request, from simulating front recompute meeting back loads."""
    t0 = time.perf_counter()
    bw, c = _check(bandwidth, chunk)
    rows = [[_cake_split(r.cached_tokens, cost, bw, c)] * cost.num_blocks for r in requests]
    return _finish("cake", requests, rows, cost, bw, c, t0)


def layerwise(requests: Sequence[RestoreRequest], cost: BlockCost, bandwidth: float, chunk: int) -> Plan:
    """Layer-wise hybrid: recompute the first k blocks fully, load the others; k from the meeting."""
    t0 = time.perf_counter()
    bw, c = _check(bandwidth, chunk)
    rows = []
    for r in requests:
        k = _layer_split(r.cached_tokens, cost, bw)
        rows.append([r.cached_tokens] * k + [0] * (cost.num_blocks - k))
    return _finish("layer-wise", requests, rows, cost, bw, c, t0)


def best_tokenwise(requests: Sequence[RestoreRequest], cost: BlockCost, bandwidth: float, chunk: int) -> Plan:
    """Cake's shape (same j in every block) with per-request splits chosen by coordinate descent on the batch
    objective (exact for one request)."""
    t0 = time.perf_counter()
    bw, c = _check(bandwidth, chunk)
    L = cost.num_blocks
    grids = [sorted({min(i * c, r.cached_tokens) for i in range(-(-r.cached_tokens // c) + 1)}) for r in requests]
    js = [_cake_split(r.cached_tokens, cost, bw, c) for r in requests]

    def total(cur: list[int]) -> float:
        return evaluate_staircase(requests, [[j] * L for j in cur], cost, bw, c).total_seconds

    best = total(js)
    for _ in range(4):
        improved = False
        for i, g in enumerate(grids):
            for j in g:
                trial = js[:i] + [j] + js[i + 1 :]
                t = total(trial)
                if t < best - 1e-15:
                    best, js, improved = t, trial, True
        if not improved:
            break
    return _finish("best-token-wise", requests, [[j] * L for j in js], cost, bw, c, t0)


def best_layerwise(requests: Sequence[RestoreRequest], cost: BlockCost, bandwidth: float, chunk: int) -> Plan:
    """Layer-wise shape with per-request k chosen by coordinate descent on the batch objective."""
    t0 = time.perf_counter()
    bw, c = _check(bandwidth, chunk)
    L = cost.num_blocks
    ks = [_layer_split(r.cached_tokens, cost, bw) for r in requests]

    def rows(cur: list[int]) -> list[list[int]]:
        return [[r.cached_tokens] * k + [0] * (L - k) for r, k in zip(requests, cur)]

    def total(cur: list[int]) -> float:
        return evaluate_staircase(requests, rows(cur), cost, bw, c).total_seconds

    best = total(ks)
    for _ in range(4):
        improved = False
        for i in range(len(ks)):
            for k in range(L + 1):
                trial = ks[:i] + [k] + ks[i + 1 :]
                t = total(trial)
                if t < best - 1e-15:
                    best, ks, improved = t, trial, True
        if not improved:
            break
    return _finish("best-layer-wise", requests, rows(ks), cost, bw, c, t0)


BASELINES: dict[str, Callable[[Sequence[RestoreRequest], BlockCost, float, int], Plan]] = {
    "recompute-only": recompute_only,
    "load-only": load_only,
    "cake": cake,
    "layer-wise": layerwise,
}
