"""bench/restore.py's service-time bound for a trace: the least total any overlapped plan can reach."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from restore import service_bound  # noqa: E402

from kvtide.store.bandwidth import gbps  # noqa: E402


def _run(method: str, details: list[dict], total: float, cached: int) -> dict:
    return {"link": "10 Gbps", "gbps": 10.0, "method": method, "restorations_detail": details,
            "restore_seconds_total": total, "restored_cached_tokens": cached}


def test_bound_balances_compute_and_link_and_beats_both_single_resources() -> None:
    P, S, cached, bpt, layers = 6.0, 3.0, 100_000, 4096.0, 32
    rec = _run("recompute", [{"recompute_s": 4.0, "suffix_s": 1.0}, {"recompute_s": 2.0, "suffix_s": 2.0}], P + S,
               cached)
    cf = _run("cacheflow", [], 8.0, cached)
    out = service_bound({"runs": [rec, cf]}, bpt, layers)["10 Gbps"]
    Lt = cached * bpt * layers / gbps(10.0)
    assert out["link_s_all_cached"] == pytest.approx(Lt)
    # the bound: load a fraction x of the cached KV, recompute the rest plus all new tokens, both ending together
    x = (P + S) / (P + Lt)
    assert out["ideal_s"] == pytest.approx(S + P * (1 - x)) == pytest.approx(Lt * x)
    assert out["ideal_s"] < min(P + S, Lt)
    assert out["ideal_service_gain"] == pytest.approx((P + S) / out["ideal_s"])
    assert out["service_gain"] == {"recompute": 1.0, "cacheflow": pytest.approx((P + S) / 8.0)}


def test_no_recompute_run_no_bound() -> None:
    assert service_bound({"runs": [_run("cacheflow", [], 1.0, 10)]}, 4096.0, 2) == {}
