"""`kvtide bench gpu` on the CPU: its plan (the steps and the flags of the cited runs), the dry run, the refusal on a
machine without CUDA, the step runner, and the summary built from the committed result JSONs."""
from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

import pytest

from kvtide import cli
from tests.cli_parse import parse_only

gpu = cli.bench_suite("gpu")
ROOT = Path(__file__).resolve().parents[2]
V2 = ROOT / "bench/results/zip_attention_cuda_v2_stage_h200.json"
ENGINE = ROOT / "bench/results/zip_engine_largest2_h200.json"


def _plan(tmp_path: Path, *args: str) -> dict:
    steps = gpu.plan(gpu.parser().parse_args(["--out-dir", str(tmp_path / "run"), *args]))
    return {s.name: s for s in steps}


def test_the_suite_is_registered_and_the_dry_run_lists_the_steps(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["bench", "gpu", "--dry-run", "--out-dir", str(out)]) == 0
    text = capsys.readouterr().out
    for i, name in enumerate(("real-kv", "tests", "zip-attention", "zip-engine", "summary"), 1):
        assert f"{i}. {name}" in text
    assert "--skip-triton --clean-flush" in text and "--batches 67 --zip-largest 67" in text
    assert "minutes of GPU time" in text and not out.exists()  # a dry run writes nothing


def test_default_steps_and_all(tmp_path):
    assert list(_plan(tmp_path)) == ["real-kv", "tests", "zip-attention", "zip-engine"]
    assert list(_plan(tmp_path, "--steps", "all")) == list(gpu.STEPS)
    assert sum(s.minutes for s in _plan(tmp_path).values()) < 15  # the default run fits the GPU machine's budget
    with pytest.raises(SystemExit):
        _plan(tmp_path, "--steps", "tests,bogus")


def test_the_kernel_sweep_takes_the_flags_of_the_cited_rows(tmp_path, monkeypatch):
    """The v2 sweep parses with zip-attention's own options to what the cited JSON recorded: format, shapes,
    rounds, CUDA kernel only (no Triton rows), the clean-flush figures, the real-KV file."""
    cited = json.loads(V2.read_text())
    ns = parse_only(list(_plan(tmp_path)["zip-attention"].argv[3:]), monkeypatch)
    rows = cited["results"]
    assert ns.version == cited["shape"]["format_version"] == 2
    assert sorted(ns.contexts) == sorted({r["context"] for r in rows})
    assert sorted(ns.batches) == sorted({r["batch"] for r in rows})
    assert all(r["rounds"]["n"] == ns.rounds for r in rows)
    assert ns.skip_triton and not any("zip" in r for r in rows)
    assert ns.clean_flush and all("flashinfer_us_clean_flush" in r for r in rows)
    assert ns.real_kv.endswith(gpu.REAL_KV) and gpu.REAL_KV in cited["kv_data"]
    v1 = parse_only(list(_plan(tmp_path, "--steps", "all")["zip-attention-v1"].argv[3:]), monkeypatch)
    assert v1.version == 1 and v1.out.endswith("zip_attention_v1.json")


def test_the_engine_run_takes_the_flags_of_the_cited_rows(tmp_path, monkeypatch):
    cited = json.loads(ENGINE.read_text())
    setup = cited["setup"]
    ns = parse_only(list(_plan(tmp_path)["zip-engine"].argv[3:]), monkeypatch)
    assert ns.cuda_graphs == setup["cuda_graphs"] and ns.graphs == setup["graphs"]
    assert sorted(int(b) for b in ns.batches.split(",")) == setup["batches"]
    assert sorted(ns.only.split(",")) == setup["only"]
    assert (ns.context, ns.steps, ns.format_version) == (setup["context"], setup["timed_decode_steps"],
                                                         setup["format_version"])
    assert f"{ns.budget_seqs:g} uncompressed" in setup["budget_note"]
    assert ns.zip_largest == cited["backends"]["zip"]["largest_batch"]
    assert gpu.REAL_KV in cited["kv_source"]["model"] and ns.real_kv.endswith(gpu.REAL_KV)


def test_quick_shrinks_every_step(tmp_path, monkeypatch):
    plan = _plan(tmp_path, "--quick")
    assert "-m" in plan["tests"].argv and "gpu" in plan["tests"].argv
    att = parse_only(list(plan["zip-attention"].argv[3:]), monkeypatch)
    eng = parse_only(list(plan["zip-engine"].argv[3:]), monkeypatch)
    assert att.contexts == [2048] and att.batches == [32] and not att.clean_flush
    assert eng.context < 8192 and eng.steps < 255
    assert sum(s.minutes for s in plan.values()) < sum(s.minutes for s in _plan(tmp_path).values())


def test_the_gpu_test_list_names_existing_tests(tmp_path):
    argv = _plan(tmp_path)["tests"].argv
    for entry in gpu.GPU_TESTS:
        assert entry in argv
        path, _, name = entry.partition("::")
        assert (ROOT / path).exists(), path
        if name:
            assert f"def {name}(" in (ROOT / path).read_text(), entry


def test_the_real_kv_step_uses_joins_or_captures(tmp_path):
    path = tmp_path / "real_kv.safetensors"
    assert "--capture" in gpu.real_kv_step(path).argv
    for suffix in gpu.PLANES:
        path.with_suffix(suffix).write_bytes(b"x")
    join = gpu.real_kv_step(path).argv
    assert "join" in join and str(path) in join
    path.write_bytes(b"x" * 10)
    step = gpu.real_kv_step(path)
    assert step.argv == () and "10 bytes" in step.what


def test_a_machine_without_cuda_is_refused_with_a_clear_message(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "run"
    assert gpu.main(["--out-dir", str(out)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err and not out.exists()


def test_run_step_tees_the_output_and_reports_the_status(tmp_path, capsys):
    ok = gpu.run_step(gpu.Step("hello", "prints", (sys.executable, "-c", "print('hello from the step')"), 0.1),
                      tmp_path)
    assert ok["status"] == "ok" and "hello from the step" in (tmp_path / "hello.log").read_text()
    assert "hello from the step" in capsys.readouterr().out
    bad = gpu.run_step(gpu.Step("bad", "fails", (sys.executable, "-c", "raise SystemExit(3)"), 0.1), tmp_path)
    assert bad["rc"] == 3 and bad["status"] == "failed (rc 3)"


def test_a_failed_capture_skips_the_suites_and_the_summary_is_written(tmp_path, monkeypatch, capsys):
    steps = [gpu.Step("real-kv", "fails", (sys.executable, "-c", "raise SystemExit(1)"), 0.1),
             gpu.Step("zip-engine", "needs it", (sys.executable, "-c", "pass"), 0.1, "zip_engine.json", True)]
    monkeypatch.setattr(gpu, "preflight", lambda: None)
    monkeypatch.setattr(gpu, "plan", lambda a: steps)
    out = tmp_path / "run"
    assert gpu.main(["--out-dir", str(out), "--real-kv", str(tmp_path / "absent.safetensors")]) == 1
    doc = json.loads((out / "gpu_summary.json").read_text())
    assert next(iter(doc)) == "header"
    assert [s["status"] for s in doc["steps"]] == ["failed (rc 1)", "skipped: no real-KV capture"]
    assert doc["figures"] == [] and "no headline results" in capsys.readouterr().out


def _run_folder(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(V2, run / "zip_attention_v2.json")
    shutil.copy(ENGINE, run / "zip_engine.json")
    (run / "tests.log").write_text("....\n478 passed in 59.22s\n")
    return run


def test_the_summary_reads_the_committed_results(tmp_path, capsys):
    """The committed JSONs copied in as a run's: every v2 shape reproduces itself (1.000); the engine figure is set
    against the median of the ten cited runs; what was not run (v1, equal batches) has no row."""
    run = _run_folder(tmp_path)
    rows = {r["figure"]: r for r in gpu.summary([run])}
    v2 = [r for name, r in rows.items() if name.startswith("attention v2")]
    assert len(v2) == 6 and all(r["compared"] and r["ratio"] == pytest.approx(1.0) for r in v2)
    assert not any(name.startswith(("attention v1", "engine tok/s, equal")) for name in rows)
    big = rows["engine tok/s, each at its largest: zip / FlashInfer"]
    cited = [json.loads((ROOT / c).read_text())["ratios_zip_over_baseline"]["largest_batch"]
             ["zip_over_baseline_tokens_per_s"] for c in gpu.ENGINE_LARGEST]
    new = json.loads(ENGINE.read_text())["ratios_zip_over_baseline"]["largest_batch"]["zip_over_baseline_tokens_per_s"]
    assert len(big["cited"]) == 10 and big["committed"] == pytest.approx(statistics.median(cited))
    assert big["ratio"] == pytest.approx(new / statistics.median(cited))
    assert big["committed_spread"] == (min(cited), max(cited)) and "at 67" in big["detail"]
    assert gpu.tests_outcome([run]) == "478 passed in 59.22s"
    assert cli.main(["bench", "gpu", "--summary", str(run)]) == 0
    text = capsys.readouterr().out
    assert "attention v2, 8192 x 64" in text and "478 passed" in text


def test_a_run_of_another_setup_is_shown_but_not_compared(tmp_path):
    run = _run_folder(tmp_path)
    doc = json.loads((run / "zip_engine.json").read_text())
    doc["setup"]["context"] = 2048  # e.g. --quick
    (run / "zip_engine.json").write_text(json.dumps(doc))
    big = next(r for r in gpu.summary([run]) if r["figure"].startswith("engine tok/s, each"))
    assert not big["compared"] and big["ratio"] is None and "not compared" in big["detail"]


def test_a_later_folder_overrides_an_earlier_one(tmp_path):
    first = _run_folder(tmp_path)
    second = tmp_path / "second"
    second.mkdir()
    doc = json.loads(V2.read_text())
    for r in doc["results"]:
        r["cuda_zip"]["speedup_vs_flashinfer_rounds_median"] *= 1.1
    (second / "zip_attention_v2.json").write_text(json.dumps(doc))
    rows = [r for r in gpu.summary([first, second]) if r["figure"].startswith("attention v2")]
    assert all(r["ratio"] == pytest.approx(1.1) and r["result"] == "zip_attention_v2.json" for r in rows)
    assert any(r["figure"].startswith("engine") for r in gpu.summary([first, second]))  # from the first folder
