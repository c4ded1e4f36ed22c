"""bench/restore.py's isolated summary: the ideal gain, and the ideal at the load rate the hybrid methods saw."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from restore import ORDER, summarize_isolated  # noqa: E402


def _row(method: str, restore: float, rec: float, load: float, nbytes: float, assumed: float = 1e9) -> dict:
    return {"tokens": 1024, "gbps": 40.0, "batch": 1, "method": method, "rep": 0, "ttft_mean_s": restore,
            "restore_s": restore, "predicted_s": restore, "recompute_s": rec, "suffix_s": 0.01, "load_s": load,
            "overhead_s": 0.0, "load_bytes": nbytes, "bandwidth_assumed": assumed, "stolen_tokens": 0,
            "boundaries": [[0]], "planning_s": 1e-4}


def test_ideal_beside_a_replay_uses_the_hybrid_methods_load_rate() -> None:
    B = 1e9  # bytes of the whole prefix
    rows = [_row("recompute", 1.0, 0.99, 0.0, 0.0), _row("load", 0.8, 0.0, 0.8, B),  # alone: 1.25 GB/s
            _row("cacheflow", 0.6, 0.5, 0.5, 0.5 * B, assumed=1e9),  # beside: 1.0 GB/s
            _row("cake", 0.62, 0.5, 0.5, 0.5 * B), _row("layerwise", 0.65, 0.5, 0.5, 0.5 * B)]
    assert {r["method"] for r in rows} == set(ORDER)
    s = summarize_isolated(rows, layers=2)[0]
    assert s["t_ideal_s"] == pytest.approx(1 / (1 / 1.0 + 1 / 0.8))
    assert s["load_rate_alone_bytes_per_s"] == pytest.approx(1.25e9)
    assert s["load_rate_beside_replay_bytes_per_s"] == pytest.approx(1e9)
    ideal_beside = 1 / (1 / 1.0 + 1 / 1.0)  # the whole prefix at 1 GB/s takes 1.0 s
    assert s["t_ideal_beside_replay_s"] == pytest.approx(ideal_beside)
    assert s["cacheflow_fraction_of_ideal_gain_beside_replay"] == pytest.approx(ideal_beside / 0.6)
    assert s["cacheflow_assumed_over_measured_rate"] == pytest.approx(1.0)
    assert s["cacheflow_fraction_of_ideal_gain"] < s["cacheflow_fraction_of_ideal_gain_beside_replay"]
