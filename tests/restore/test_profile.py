"""Online latency profile: robust medians, monotone/convex shape, extrapolation, bandwidth, persistence."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtide.restore.planner import BlockCost, RestoreRequest, plan
from kvtide.restore.profile import LatencyProfile, ProfileConfig


def true_F(t: float) -> float:
    return 2e-4 + 1e-6 * t + 2e-10 * t * t  # overhead + linear + attention


def learned(noise: float = 0.05, seed: int = 0, **cfg) -> LatencyProfile:
    rng = random.Random(seed)
    prof = LatencyProfile(ProfileConfig(**cfg))
    for _ in range(600):
        t = int(2 ** rng.uniform(4, 13))
        prof.observe(t, true_F(t) * (1 + rng.uniform(-noise, noise)))
    return prof


def test_fallback_before_any_observation_and_zero_at_zero() -> None:
    prof = LatencyProfile()
    assert prof(0) == 0.0
    assert prof(100) > 0
    assert prof.bandwidth is None and prof.num_observations == 0


def test_learns_the_curve_within_noise() -> None:
    prof = learned()
    for t in (32, 200, 1000, 4000, 8000):
        assert prof(t) == pytest.approx(true_F(t), rel=0.08)
    assert prof(0) == 0.0


def test_medians_ignore_outliers() -> None:
    prof = learned(noise=0.0)
    before = prof(1024)
    for _ in range(5):
        prof.observe(1024, 10.0)  # five GC pauses among ~30 normal samples in the bucket
    assert prof(1024) == pytest.approx(before, rel=0.05)


def test_monotone_and_setup_convex_on_a_grid() -> None:
    prof = learned(noise=0.3, seed=1)
    t = np.arange(0, 20000, 16)
    f = prof(t)
    assert f[0] == 0.0
    assert np.all(np.diff(f) >= -1e-15)
    d2 = np.diff(f[1:], 2)
    assert np.all(d2 >= -1e-12 * f.max())  # convex for t > 0: the planner's fast path applies
    p = plan([RestoreRequest(8192)] * 2, BlockCost(16, 4096.0, 0.0, prof), 1.25e9, 16)
    assert p.method == "fast"


def test_nonconvex_mode_is_monotone_interpolation() -> None:
    prof = LatencyProfile(ProfileConfig(convex=False))
    for t, y in [(10, 1.0), (20, 1.5), (40, 1.4), (80, 4.0)]:
        prof.observe(t, y)
    t = np.arange(0, 200)
    f = prof(t)
    assert np.all(np.diff(f) >= -1e-15) and f[0] == 0.0
    assert prof(80) == pytest.approx(4.0)


def test_extrapolates_superlinearly_but_never_below_linear() -> None:
    prof = learned(noise=0.0)
    t_max = float(prof.knots()[0][-1])
    f_max = prof(t_max)
    assert prof(4 * t_max) >= 4 * f_max * 0.999  # at least proportional growth
    assert prof(4 * t_max) <= 16 * f_max  # at most quadratic
    assert prof(4 * t_max) == pytest.approx(true_F(4 * t_max), rel=0.25)


def test_per_block_division_and_validation() -> None:
    prof = LatencyProfile()
    prof.observe(100, 3.0, blocks=30)
    assert prof(100) == pytest.approx(0.1)
    for bad in [(0, 1.0), (10, -1.0), (10, float("nan"))]:
        with pytest.raises(ValueError):
            prof.observe(*bad)
    with pytest.raises(ValueError):
        ProfileConfig(window=0)
    with pytest.raises(ValueError):
        ProfileConfig(bandwidth_alpha=0.0)


def test_bandwidth_ewma() -> None:
    prof = LatencyProfile(ProfileConfig(bandwidth_alpha=0.5))
    prof.observe_load(1e9, 1.0)
    assert prof.bandwidth == pytest.approx(1e9)
    prof.observe_load(3e9, 1.0)
    assert prof.bandwidth == pytest.approx(2e9)
    prof.observe_load(1e6, 0.0)  # unmeasurable: ignored
    assert prof.bandwidth == pytest.approx(2e9)


def test_round_trip_json() -> None:
    prof = learned(seed=3)
    prof.observe_load(5e8, 0.5)
    again = LatencyProfile.from_json(prof.to_json())
    t = np.array([0, 7, 64, 999, 5000, 30000])
    assert np.allclose(prof(t), again(t))
    assert again.bandwidth == prof.bandwidth
    assert again.config == prof.config
    with pytest.raises(ValueError):
        LatencyProfile.from_dict({**prof.to_dict(), "version": 99})
