import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtide.transfer.controller import BF16, Profile, Selection, benefit_threshold, pareto_front, select

GB = 1e9


def rand_profiles(rng: random.Random, n: int) -> list[Profile]:
    out = []
    for i in range(n):
        # coarse grids make ties and duplicates likely, which is where brute force and fast paths disagree
        out.append(Profile(f"p{i}", rng.choice([0.8, 1.0, 1.5, 2, 4, 4, 8, 12]),
                           rng.choice([0.5, 1, 2, 5, 10, 50, math.inf]) * GB,
                           rng.choice([1, 2, 5, 20, math.inf]) * GB,
                           rng.choice([0.9, 0.95, 0.97, 0.99, 1.0, 1.01])))
    return out


def brute_time(p, B, V, tm):
    return tm + V / p.throughput + (0 if math.isinf(B) else V / (p.ratio * B))


def test_profile_throughput_and_validation():
    p = Profile("a", 4.0, 2 * GB, 2 * GB, 0.98)
    assert p.throughput == pytest.approx(GB)
    assert Profile("b", 2, math.inf, GB, 1).throughput == pytest.approx(GB)
    assert BF16.throughput == math.inf
    for bad in [dict(ratio=0), dict(ratio=-1), dict(ratio=math.nan), dict(ratio=math.inf),
                dict(encode_throughput=0), dict(decode_throughput=-1), dict(quality=-0.1), dict(quality=math.nan),
                dict(name="")]:
        kw = dict(name="x", ratio=2.0, encode_throughput=1.0, decode_throughput=1.0, quality=1.0) | bad
        with pytest.raises(ValueError):
            Profile(**kw)


def test_benefit_threshold_cases():
    assert benefit_threshold(BF16) == 0.0
    assert benefit_threshold(Profile("a", 4, 2 * GB, 2 * GB, 1)) == pytest.approx(0.75 * GB)
    assert benefit_threshold(Profile("b", 2, math.inf, math.inf, 1)) == math.inf
    assert benefit_threshold(Profile("c", 0.5, GB, GB, 1)) < 0


@settings(max_examples=300, deadline=None)
@given(st.floats(1.01, 50), st.floats(1e6, 1e11), st.floats(1e6, 1e11), st.floats(1e5, 1e12), st.floats(1e3, 1e10))
def test_benefit_threshold_matches_time_model(cr, enc, dec, B, V):
    p = Profile("p", cr, enc, dec, 1.0)
    Bs = benefit_threshold(p)
    t0, tp = V / B, brute_time(p, B, V, 0.0)
    if B < Bs * (1 - 1e-9):
        assert tp < t0
    elif B > Bs * (1 + 1e-9):
        assert tp > t0


def test_select_equals_brute_force():
    rng = random.Random(1)
    for trial in range(400):
        ps = rand_profiles(rng, rng.randint(0, 12))
        B = rng.choice([0.1, 1, 5, 12.5, 100, math.inf]) * GB
        V = rng.choice([0, 1e6, 1e8, 5e9])
        tm = rng.choice([0.0, 0.05])
        slo = rng.choice([None, 0.0, 0.01, 0.1, 1.0, 10.0])
        qmin = rng.choice([0.0, 0.95, 0.97, 0.99, 1.0])
        s = select(ps, B, V, slo, qmin, tm)
        assert isinstance(s, Selection) and isinstance(s, Profile)
        qf = [p for p in ps + [BF16] if p.quality >= qmin]
        times = [brute_time(p, B, V, tm) for p in qf]
        ok = [t for t in times if slo is None or t <= slo]
        assert s.quality >= qmin
        assert s.predicted_time == pytest.approx(brute_time(s, B, V, tm), rel=1e-12)
        if ok:
            assert not s.slo_miss and s.predicted_time == pytest.approx(min(ok), rel=1e-12)
        else:
            assert s.slo_miss and s.predicted_time == pytest.approx(min(times), rel=1e-12)
        assert any(s == p for p in qf)


def test_selection_compares_equal_to_its_profile():
    p = Profile("fast", 8.0, 10 * GB, 10 * GB, 0.99)
    s = select([p], 1 * GB, 1e9, None, 0.97)
    assert s == p and p == s and hash(s) == hash(p) and s.profile == p and s.name == "fast"
    assert select([p], 1 * GB, 1e9, None, 1.0) == BF16  # quality budget rules p out


def test_select_slo_miss_flag():
    p = Profile("c", 10.0, 10 * GB, 10 * GB, 0.99)
    s = select([p], 1 * GB, 10e9, slo=0.5, min_quality=0.97)
    assert s.slo_miss and s == p
    assert not select([p], 1 * GB, 10e9, slo=5.0, min_quality=0.97).slo_miss


@pytest.mark.parametrize("kw", [dict(bandwidth=0), dict(bandwidth=-1), dict(bandwidth=math.nan), dict(volume=-1),
                                dict(volume=math.inf), dict(slo=-1), dict(min_quality=1.5), dict(min_quality=-0.1),
                                dict(model_time=-1)])
def test_select_validation(kw):
    args = dict(profiles=[], bandwidth=GB, volume=1e6, slo=None, min_quality=0.9) | kw
    with pytest.raises(ValueError):
        select(**args)
    with pytest.raises(TypeError):
        select(["x"], GB, 1e6, None, 0.9)  # type: ignore[list-item]


def test_pareto_equals_brute_force():
    rng = random.Random(2)
    for trial in range(300):
        ps = rand_profiles(rng, rng.randint(0, 25))
        front = pareto_front(ps)

        def dom(a, b):
            va, vb = (a.quality, a.ratio, a.throughput), (b.quality, b.ratio, b.throughput)
            return all(x >= y for x, y in zip(va, vb)) and va != vb

        assert front == [p for p in ps if not any(dom(q, p) for q in ps)]
