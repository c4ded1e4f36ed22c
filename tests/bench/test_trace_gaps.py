"""bench/tools/trace_gaps.py on a hand-made trace: busy/idle sums, the gap's host context and late launch, waits."""
import gzip
import json

from bench.tools.trace_gaps import analyze, device_steps, load


def _x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}


def _trace():
    ev = [
        _x("kvtide.bench_step", "user_annotation", 0, 1000),
        _x("kvtide.bench_step", "user_annotation", 1000, 1000),
        _x("kvtide.compress", "user_annotation", 100, 500),
        _x("cudaEventSynchronize", "cuda_runtime", 150, 200),
        _x("kvtide.model", "user_annotation", 700, 200),
        _x("cudaLaunchKernel", "cuda_runtime", 750, 5, correlation=7),
        _x("cudaLaunchKernel", "cuda_runtime", 50, 5, correlation=6),
        _x("cudaLaunchKernel", "cuda_runtime", 1100, 5, correlation=8),
        # device: busy 0-400 (two overlapping ops), idle 400-800, busy 800-1900
        _x("nvjet_gemm_tn", "kernel", 0, 300, tid=9, correlation=6),
        _x("zip_decode_kernel", "kernel", 250, 150, tid=9, correlation=6),
        _x("write_pool_kernel", "kernel", 800, 300, tid=9, correlation=7),
        _x("analyze_kernel", "kernel", 1100, 800, tid=9, correlation=8),
    ]
    return ev


def test_gap_found_with_host_context_and_late_launch():
    r = analyze(_trace(), min_gap_us=20)
    assert r["steps"] == 2
    assert r["window_ms"] == 2.0
    assert abs(r["device_busy_ms_per_step"] - (400 + 1100) / 1e3 / 2) < 1e-9
    assert abs(r["device_idle_ms_per_step"] - 0.25) < 1e-9  # 400-800 and 1900-2000 idle; only the first is a gap
    [g] = r["largest_gaps"]
    assert g["gap_us"] == 400 and g["start_us"] == 400
    assert g["host_at_start"][-1] == "kvtide.compress"
    assert g["launched_by"] == "cudaLaunchKernel"
    assert g["launch_host_ranges"][-2:] == ["kvtide.model", "cudaLaunchKernel"]
    assert g["launch_after_gap_start_us"] == 350
    fam = r["device_ms_per_step_by_family"]
    assert fam["gemm"] == 0.15 and fam["zip attention (CUDA)"] == 0.075 and fam["kv write"] == 0.15
    assert fam["zip encode / pack"] == 0.4
    [(k, w)] = r["host_waits"].items()
    assert k == "cudaEventSynchronize in kvtide.compress" and w["calls"] == 1 and w["ms_per_step"] == 0.1
    assert [s["device_busy_ms"] for s in r["per_step"]] == [0.6, 0.9]
    assert r["small_gaps"]["count_per_step"] == 0  # the ops touch or overlap: no launch latency in between
    r = analyze(_trace(), min_gap_us=500)  # the 400 us gap is now a small one, ended by the KV write
    assert not r["largest_gaps"] and r["small_gaps"]["median_us"] == 400
    assert r["small_gaps"]["ms_per_step"] == 0.2 and r["small_gaps"]["ms_per_step_by_next_family"] == {"kv write": 0.2}


def test_load_gzipped(tmp_path):
    p = tmp_path / "t.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    assert len(load(p)) == len(_trace())


def test_small_gaps_by_quarter_of_one_graph_launch():
    """Ops of one graph launch (one correlation id): idle 0.1 us between the first half's kernels and 0.4 between
    the second half's shows as medians by quarter; an eager launch's lone kernel stays out of the quarters."""
    ev = [_x("kvtide.bench_step", "user_annotation", 0, 100),
          _x("cudaGraphLaunch", "cuda_runtime", 1, 2, correlation=5)]
    t, gaps = 10.0, [0.1] * 8 + [0.4] * 8
    for i, g in enumerate(gaps):
        t += g
        ev.append(_x(f"elementwise_{i}", "kernel", t, 1.0, tid=9, correlation=5))
        t += 1.0
    ev.append(_x("eager_zip_decode", "kernel", t + 0.3, 1.0, tid=9, correlation=6))
    r = analyze(ev, min_gap_us=20)["small_gaps"]
    assert r["median_us_by_quarter_of_launch"] == [0.1, 0.1, 0.4, 0.4]
    # 15 gaps inside the launch (its first kernel is the trace's first op), the eager kernel's only in the totals
    assert r["count_by_quarter_of_launch"] == [4, 4, 4, 3] and r["count_per_step"] == 16


def test_device_steps_cut_at_the_marker_and_grouped_by_launch_gap():
    """Two device steps cut at three argmax kernels: the first with 0.4 us between its kernels and 5 us idle before
    the next step, the second with 0.1 us; the last marker only closes the second step."""
    ev, t = [], 0.0
    for gap in (0.4, 0.1):
        ev.append(_x("reduce_kernel<ArgMaxOps<float>>", "kernel", t, 2.0, tid=9))
        t += 2.0
        for i in range(5):
            t += gap
            ev.append(_x(f"elementwise_{i}", "kernel", t, 10.0, tid=9))
            t += 10.0
        t += 5.0
    ev.append(_x("reduce_kernel<ArgMaxOps<float>>", "kernel", t, 2.0, tid=9))
    ev.append(_x("kvtide.bench_step", "user_annotation", 0, t))  # host ranges do not matter here
    r = device_steps(ev, min_gap_us=1.0)
    assert r["steps"] == 2
    s0, s1 = r["per_step"]
    assert s0["ops"] == s1["ops"] == 6
    assert s0["busy_ms"] == s1["busy_ms"] == 0.052
    assert s0["period_ms"] == 0.059 and s1["period_ms"] == 0.0575
    assert s0["median_gap_us"] == 0.4 and s1["median_gap_us"] == 0.1  # the 5 us before the next step is not small
    assert r["by_state"]["slow"]["steps"] == 1 and r["by_state"]["fast"]["steps"] == 1
    assert r["by_state"]["slow"]["median_idle_ms"] == 0.007 and r["by_state"]["slow"]["median_gap_us"] == 0.4
