"""The planned split: its boundary is the brute-force best over every boundary vLLM can express, priced by an
event-by-event simulation of the layer pipeline; and the prefill model it uses fits vLLM-like steps."""
from __future__ import annotations

import random

import pytest

from kvtide.integrations.vllm.split import (
    LoadRate,
    PrefillModel,
    candidates,
    pipeline_seconds,
    plan_split,
    simulate,
)


def quadratic(b: float, c: float):
    return lambda j, end: b * (end - j) + c * (end * end - j * j)


def brute_force(start, match_end, end, chunk, layers, tau, compute):
    """Every token boundary in [start, match_end] that is on the chunk grid, start or the match's end."""
    best = None
    for j in range(start, match_end + 1):
        if j not in (start, match_end) and j % chunk:
            continue
        t = simulate((j - start) * tau, compute(j, end) / layers, layers)
        if best is None or t < best[0] - 1e-12:
            best = (t, j)
    return best


def test_closed_form_is_the_pipeline():
    rng = random.Random(0)
    for _ in range(500):
        l, c, n = rng.uniform(0, 2e-3), rng.uniform(0, 2e-3), rng.randint(1, 64)
        assert pipeline_seconds(l, c, n) == pytest.approx(simulate(l, c, n), rel=1e-12, abs=1e-15)


def test_plan_equals_brute_force():
    rng = random.Random(1)
    for _ in range(400):
        chunk = rng.choice([16, 64, 128, 256])
        layers = rng.randint(1, 48)
        start = rng.randint(0, 8) * rng.choice([chunk, 128, 16])
        match_end = start + rng.randint(0, 40 * chunk // 16) * 16 + rng.choice([0, 0, 5, 127])
        end = match_end + rng.randint(1, 300)
        tau = 10 ** rng.uniform(-9, -5)  # seconds per token and layer: a fast disk to a slow link
        compute = quadratic(10 ** rng.uniform(-5, -3), 10 ** rng.uniform(-11, -8))
        p = plan_split(start, match_end, end, chunk, layers, tau, compute)
        t, _ = brute_force(start, match_end, end, chunk, layers, tau, compute)
        assert p.predicted_seconds == pytest.approx(t, rel=1e-9)
        assert p.predicted_seconds <= min(p.load_all_seconds, p.recompute_all_seconds) + 1e-15
        assert start <= p.load_end <= match_end
        assert p.load_end in (start, match_end) or p.load_end % chunk == 0


def test_extremes():
    compute = quadratic(7e-4, 0.0)  # ~1400 tokens/s, as a small model prefills on two cores
    fast = plan_split(0, 2048, 2100, 256, 30, 1e-9, compute)
    assert fast.load_end == 2048 and fast.recompute_tokens == 0
    slow = plan_split(0, 2048, 2100, 256, 30, 1e-3, compute)
    assert slow.load_end == 0 and slow.recompute_tokens == 2048
    # in between both paths are busy: a real split, better than either extreme
    mid = plan_split(0, 4096, 4100, 256, 30, 7e-4 / 30, compute)
    assert 0 < mid.load_end < 4096
    assert mid.predicted_seconds < min(mid.load_all_seconds, mid.recompute_all_seconds)


def test_margin_keeps_loading_unless_a_split_clearly_wins():
    compute = quadratic(7e-4, 0.0)
    exact = plan_split(0, 4096, 4100, 256, 30, 7e-4 / 30, compute)
    gain = 1 - exact.predicted_seconds / exact.load_all_seconds
    assert 0 < gain < 0.6
    assert plan_split(0, 4096, 4100, 256, 30, 7e-4 / 30, compute, margin=gain * 0.9).load_end == exact.load_end
    held = plan_split(0, 4096, 4100, 256, 30, 7e-4 / 30, compute, margin=gain * 1.1)
    assert held.load_end == 4096 and held.predicted_seconds == held.load_all_seconds
    # a link too slow to use: recomputing everything beats loading by far more than any sane margin
    assert plan_split(0, 2048, 2100, 256, 30, 1e-3, compute, margin=0.15).load_end == 0
    with pytest.raises(ValueError, match="margin"):
        plan_split(0, 100, 200, 16, 4, 1e-6, compute, margin=1.0)


def test_candidates():
    assert candidates(0, 1000, 256) == [0, 256, 512, 768, 1000]
    assert candidates(128, 768, 256) == [128, 256, 512, 768]
    assert candidates(300, 300, 256) == [300]
    with pytest.raises(ValueError):
        candidates(10, 5, 256)
    with pytest.raises(ValueError):
        plan_split(0, 100, 50, 16, 4, 1e-6, quadratic(1e-4, 0))


def test_prefill_model_fits_steps():
    m = PrefillModel()
    assert not m.ready and m.compute_seconds(0, 100) == 0.0
    a, b, c = 0.02, 6e-4, 2e-8
    truth = lambda parts: a + sum(b * n + c * ((p + n) ** 2 - p ** 2) for p, n in parts)  # noqa: E731
    m.observe([(0, 512)], truth([(0, 512)]))
    assert m.ready and m.compute_seconds(0, 512) == pytest.approx(truth([(0, 512)]))  # proportional at first
    for parts in ([(0, 2048)], [(0, 128)], [(1024, 300), (0, 700)], [(3000, 1000)], [(0, 4000)]):
        m.observe(parts, truth(parts))
    m.observe([(500, 1)], 5.0)  # a decode step: below min_tokens, ignored
    got = m.compute_seconds(1000, 3000)
    assert got == pytest.approx(b * 2000 + c * (3000 ** 2 - 1000 ** 2), rel=0.02)


def test_load_rate():
    r = LoadRate(alpha=0.5)
    r.observe(1000, 10_000_000, 0.01)
    assert r.seconds_per_token_layer == pytest.approx(1e-5) and r.bytes_per_second == pytest.approx(1e9)
    r.observe(1000, 10_000_000, 0.03)
    assert r.seconds_per_token_layer == pytest.approx(2e-5)
    r.observe(0, 0, 1.0)  # nothing loaded: ignored
    assert r.seconds_per_token_layer == pytest.approx(2e-5)
