"""The window bootstrap of relative accuracy: coverage on a synthetic case with a known ratio, determinism."""
import numpy as np
import pytest

from kvtide.transfer.bootstrap import BootstrapConfig, ratio_interval, ratio_replicates


def _synthetic(rng: np.random.Generator, windows: int = 16, positions: int = 256):
    """Per-window correct counts of a reference and of a profile, paired position by position.

    Window difficulty p ~ Beta(5, 5) (mean 0.5); a reference-correct position stays correct with prob. 0.95, a
    wrong one turns correct with prob. 0.02, so the true ratio is (0.95 * 0.5 + 0.02 * 0.5) / 0.5 = 0.97.
    """
    p = rng.beta(5, 5, windows)
    ref = rng.binomial(positions, p)
    prof = rng.binomial(ref, 0.95) + rng.binomial(positions - ref, 0.02)
    return prof, ref


def test_coverage_of_a_known_ratio():
    rng = np.random.default_rng(1)
    cfg = BootstrapConfig(resamples=1000)
    strata = [0] * 8 + [1] * 8
    hits, reps = 0, 400
    for _ in range(reps):
        prof, ref = _synthetic(rng)
        lo, hi = ratio_interval(prof, ref, strata, cfg)
        hits += lo <= 0.97 <= hi
    assert 0.925 <= hits / reps <= 0.975  # nominal 0.95; binomial sd of the estimate ~0.011


def test_interval_narrows_with_windows_and_holds_the_point():
    rng = np.random.default_rng(2)
    widths = []
    for w in (8, 64):
        prof, ref = _synthetic(rng, windows=w)
        lo, hi = ratio_interval(prof, ref)
        assert lo <= prof.sum() / ref.sum() <= hi
        widths.append(hi - lo)
    assert widths[1] < widths[0] / 2  # ~1/sqrt(windows)


def test_deterministic_and_seeded():
    prof, ref = _synthetic(np.random.default_rng(3))
    a = ratio_interval(prof, ref, config=BootstrapConfig(seed=5))
    assert a == ratio_interval(prof, ref, config=BootstrapConfig(seed=5))
    assert a != ratio_interval(prof, ref, config=BootstrapConfig(seed=6))


def test_identical_counts_give_a_point_interval_and_strata_stay_balanced():
    ref = np.array([10, 200, 30, 40])
    assert ratio_interval(ref, ref, [0, 0, 1, 1]) == (1.0, 1.0)
    # one window per stratum: no spread to resample, every replicate is the full sample, no interval
    reps = ratio_replicates([1, 3], [2, 4], strata=["a", "b"], config=BootstrapConfig(resamples=1000))
    assert np.allclose(reps, 4 / 6)
    assert ratio_interval([1, 3], [2, 4], strata=["a", "b"]) == (-np.inf, np.inf)


def test_percentile_of_plain_resamples_would_undercover():
    """Why the rescaling and the t quantile: plain percentiles of 16 resampled windows miss more often."""
    rng = np.random.default_rng(1)
    cfg = BootstrapConfig(resamples=1000)
    plain = ours = 0
    for _ in range(400):
        prof, ref = _synthetic(rng)
        reps = ratio_replicates(prof, ref, config=cfg)
        pt = prof.sum() / ref.sum()
        raw = pt + (reps - pt) / np.sqrt(16 / 15)  # undo the rescaling: a plain bootstrap's replicates
        lo, hi = np.quantile(raw, [0.025, 0.975])
        plain += lo <= 0.97 <= hi
        lo, hi = ratio_interval(prof, ref, config=cfg)
        ours += lo <= 0.97 <= hi
    assert plain < ours


@pytest.mark.parametrize("kw", [dict(resamples=999), dict(confidence=1.0), dict(seed=-1)])
def test_config_fails_fast(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        BootstrapConfig(**kw)


def test_bad_inputs():
    with pytest.raises(ValueError):
        ratio_interval([1, 2], [0, 0])
    with pytest.raises(ValueError):
        ratio_interval([1, 2], [1, 2, 3])
    with pytest.raises(ValueError):
        ratio_interval([1, 2], [1, 2], strata=[0])
