"""bench/tools/kvserve_search.py --replay: the subset study answered from an earlier result's table, no model run;
a table that lacks a subset configuration is refused rather than evaluated."""
from __future__ import annotations

import json

import pytest

from bench.tools import kvserve_search
from kvtide.transfer.search_space import stratified_subset, wide_space
from tests.transfer.test_transfer_search_space import synthetic_table


def _previous(tmp_path, drop: int = 0):
    sub = stratified_subset(wide_space(), 150, seed=0)
    rows = {s: {"spec": s, "ratio": r, "encode_throughput": e, "decode_throughput": d, "quality": q}
            for s, (r, e, d, q) in synthetic_table(sub).items()}
    for s in list(rows)[:drop]:
        del rows[s]
    doc = {"model": "smollm2-135m", "workload": "prose", "threshold": 0.97,
           "quality_config": {"prefix": 512, "continuation": 64, "samples": 4}, "table": rows,
           "header": {"kvtide_git": "abc"}, "full_space": {"runs": [{"mode": "bo", "best_ratio": 5.0}]}}
    path = tmp_path / "prev.json"
    path.write_text(json.dumps(doc))
    return path, rows


def test_replay_reproduces_the_table_and_reaches_the_optimum(tmp_path, monkeypatch):
    monkeypatch.setattr(kvserve_search, "PipelineEvaluator", None)  # a replay must not build an evaluator
    prev, rows = _previous(tmp_path)
    out = tmp_path / "out.json"
    kvserve_search.main(["--replay", str(prev), "--seeds", "1", "--random-seeds", "2", "--resample", "1",
                         "--resample-size", "60", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["table"] == rows and doc["subset_fresh_evaluations"] == 0
    best = max(r["ratio"] for r in rows.values() if r["quality"] >= 0.97)
    assert doc["subset"]["optimum_ratio"] == best and doc["subset"]["bo"]["reached"] == 1
    assert doc["resampled"][0]["size"] == 60 and doc["resampled"][0]["bo"]["runs"] == 1
    assert doc["full_space_previous"]["kvtide_git"] == "abc" and "full_space" not in doc


def test_replay_refuses_a_table_without_the_subset(tmp_path):
    prev, _ = _previous(tmp_path, drop=1)
    with pytest.raises(SystemExit, match="not in the replayed table"):
        kvserve_search.main(["--replay", str(prev), "--seeds", "1", "--out", str(tmp_path / "out.json")])
