"""bench/kvserve_gpu.py on the CPU (what CI can run): every packaged profile is measured, and the table it writes
loads with table.py and carries the measured rates under the spec that ran."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from kvtide.transfer.pipeline import Pipeline
from kvtide.transfer.table import load_profiles

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import kvserve_gpu  # noqa: E402


def test_cpu_smoke_measures_every_profile_and_writes_tables(tmp_path):
    out = tmp_path / "kvserve_gpu.json"
    assert kvserve_gpu.main(["--device", "cpu", "--layers", "2", "--tokens", "64", "--reps", "1", "--warmup", "0",
                             "--real-kv", str(tmp_path / "absent"), "--out", str(out),
                             "--write-table", str(tmp_path)]) == 0
    doc = json.loads(out.read_text())
    rows = {r["spec"]: r for r in doc["rows"]}
    assert not doc["nvcomp"] and doc["kv"].startswith("random")
    for table in kvserve_gpu.source_tables():
        src = load_profiles(table)
        got = load_profiles(tmp_path / f"{table.stem}_gpu.json")
        assert len(got) == len(src)
        for s, g in zip(src, got):
            assert g.name == Pipeline(s.name).to_spec()  # no nvCOMP here: the CPU codecs ran, canonical spec
            r = rows[g.name]
            assert (g.encode_throughput, g.decode_throughput) == (r["encode_Bps"], r["decode_Bps"])
            assert g.ratio == s.ratio and g.quality == s.quality  # random KV: the profiled ratio is kept
            assert r["B_star_Bps"] == r["coding_Bps"] * (1 - 1 / r["ratio"])


def test_device_spec_swaps_entropy_stages():
    assert kvserve_gpu.device_spec("none|kivi:k=2,v=2,g=32|zstd:l=3", True) == "none|kivi|nvzstd"
    assert kvserve_gpu.device_spec("hadamard|uniform:k=3,v=3,g=32|ans", True) == "hadamard|uniform:k=3,v=3|nvans"
    assert kvserve_gpu.device_spec("none|kivi|pack", True) == "none|kivi|pack"
    assert kvserve_gpu.device_spec("none|kivi|zstd", False) == "none|kivi|zstd"
