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
    with pytest.raises(ValueError):
        ProfileConfig(separate_overlapped_loads="yes")


def test_bandwidth_ewma() -> None:
    prof = LatencyProfile(ProfileConfig(bandwidth_alpha=0.5))
    prof.observe_load(1e9, 1.0)
    assert prof.bandwidth == pytest.approx(1e9)
    prof.observe_load(3e9, 1.0)
    assert prof.bandwidth == pytest.approx(2e9)
    prof.observe_load(1e6, 0.0)  # unmeasurable: ignored
    assert prof.bandwidth == pytest.approx(2e9)


def test_overlapped_loads_kept_apart() -> None:
    """Loads beside a replay get their own estimate; hybrid plans read it, load-only plans the other."""
    prof = LatencyProfile(ProfileConfig(bandwidth_alpha=0.5))
    prof.observe_load(4e9, 1.0)  # a load-only restoration
    assert prof.bandwidth_for(True) == pytest.approx(4e9)  # nothing overlapped yet: the load-alone figure
    prof.observe_load(3e9, 1.0, overlapped=True)
    prof.observe_load(2e9, 1.0, overlapped=True)
    assert prof.overlap_bandwidth == pytest.approx(2.5e9) and prof.bandwidth == pytest.approx(2.5e9)
    assert prof.solo_bandwidth == pytest.approx(4e9) and prof.bandwidth_for(False) == pytest.approx(4e9)
    only_overlap = LatencyProfile()
    only_overlap.observe_load(1e9, 1.0, overlapped=True)
    assert only_overlap.bandwidth_for(False) == pytest.approx(1e9)
    prof.reset_bandwidth()
    assert prof.bandwidth is None and prof.bandwidth_for(False) is None
    mixed = LatencyProfile(ProfileConfig(bandwidth_alpha=0.5, separate_overlapped_loads=False))
    mixed.observe_load(4e9, 1.0)
    mixed.observe_load(2e9, 1.0, overlapped=True)  # one estimate over every load
    assert mixed.bandwidth == mixed.bandwidth_for(False) == pytest.approx(3e9) and mixed.overlap_bandwidth is None


def test_round_trip_json() -> None:
    prof = learned(seed=3)
    prof.observe_load(5e8, 0.5)
    prof.observe_load(3e8, 0.5, overlapped=True)
    again = LatencyProfile.from_json(prof.to_json())
    t = np.array([0, 7, 64, 999, 5000, 30000])
    assert np.allclose(prof(t), again(t))
    assert again.bandwidth == prof.bandwidth
    assert (again.solo_bandwidth, again.overlap_bandwidth) == (prof.solo_bandwidth, prof.overlap_bandwidth)
    assert again.config == prof.config
    with pytest.raises(ValueError):
        LatencyProfile.from_dict({**prof.to_dict(), "version": 99})


def test_executor_overheads_learned_and_persisted() -> None:
    prof = learned(seed=5, bandwidth_alpha=0.5)
    assert prof.suffix_overhead == pytest.approx(prof(1))  # prior: a one-token layer call
    assert prof.fixed_overhead == 0.0
    prof.observe_suffix(0.010, 0.004)  # a suffix call took 10 ms where F's difference said 4 ms
    assert prof.suffix_overhead == pytest.approx(0.006)
    prof.observe_suffix(0.002, 0.004)  # faster than the difference: clamped at 0
    assert prof.suffix_overhead == pytest.approx(0.0)  # the lower median of two
    prof.observe_suffix(0.007, 0.004)
    assert prof.suffix_overhead == pytest.approx(0.003)
    prof.observe_overhead(0.02)
    prof.observe_overhead(0.04)
    prof.observe_overhead(0.03)
    assert prof.fixed_overhead == pytest.approx(0.03)
    again = LatencyProfile.from_json(prof.to_json())
    assert again.suffix_overhead == pytest.approx(0.003) and again.fixed_overhead == pytest.approx(0.03)
    cost = BlockCost(4, 100.0, 0.0, prof, suffix_overhead=prof.suffix_overhead, fixed_seconds=prof.fixed_overhead)
    with_suffix = plan([RestoreRequest(512, 16)], cost, 1e6, 64)
    assert with_suffix.predicted_seconds >= 0.03 + 4 * 0.003
    old = {**prof.to_dict(), "suffix_overhead": 0.005, "fixed_overhead": None}  # saved before the window
    assert LatencyProfile.from_dict(old).suffix_overhead == pytest.approx(0.005)
    assert LatencyProfile.from_dict(old).fixed_overhead == 0.0


def test_a_cold_first_restoration_does_not_steer_later_plans() -> None:
    """The first restoration of a process is slow (one-off kernel and allocator costs): two warm ones later, the
    overheads and the compute scale are the warm values again (a running average kept 7x for many runs)."""
    prof = learned(seed=3)
    prof.observe_suffix(0.100, 0.004)  # cold: 25x
    prof.observe_overhead(0.5)
    prof.observe_compute(3.0, 1.0)
    for _ in range(2):
        prof.observe_suffix(0.005, 0.004)
        prof.observe_overhead(0.01)
        prof.observe_compute(1.05, 1.0)
    assert prof.suffix_overhead == pytest.approx(0.001)
    assert prof.fixed_overhead == pytest.approx(0.01)
    assert prof.compute_scale == pytest.approx(1.05)


@pytest.mark.parametrize("convex", [True, False])
def test_scalar_and_array_evaluation_agree(convex: bool) -> None:
    prof = learned(noise=0.2, seed=9, convex=convex)
    t = np.array([0, 1, 3, 15, 16, 17, 100, 1000, 8191, 8192, 9000, 50000, 10**6], dtype=np.int64)
    arr = prof(t)
    assert [prof(int(x)) for x in t] == pytest.approx(arr.tolist(), rel=1e-12, abs=1e-15)
    assert prof(np.int64(100)) == pytest.approx(prof(100)) and prof(100.0) == pytest.approx(prof(100))
    one = LatencyProfile()
    one.observe(64, 0.5)
    assert one(32) == pytest.approx(0.25) and one(np.array([32]))[0] == pytest.approx(0.25)


def test_convex_fit_runs_through_noisy_medians_not_under_them() -> None:
    """Bucket medians off the true curve by up to +-15% (what a shared CPU gives): the least-squares convex fit
    is unbiased over them (a lower convex hull would sit ~5% below, and a sum over 30 layers keeps that bias)."""
    rng = random.Random(4)
    prof = LatencyProfile(ProfileConfig(buckets_per_octave=4))
    factors = {}
    for _ in range(2000):
        t = int(2 ** rng.uniform(5, 12))
        b = prof._bucket(t)
        f = factors.setdefault(b, 1 + rng.uniform(-0.15, 0.15))  # a bucket's own systematic offset
        prof.observe(t, true_F(t) * f)
    t, y = prof.knots()
    meds = np.array([np.median([o[1] for o in prof._buckets[prof._bucket(int(x))]]) for x in t])
    rel = y / meds - 1
    assert abs(rel.mean()) < 0.03, rel
    assert np.all(np.diff(y) >= 0)
    f = prof(np.arange(16, 4096, 16))
    assert np.all(np.diff(f, 2) >= -1e-12 * f.max())  # still convex for the fast planner


def test_call_overhead_is_the_fits_intercept_and_compute_scale_learns() -> None:
    prof = learned(noise=0.0, seed=2)
    assert prof.call_overhead == pytest.approx(2e-4, rel=0.2)  # true_F's overhead term
    assert 0.0 <= prof.call_overhead <= prof(16)
    assert prof.compute_scale == 1.0
    prof.observe_compute(1.1, 1.0)
    assert prof.compute_scale == pytest.approx(1.1)
    prof.observe_compute(100.0, 1.0)  # clamped, and a lower median: one wild run does not wreck the plans
    assert prof.compute_scale == pytest.approx(1.1)
    prof.observe_compute(1.5, 1.0)
    assert prof.compute_scale == pytest.approx(1.5)
    assert LatencyProfile.from_json(prof.to_json()).compute_scale == pytest.approx(prof.compute_scale)


def test_executor_replay_time_shares_the_call_overhead_in_a_batch() -> None:
    from kvtide.restore.costs import ExecutorReplayTime

    prof = learned(noise=0.0, seed=2)
    c = prof.call_overhead
    one = ExecutorReplayTime(prof, c, 1)
    four = ExecutorReplayTime(prof, c, 4, scale=1.2)
    t = np.array([0, 1, 32, 512, 4096])
    assert np.allclose(one(t), prof(t))
    want = np.where(t > 0, 1.2 * (prof(t) - 0.75 * c), 0.0)
    assert np.allclose(four(t), want) and four(512) == pytest.approx(want[3]) and four(0) == 0.0
    # four requests recomputing 512 tokens in one layer call: one overhead, not four
    assert 4 * four(512) / 1.2 == pytest.approx(4 * prof(512) - 3 * c)
    f = four(np.arange(0, 8192, 32))
    assert np.all(np.diff(f) >= 0) and np.all(np.diff(f[1:], 2) >= -1e-12 * f.max())
    p = plan([RestoreRequest(2048)] * 4, BlockCost(8, 4096.0, 0.0, four), 1e9, 64)
    assert p.method == "fast"
    for bad in ({"batch": 0}, {"scale": 0.0}, {"call_overhead": -1.0}):
        with pytest.raises(ValueError):
            ExecutorReplayTime(prof, **{"call_overhead": c, **bad})


def test_layer_calls_outrank_whole_prefill_observations_in_a_bucket() -> None:
    """A prefill step / L carries per-step costs a layer call does not (on the H200 20-40% more): where the executor
    timed layer calls, F is theirs; where only prefills were seen, F still uses them; both survive a round trip."""
    prof = LatencyProfile(ProfileConfig(convex=False))
    for _ in range(5):
        prof.observe(1024, 2.0e-3 * 32, blocks=32, source="prefill")
        prof.observe(1024, 1.5e-3)
        prof.observe(8192, 30.0e-3 * 32, blocks=32, source="prefill")
    assert prof(1024) == pytest.approx(1.5e-3)
    assert prof(8192) == pytest.approx(30.0e-3)
    again = LatencyProfile.from_json(prof.to_json())
    assert again(1024) == pytest.approx(1.5e-3) and again(8192) == pytest.approx(30.0e-3)
    old = {**prof.to_dict(), "observations": {"40": [[1024, 1.0e-3]]}}  # saved without sources: layer calls
    assert LatencyProfile.from_dict(old)(1024) == pytest.approx(1.0e-3)
    with pytest.raises(ValueError, match="source"):
        prof.observe(10, 1.0, source="guess")


def test_suffix_scale_is_a_robust_slope_over_suffix_lengths() -> None:
    """Suffix calls measured at 0.4x their F difference plus 1 ms, one cold call among them: the slope and the
    intercept are learned (Theil-Sen), they survive a round trip, and equal-length suffixes leave the scale at 1."""
    prof = learned(seed=6)
    assert prof.suffix_scale == 1.0
    for m in (0.001, 0.004, 0.016, 0.064, 0.002, 0.032):
        prof.observe_suffix(0.001 + 0.4 * m, m)
    prof.observe_suffix(0.5, 0.008)  # cold: 60x
    assert prof.suffix_scale == pytest.approx(0.4, rel=0.05)
    assert prof.suffix_overhead == pytest.approx(0.001, rel=0.1)
    again = LatencyProfile.from_json(prof.to_json())
    assert again.suffix_scale == pytest.approx(prof.suffix_scale) and again.suffix_overhead == pytest.approx(
        prof.suffix_overhead)
    same = learned(seed=6)
    for x in (0.006, 0.005, 0.007):
        same.observe_suffix(x, 0.004)
    assert same.suffix_scale == 1.0 and same.suffix_overhead == pytest.approx(0.002)
    wild = learned(seed=6)
    for m in (0.001, 0.01, 0.1):
        wild.observe_suffix(50 * m, m)
    assert wild.suffix_scale == 4.0  # clamped


def test_suffix_scale_enters_the_plan_as_a_factor_on_sigma() -> None:
    prof = learned(noise=0.0, seed=2)
    req = [RestoreRequest(512, 256)]
    base = BlockCost(4, 100.0, 0.0, prof, suffix_overhead=0.001)
    half = BlockCost(4, 100.0, 0.0, prof, suffix_overhead=0.001, suffix_scale=0.5)
    sigma = prof(768) - prof(512)
    p_all = [[512] * 4]  # recompute everything: compute = 4 F(512) + 4 (k sigma + c)
    from kvtide.restore.costs import evaluate_staircase
    a, b = evaluate_staircase(req, p_all, base, 1e6, 64), evaluate_staircase(req, p_all, half, 1e6, 64)
    assert a.compute_seconds - b.compute_seconds == pytest.approx(4 * 0.5 * sigma, rel=1e-9)
    assert plan(req, half, 1e6, 64).predicted_seconds <= plan(req, base, 1e6, 64).predicted_seconds
    with pytest.raises(ValueError, match="suffix_scale"):
        BlockCost(4, 100.0, 0.0, prof, suffix_scale=0.0)


def test_compute_scale_is_learned_per_batch_size() -> None:
    """The additive model errs differently for one request and for a batch: each size keeps its own ratio, and a
    size never seen uses the ratio over all sizes."""
    prof = LatencyProfile()
    for _ in range(3):
        prof.observe_compute(0.8, 1.0, batch=1)
        prof.observe_compute(1.5, 1.0, batch=4)
    assert prof.compute_scale_for(1) == pytest.approx(0.8)
    assert prof.compute_scale_for(4) == pytest.approx(1.5)
    assert prof.compute_scale_for(2) == prof.compute_scale  # unseen: the all-sizes lower median
    assert prof.compute_scale == pytest.approx(0.8)
    back = LatencyProfile.from_json(prof.to_json())
    assert back.compute_scale_for(4) == pytest.approx(1.5) and back.compute_scale_for(1) == pytest.approx(0.8)


@pytest.mark.parametrize("shape", ["weights-bound", "compute-bound"])
def test_call_overhead_at_reads_the_shared_part_where_the_calls_sit(shape: str) -> None:
    """A fixed cost per call (F = c + b t) is shared by a batch at any length; a GPU-like F, flat while the device
    is underused and then linear through ~0, shares nothing at long prefixes (the secant's intercept <= 0)."""
    prof = LatencyProfile()
    ts = [256, 512, 1024, 2048, 4096, 8192]
    for t in ts:
        y = 6e-3 + 7.5e-5 * t if shape == "weights-bound" else max(2.3e-3, 1.0e-6 * t)
        for _ in range(3):
            prof.observe(t, y)
    assert prof.call_overhead > 0
    if shape == "weights-bound":
        assert prof.call_overhead_at(512) == pytest.approx(6e-3, rel=0.05)
        assert prof.call_overhead_at(8192) == pytest.approx(6e-3, rel=0.05)
    else:
        assert prof.call_overhead_at(8192) == pytest.approx(0.0, abs=1e-4)
        assert prof.call_overhead_at(1024) == pytest.approx(prof.call_overhead, rel=0.05)  # flat: all shared
    assert 0.0 <= prof.call_overhead_at(3000) <= prof.call_overhead


def test_the_first_layer_call_at_each_token_count_is_not_learned() -> None:
    """A new shape's first call carries one-off costs (on the H200 2-10 ms over a 1-8 ms call); one such call alone
    in a bucket lifted F flat. observe_call drops it, observe (prefills, saved profiles) keeps everything."""
    prof = LatencyProfile()
    prof.observe_call(512, 0.013)  # first at 512: dropped
    assert prof.num_observations == 0
    for _ in range(3):
        prof.observe_call(512, 0.001)
    prof.observe_call(1024, 0.02)  # first at 1024: dropped
    prof.observe_call(1024, 0.002)
    assert prof.num_observations == 4
    assert prof(512) == pytest.approx(0.001) and prof(1024) == pytest.approx(0.002)
    raw = LatencyProfile(ProfileConfig(skip_first_layer_call=False))
    raw.observe_call(512, 0.013)
    assert raw.num_observations == 1
    back = LatencyProfile.from_json(prof.to_json())  # a saved profile's observations all come back
    assert back.num_observations == 4 and back(1024) == pytest.approx(0.002)
    with pytest.raises(ValueError, match="skip_first_layer_call"):
        ProfileConfig(skip_first_layer_call=1)  # type: ignore[arg-type]
