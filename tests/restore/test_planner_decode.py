"""The planner with a per-token decode term on the load path (entries stored under a KVServe profile), against brute
force over every staircase with the decode written out: load side = Q/B + t * sum(N - j) + sum sigma."""
from __future__ import annotations

import itertools
import random
import zlib

import numpy as np
import pytest

from kvtide.restore import baselines as bl
from kvtide.restore.planner import BlockCost, RestoreRequest, evaluate, plan
from tests.restore.test_planner import KINDS, assert_valid, grid, instance


def brute_force_decode(reqs: list[RestoreRequest], cost: BlockCost, B: float, C: int) -> float:
    L, s, t, F = cost.num_blocks, cost.kv_bytes_per_token, cost.decode_seconds_per_token, cost.replay_time
    sig = sum(F(r.cached_tokens + r.suffix_tokens) - F(r.cached_tokens) for r in reqs)
    P_tot, Q_tot = np.zeros(1), np.zeros(1)  # Q_tot: load seconds (link + decode)
    for r in reqs:
        n = r.cached_tokens
        combos = list(itertools.combinations_with_replacement(grid(n, C), L))
        P = np.array([sum(F(j) for j in cb) for cb in combos])
        Q = np.array([sum(s * (n - j) / B + t * (n - j) for j in cb) for cb in combos])
        P_tot = (P_tot[:, None] + P[None, :]).ravel()
        Q_tot = (Q_tot[:, None] + Q[None, :]).ravel()
    return float(np.min(np.maximum(P_tot + L * sig, Q_tot + sig)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("on_grid", [True, False])
def test_exact_with_decode_term(kind: str, on_grid: bool) -> None:
    rng = random.Random(zlib.crc32(f"{kind}{on_grid}decode".encode()))
    for _ in range(30):
        reqs, base, B, C = instance(rng, R_zero=True, on_grid=on_grid, kind=kind)
        t = rng.choice([0.0, rng.uniform(0.01, 0.5), rng.uniform(0.5, 3.0)]) * base.kv_bytes_per_token / B
        cost = BlockCost(base.num_blocks, base.kv_bytes_per_token, 0.0, base.replay_time, decode_seconds_per_token=t)
        p = plan(reqs, cost, B, C)
        assert_valid(p, reqs, cost.num_blocks, C)
        best = brute_force_decode(reqs, cost, B, C)
        assert p.predicted_seconds == pytest.approx(best, rel=1e-9, abs=1e-12), (reqs, C, t, p.boundaries)
        ev = evaluate(reqs, p.boundaries, cost, B, C)
        assert ev.total_seconds == pytest.approx(p.predicted_seconds)
        # the load side holds the decode of every loaded token, apart from the link's bytes
        loaded = sum(rc.loaded_tokens for rc in ev.per_request)
        assert ev.load_bytes == pytest.approx(sum(cost.kv_bytes_per_token * rc.loaded_tokens for rc in ev.per_request))
        assert ev.load_seconds == pytest.approx(ev.load_bytes / B + t * loaded + ev.suffix_seconds_per_block)
        for name in ("recompute_only", "load_only", "cake", "layerwise"):
            assert getattr(bl, name)(reqs, cost, B, C).predicted_seconds >= p.predicted_seconds - 1e-9


def test_decode_term_moves_the_plan_toward_recompute() -> None:
    """A dearer decode never loads more tokens (same F, s, B)."""
    reqs = [RestoreRequest(64, 4)]
    F = lambda x: 0.0 if x == 0 else 1.0 + 0.05 * x  # noqa: E731
    loaded = []
    for t in (0.0, 0.01, 0.05, 0.2):
        p = plan(reqs, BlockCost(4, 1.0, 0.0, F, decode_seconds_per_token=t), 20.0, 8)
        loaded.append(sum(64 - j for j in p.boundaries[0]))
    assert loaded == sorted(loaded, reverse=True) and loaded[0] > loaded[-1]


def test_decode_term_fails_fast() -> None:
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="decode_seconds_per_token"):
            BlockCost(2, 1.0, decode_seconds_per_token=bad)
