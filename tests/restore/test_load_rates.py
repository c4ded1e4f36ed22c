"""The planner's load rate: min(link, measured load path of the tier and codec), learned online; plans are monotone
in bandwidth (a faster link never makes the executed restoration slower beyond noise)."""
from __future__ import annotations

import statistics
import time
from typing import Any

import pytest

from kvtide.restore.profile import LatencyProfile
from kvtide.store import BandwidthLimitedStore, MemoryStore
from kvtide.store.bandwidth import gbps

from tests.restore.restore_helpers import fresh_store, greedy, restore_llm, two_turns


def test_path_rate_is_an_ewma_per_tier_kept_across_link_changes() -> None:
    p = LatencyProfile()
    assert p.path_bandwidth_for("MemoryStore/plain", True) is None
    p.observe_path("MemoryStore/plain", 1000, 1.0, overlapped=False)
    assert p.path_bandwidth_for("MemoryStore/plain", False) == 1000
    assert p.path_bandwidth_for("MemoryStore/plain", True) == 1000  # the other kind, while this one has none
    p.observe_path("MemoryStore/plain", 2000, 1.0, overlapped=True)
    assert p.path_bandwidth_for("MemoryStore/plain", True) == 2000
    a = p.config.bandwidth_alpha
    p.observe_path("MemoryStore/plain", 3000, 1.0, overlapped=False)
    assert p.path_bandwidth_for("MemoryStore/plain", False) == pytest.approx(a * 3000 + (1 - a) * 1000)
    assert p.path_bandwidth_for("RedisStore/zip", False) is None  # another tier and codec: its own rate
    p.observe_load(5000, 1.0)
    p.reset_bandwidth()
    assert p.bandwidth_for(False) is None
    assert p.path_bandwidth_for("MemoryStore/plain", True) == 2000  # the link changed, the path did not
    q = LatencyProfile.from_json(p.to_json())
    assert q.path_bandwidth_for("MemoryStore/plain", False) == p.path_bandwidth_for("MemoryStore/plain", False)
    assert q.path_bandwidth_for("MemoryStore/plain", True) == 2000


@pytest.mark.parametrize("nbytes,seconds", [(0, 1.0), (100, 0.0), (100, -1.0), (float("nan"), 1.0),
                                            (100, float("inf"))])
def test_unmeasurable_path_observations_are_ignored(nbytes: float, seconds: float) -> None:
    p = LatencyProfile()
    p.observe_path("t", nbytes, seconds)
    assert p.path_bandwidth_for("t", False) is None


class SlowPathStore(MemoryStore):
    """A memory tier whose reads take ``nbytes / rate`` seconds (a host load path slower than the link)."""

    def __init__(self, capacity: int, rate: float) -> None:
        super().__init__(capacity)
        self.rate = rate

    def fetch(self, items: Any, max_bytes: int | None = None) -> Any:
        f = super().fetch(items, max_bytes=max_bytes)
        time.sleep(f.nbytes / self.rate)
        return f


def _set_link(r: Any, inner: SlowPathStore, link_bytes_per_s: float) -> None:
    """The link changes (as bench/restore.py switches links): the end-to-end estimate starts over."""
    r.use_store(BandwidthLimitedStore.at_gbps(inner, link_bytes_per_s * 8 / 1e9), writes=inner)
    r.cfg.bandwidth_gbps = link_bytes_per_s * 8 / 1e9
    r.profile.reset_bandwidth()


def test_a_link_faster_than_the_load_path_plans_at_the_path_rate_and_is_not_slower() -> None:
    llm = restore_llm(method="cacheflow")
    r = llm.engine.restorer
    fresh_store(llm)
    saved = r.cfg.bandwidth_gbps
    try:
        prompt, ref = two_turns(llm, 3000, first=300, extra=20, out=2)
        full = [k for k in r.store.records()]  # what turn 1 wrote, copied into the slow tier
        # the path: loading every cached token alone takes ~3x recomputing them, so a plan that trusted a fast
        # link would load far more than the path delivers in time
        cached = (len(prompt) // r.chunk) * r.chunk
        t0 = time.perf_counter()
        with _no_store_lookups(r):
            llm.generate(prompt, greedy(1))
        t_recompute = max(time.perf_counter() - t0, 0.02)
        path = cached * r.num_layers * r.bytes_per_token / (3.0 * t_recompute)
        slow = SlowPathStore(256 << 20, path)
        for name, blob in full:
            slow._write(name, blob)
        links = {"slow": 0.5 * path, "fast": 4.0 * path, "fastest": 16.0 * path}
        _set_link(r, slow, links["slow"])
        for _ in range(2):  # warm-up: F and the path's rate are learned here
            assert llm.generate(prompt, greedy(2))[0].token_ids == ref
        assert r.profile.path_bandwidth_for(r.tier, True) is not None
        ttft: dict[str, list[float]] = {k: [] for k in links}
        for rep in range(3):
            for name in (list(links) if rep % 2 == 0 else list(reversed(links))):
                _set_link(r, slow, links[name])
                n0 = r.stats.restorations
                assert llm.generate(prompt, greedy(2))[0].token_ids == ref
                assert r.stats.restorations == n0 + 1
                rec = r.history[-1]
                if name != "slow":  # the plan assumed what the path carries, not the link's nominal rate
                    assert rec.bandwidth <= 1.5 * path < links[name]
                ttft[name].append(rec.total_seconds)
        med = {k: statistics.median(v) for k, v in ttft.items()}
        noise = 0.25 * med["slow"] + 0.02
        assert med["fast"] <= med["slow"] + noise, ttft
        assert med["fastest"] <= med["fast"] + noise, ttft
    finally:
        r.cfg.bandwidth_gbps = saved
        fresh_store(llm)


class _no_store_lookups:
    """Plain prefill of a prompt whose chunks are in the store (the recompute time the path is scaled to)."""

    def __init__(self, r: Any) -> None:
        self.r, self.eng = r, r.engine

    def __enter__(self) -> None:
        self.eng.restorer = None

    def __exit__(self, *exc: Any) -> None:
        self.eng.restorer = self.r


def test_the_assumed_rate_is_the_least_of_link_path_and_measured() -> None:
    llm = restore_llm(method="cacheflow")
    r = llm.engine.restorer
    saved = r.cfg.bandwidth_gbps
    try:
        r.profile.reset_bandwidth()
        r.cfg.bandwidth_gbps = 80.0
        r.profile._path.pop((r.tier, True), None)
        r.profile._path.pop((r.tier, False), None)
        assert r.bandwidth() == gbps(80.0)
        r.profile.observe_path(r.tier, gbps(30.0), 1.0, overlapped=True)
        assert r.bandwidth() == pytest.approx(gbps(30.0))
        r.cfg.bandwidth_gbps = 10.0
        assert r.bandwidth() == pytest.approx(gbps(10.0))
        r.profile.observe_load(gbps(5.0), 1.0, overlapped=True)
        assert r.bandwidth() == pytest.approx(gbps(5.0))
    finally:
        r.cfg.bandwidth_gbps = saved
        r.profile.reset_bandwidth()
        r.profile._path.clear()
