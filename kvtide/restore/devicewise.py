"""Device-wise restoration plans (CacheFlow §3.1 "device-wise parallelism", appendix A.2).

A model's L blocks are split into S contiguous shards, one per device. Two ways to restore a prefix on that
layout, both from the same planner (``kvtide.restore.planner.plan`` or a baseline, by name):

* **device-wise** (CacheFlow): shard s plans only its own L_s blocks, with its own latency profile and its own
  link, and replays from its *boundary activation* (the cached input hidden states of its first layer) instead
  of waiting for shard s-1; every shard restores at once. The suffix then runs through the shards in order.
  Reading the boundary rows is not free: h = hidden x itemsize bytes a token (Llama-3.1-8B: 8 KiB, as much as
  two layers' KV), before the shard's first layer and its KV loads on the same link, so a shard after the
  first minimises h j_0 / B + T(staircase) (``plan_shard``; appendix A.2's hN/B term).
* **sequential** (one staircase; what a single-device planner does on the same layout): one plan over all L
  blocks, cut into shard slices. The staircase is non-increasing, so shard s-1's last layer recomputes every
  row shard s replays (j_last(s-1) >= j_first(s)): shard s waits for those rows instead of a boundary activation.

Fallback (a boundary activation missing or corrupt for request r at shard s): shard s caps its own staircase at
the rows its upstream replays in its last layer, ``min(j_i, j_last(s-1))`` (still a staircase), takes those rows
from upstream, and loads the rest. Upstream's last boundary is itself capped when upstream fell back, so caps are
resolved in shard order. The cap only moves work from replay to loading: the output is unchanged.

Pure functions on plain lists so the engine (kvtide/parallel) and tests share them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from enum import Enum
from typing import Sequence

import numpy as np

from kvtide.restore.costs import (
    BlockCost,
    RestoreRequest,
    evaluate_staircase,
    replay_times,
    suffix_call,
)
from kvtide.restore.methods import make_plan
from kvtide.restore.planner import Plan

__all__ = [
    "Route",
    "ShardStatus",
    "Source",
    "a2_upper_bound",
    "boundary_seconds",
    "pipeline_estimate",
    "plan_shard",
    "resolve_routes",
    "shard_cost",
    "shard_ranges",
    "split_rows",
    "upstream_rows",
]


def shard_ranges(num_layers: int, num_shards: int) -> list[range]:
    """Contiguous, near-even layer ranges (earlier shards take the remainder: they also embed)."""
    if not isinstance(num_layers, int) or not isinstance(num_shards, int):
        raise TypeError("num_layers and num_shards must be ints")
    if num_shards < 1 or num_layers < num_shards:
        raise ValueError(f"need 1 <= num_shards <= num_layers, got {num_shards} shards for {num_layers} layers")
    base, extra = divmod(num_layers, num_shards)
    out, lo = [], 0
    for s in range(num_shards):
        hi = lo + base + (1 if s < extra else 0)
        out.append(range(lo, hi))
        lo = hi
    return out


def shard_cost(cost: BlockCost, layers: range) -> BlockCost:
    """The same per-block costs over one shard's blocks: every term of ``cost`` (the profile decode, the suffix
    call and scale, the fixed seconds each shard's restoration pays) but the block count."""
    return dataclasses.replace(cost, num_blocks=len(layers))


def split_rows(rows: Sequence[Sequence[int]], ranges: Sequence[range]) -> list[list[list[int]]]:
    """A global staircase per request -> per shard, the slice of each request's boundaries."""
    return [[list(r[rg.start:rg.stop]) for r in rows] for rg in ranges]


class Source(str, Enum):
    """Where a shard's first layer gets the prefix rows it replays."""

    EMBED = "embed"  # shard 0: the token embeddings
    BOUNDARY = "boundary"  # its cached boundary activation (device-wise)
    UPSTREAM = "upstream"  # shard s-1's last-layer output (sequential layout, or the fallback)


@dataclass(frozen=True)
class ShardStatus:
    """What one shard reports for one request before restoring: its plan's first/last boundary (tokens
    replayed in its first/last layer) and whether its boundary activation covers the rows its first layer
    replays (always True for shard 0)."""

    first: int
    last: int
    boundary_ok: bool

    def __post_init__(self) -> None:
        if not 0 <= self.last <= self.first:
            raise ValueError(f"need 0 <= last <= first (a staircase), got first={self.first}, last={self.last}")


@dataclass(frozen=True)
class Route:
    """One (shard, request) after fallbacks: the source of its replay input and its capped staircase."""

    source: Source
    cap: int | None  # boundaries are min(j, cap); None: uncapped
    first: int  # effective boundary of the first layer (rows taken from the source)
    last: int  # effective boundary of the last layer (rows it can hand downstream)
    fallback: bool  # the boundary activation was needed and failed

    def apply(self, boundaries: Sequence[int]) -> list[int]:
        return list(boundaries) if self.cap is None else [min(j, self.cap) for j in boundaries]


def resolve_routes(status: Sequence[Sequence[ShardStatus]], devicewise: bool) -> list[list[Route]]:
    """Routes per shard and request, ``status[s][r]`` from every shard (all ranks compute the same answer).

    devicewise=False is the sequential layout: every shard after the first reads its upstream (its plan slice
    already satisfies the cap, so nothing changes but the source).
    """
    S = len(status)
    if S == 0:
        return []
    R = len(status[0])
    if any(len(row) != R for row in status):
        raise ValueError("every shard must report every request")
    routes: list[list[Route]] = [[Route(Source.EMBED, None, st.first, st.last, False) for st in status[0]]]
    for s in range(1, S):
        row = []
        for r in range(R):
            st, up = status[s][r], routes[s - 1][r]
            if devicewise and (st.boundary_ok or st.first == 0):
                row.append(Route(Source.BOUNDARY, None, st.first, st.last, False))
                continue
            cap = up.last
            if not devicewise and st.first > cap:
                raise ValueError(f"shard {s} request {r}: slice starts at {st.first} > upstream's last {cap}: "
                                 "not one staircase")
            row.append(Route(Source.UPSTREAM, cap, min(st.first, cap), min(st.last, cap), devicewise))
        routes.append(row)
    return routes


def upstream_rows(routes: Sequence[Sequence[Route]], shard: int) -> list[int]:
    """Rows [0, n) per request that ``shard`` sends downstream from its last layer's replay (0: none)."""
    if shard + 1 >= len(routes):
        return [0] * (len(routes[shard]) if routes else 0)
    return [rt.first if rt.source is Source.UPSTREAM else 0 for rt in routes[shard + 1]]


def boundary_seconds(boundaries: Sequence[Sequence[int]], boundary_bytes_per_token: float, bandwidth: float) -> float:
    """W = h * sum_r j_r0 / B: loading the boundary rows every request's first layer replays, over the shard's link."""
    if boundary_bytes_per_token <= 0:
        return 0.0
    return boundary_bytes_per_token * sum(int(b[0]) for b in boundaries if len(b)) / bandwidth


def plan_shard(method: str, requests: Sequence[RestoreRequest], cost: BlockCost, bandwidth: float, chunk: int,
               boundary_bytes_per_token: float = 0.0) -> Plan:
    """One shard's own plan (device-wise); ``cost`` already covers only its blocks.

    A shard after the first reads its boundary rows [0, j_r0) (h = ``boundary_bytes_per_token`` bytes a token)
    over its own link before anything else: its first layer cannot start without them, and its KV loads queue
    behind them on the link, so the objective is W + T(staircase) with W = h sum_r j_r0 / B (appendix A.2's
    hN/B term). ``predicted_seconds`` includes W. The method's own plan ignores W; for CacheFlow with one request
    the staircase minimising W + T is also searched (every water-filling staircase, ``_with_boundary``) and kept
    when better: a lower top boundary trades boundary bytes (h = 2 x hidden bytes a token, as much as two layers'
    KV for Llama-3.1-8B) against KV loads. Shard 0 (h = 0) gets exactly the method's plan.
    """
    p = make_plan(method, requests, cost, bandwidth, chunk)
    h = float(boundary_bytes_per_token)
    if h <= 0 or not requests:
        return p
    t0 = time.perf_counter()
    w = boundary_seconds(p.boundaries, h, bandwidth)
    best = dataclasses.replace(p, predicted_seconds=p.predicted_seconds + w)
    if method == "cacheflow" and len(requests) == 1:
        row = _with_boundary(requests[0], cost, bandwidth, chunk, h)
        if row is not None and row != p.boundaries[0]:
            ev = evaluate_staircase(requests, [row], cost, bandwidth, chunk)
            t = ev.total_seconds + boundary_seconds([row], h, bandwidth)
            if t < best.predicted_seconds - 1e-12:
                best = Plan.from_cost([row], ev, method="cacheflow+boundary", chunk=chunk)
                best.predicted_seconds = t
    best.planning_seconds = p.planning_seconds + time.perf_counter() - t0
    return best


def _with_boundary(req: RestoreRequest, cost: BlockCost, bandwidth: float, chunk: int, h: float) -> list[int] | None:
    """The water-filling staircase of one request minimising h j_0 / B + max(P + L sig, Q / B + t D + sig), with
    t D the decode of the D loaded tokens (``BlockCost.decode_seconds_per_token``).

    Blocks are identical, so a staircase is a multiset of chunk counts; for k blocks that recompute m chunks in
    all, levels within one chunk of each other (q = m // k, e = m % k blocks one higher) give the least
    recompute when F is convex on the chunk grid, and always the lowest top level j_0 = ceil(m / k) C. All (k, m)
    are tried at once (L x L K numbers). None when the model has fixed state bytes or N is off the chunk grid
    (the caller keeps the method's own plan)."""
    N, Ns, L, C = req.cached_tokens, req.suffix_tokens, cost.num_blocks, chunk
    if N == 0 or N % C or cost.state_bytes:
        return None
    K = N // C
    g = np.arange(K + 1, dtype=np.int64) * C
    vals = replay_times(cost.replay_time, np.concatenate([g, [N, N + Ns]]))
    Fg, sig = vals[:K + 1], float(vals[-1] - vals[-2]) * cost.suffix_scale + suffix_call(cost, Ns > 0)
    # a loaded token costs s/B of link plus t of decode (a profile's entries): (s + t B)/B, as the planner sees it
    B = float(bandwidth)
    s = cost.load_bytes_per_token(B)
    k = np.arange(1, L + 1)[:, None]
    m = np.arange(1, L * K + 1)[None, :]
    q, e = m // k, m % k
    ok = (m >= k) & (m <= k * K)
    qi, qj = np.minimum(q, K), np.minimum(q + 1, K)
    P = (k - e) * Fg[qi] + e * Fg[qj]
    top = np.where(e > 0, qj, qi) * C
    T = np.maximum(P + L * sig, s * (L * N - m * C) / B + sig) + h * top / B
    T = np.where(ok, T, np.inf)
    i, j = np.unravel_index(int(np.argmin(T)), T.shape)
    if not T[i, j] < max(L * sig, s * L * N / B + sig):  # loading everything (no boundary rows) is as good
        return [0] * L
    kk, mm = int(k[i, 0]), int(m[0, j])
    qq, ee = mm // kk, mm % kk
    return [(qq + 1) * C] * ee + [qq * C] * (kk - ee) + [0] * (L - kk)


def pipeline_estimate(shard_seconds: Sequence[float], suffix_per_block: float, shard_layers: Sequence[int]) -> float:
    """TTFT estimate of concurrent per-shard restorations whose suffix then traverses the shards in order.

    ``shard_seconds[s]`` is shard s's own objective (prefix restore + its blocks' suffix). Shard s finishes at
    max(its own time, shard s-1's finish + its blocks' suffix): the suffix cannot overtake its upstream.
    """
    done = 0.0
    for s, (t, n) in enumerate(zip(shard_seconds, shard_layers)):
        done = t if s == 0 else max(t, done + n * suffix_per_block)
    return done


def a2_upper_bound(single_seconds: float, num_shards: int, f_n: float, load_n: float, suffix_seconds: float,
                   boundary_seconds: float = 0.0) -> float:
    """Appendix A.2: a shard's prefix-restoration time is at most T*_single/S + max(F(N), (sN+R)/B) + L sigma/S;
    loading its boundary activation first adds hN/B. ``suffix_seconds`` is L * sigma."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    return single_seconds / num_shards + max(f_n, load_n) + suffix_seconds / num_shards + boundary_seconds
