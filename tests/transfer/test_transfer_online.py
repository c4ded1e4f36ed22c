import math
import random
import time

import pytest

from kvtide.transfer.controller import BF16, Profile, select
from kvtide.transfer.online import OnlineConfig, OnlineController, lower_envelope

GB = 1e9


def profiles():
    return [
        Profile("light", 1.8, 40 * GB, 40 * GB, 1.0),  # lossless-ish, cheap
        Profile("mid", 4.0, 12 * GB, 12 * GB, 0.99),
        Profile("heavy", 8.0, 4 * GB, 4 * GB, 0.98),
        Profile("max", 12.0, 1 * GB, 1 * GB, 0.97),
        Profile("bad", 3.0, 1 * GB, 1 * GB, 0.99),  # dominated: never on an envelope
    ]


def test_envelope_matches_brute_force():
    rng = random.Random(3)
    for _ in range(200):
        ps = [Profile(f"p{i}", rng.choice([1.0, 1.5, 2, 3, 4, 8, 16]), rng.choice([0.5, 1, 3, 10, math.inf]) * GB,
                      rng.choice([1, 4, math.inf]) * GB, 1.0) for i in range(rng.randint(1, 10))]
        env, starts = lower_envelope(ps)
        assert starts[0] == 0 and starts == sorted(starts)
        for x in [0, 1e-12, 1e-10, 3e-10, 1e-9, 1e-8, 1e-6, 1.0]:
            i = max(j for j, s in enumerate(starts) if s <= x)
            f = lambda p: 1 / p.throughput + x / p.ratio  # noqa: E731
            assert f(env[i]) == pytest.approx(min(f(p) for p in ps), rel=1e-9, abs=1e-18)


def test_no_drift_agrees_with_select():
    ctl = OnlineController(profiles(), OnlineConfig(epsilon=0.0))
    rng = random.Random(4)
    for _ in range(300):
        B = rng.choice([0.5, 1, 2, 5, 10, 25, 50, 100, 400]) * GB / 8
        q = rng.choice([0.95, 0.97, 0.99, 1.0])  # bucket thresholds: other budgets round up to one
        d = ctl.decide(B, 2e9, None, q)
        s = select(profiles(), B, 2e9, None, q)
        assert d.predicted_time == pytest.approx(s.predicted_time)
        assert d.profile.quality >= q


def test_bandit_tracks_drift_to_true_fastest():
    ps = profiles()
    ctl = OnlineController(ps, OnlineConfig(epsilon=0.15, alpha=0.3, seed=7))
    B, V = 2 * GB / 8, 2e9  # 2 Gbps: envelope says "heavy", neighbours "mid" and "max"
    true = {p.name: p for p in ps + [BF16]}

    def observed(p, slow):
        enc, dec = p.encode_throughput, p.decode_throughput
        if slow and p.name == "heavy":
            enc, dec = enc / 4, dec / 4  # contention on the GPU running heavy's kernels
        return V / enc + V / dec + V / (p.ratio * B)

    picks = []
    for step in range(600):
        d = ctl.decide(B, V, None, 0.97)
        assert d.profile.name in ("mid", "heavy", "max")
        ctl.observe(d, observed(true[d.profile.name], slow=step >= 200))
        picks.append(d.profile.name)
    before, after = picks[100:200], picks[450:]
    fastest_after = min(("mid", "heavy", "max"), key=lambda n: observed(true[n], True))
    assert fastest_after != "heavy"
    assert before.count("heavy") / len(before) > 0.8
    assert after.count(fastest_after) / len(after) > 0.8


def test_slo_guardrail_cooldown_and_fallback():
    ps = profiles()
    cfg = OnlineConfig(epsilon=0.0, k_violations=2, m_window=4, cooldown=5)
    ctl = OnlineController(ps, cfg)
    B, V = 2 * GB / 8, 2e9
    d = ctl.decide(B, V, 10.0, 0.97)
    assert d.profile.name == "heavy"
    for _ in range(2):  # heavy blows the SLO twice (unmodelled) -> cooldown
        d = ctl.decide(B, V, 10.0, 0.97)
        ctl.observe(d, 11.0)
    names = [ctl.decide(B, V, 10.0, 0.97).profile.name for _ in range(5)]
    assert "heavy" not in names
    assert ctl.decide(B, V, 10.0, 0.97).profile.name in ("mid", "heavy", "max")
    # an impossible SLO falls back to the safe profile, flagged
    d = ctl.decide(B, V, 1e-6, 0.97)
    assert d.fallback and d.slo_miss and d.profile == BF16
    safe = OnlineController(ps, cfg, safe=ps[1]).decide(B, V, 1e-6, 0.97)
    assert safe.profile.name == "mid" and safe.fallback


def test_high_bandwidth_prefers_bf16_and_filters_nonbeneficial():
    ctl = OnlineController(profiles(), OnlineConfig(epsilon=0.0))
    key, cands = ctl.candidates(1000 * GB, 0.97)
    assert cands[0] is BF16 and all(c is BF16 or c.name == "light" for c in cands)
    assert ctl.decide(1000 * GB, 1e9, None, 0.97).profile in (BF16, profiles()[0])


def test_config_validation():
    for bad in [dict(buckets=(0.9, 0.95)), dict(buckets=(0.99, 0.9, 1.0)), dict(epsilon=2), dict(alpha=0),
                dict(k_violations=5, m_window=3)]:
        with pytest.raises(ValueError):
            OnlineConfig(**bad)
    with pytest.raises(ValueError):
        OnlineController(profiles()).observe(OnlineController(profiles()).decide(GB, 1e9, None, 0.9), -1.0)


def test_decision_under_a_millisecond():
    rng = random.Random(5)
    many = [Profile(f"p{i}", rng.uniform(1, 16), rng.uniform(0.5, 50) * GB, rng.uniform(0.5, 50) * GB,
                    rng.uniform(0.9, 1.0)) for i in range(200)]
    ctl = OnlineController(many)
    n = 2000
    t0 = time.perf_counter()
    for i in range(n):
        d = ctl.decide(rng.uniform(0.5, 100) * GB / 8, 1e9, 1.0, rng.choice([0.9, 0.97, 0.99]))
        ctl.observe(d, d.predicted_time * 1.1)
    per = (time.perf_counter() - t0) / n
    assert per < 1e-3, per
