"""Seconds per CacheFlow plan (``kvtide.restore.planner.plan``) at the isolated H200 grid's shapes and at the
issue-39 shape, and against an earlier revision of the planner in the same run.

Grid shapes (the fast path): 32 blocks, batches 1/4/8 of equal requests of 8192 cached + 16 new tokens, chunk
512, 10/40/80 Gbps, F from the latency profile the H200 grid learned (knots in a committed result file), as the
restorer calls it (``ExecutorReplayTime``). Issue shape (the DP): 8 requests x 32 blocks x 16384 cached tokens at
512-token chunks, once with the DP forced on that profile and once on the profile with bumps (not convex, so
``auto`` itself takes the DP). Each shape records the median and the 10th/90th percentiles of its calls, the
plan's optimality flag and predicted seconds, and planning time over the predicted restoration (a TTFT is at
least that long, so its share of a TTFT is at most this). ``--compare REV`` checks REV's ``kvtide`` out into a
temporary directory and times it in a child process, rounds alternating with this tree's, so both see the same
machine; the load average is recorded before and after.

    python bench/tools/planner_speed.py --compare HEAD~1 --out bench/results/planner_speed_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import rev_rounds  # bench/tools/, next to this script

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "bench/results/restore_random_llama3-8b_cuda_isolated_layer_graphs.json"
GRID = [(f"b{b}/{g}Gbps", b, 8192, g, "auto", False) for b in (1, 4, 8) for g in (10, 40, 80)]
ISSUE = [(f"b8x16K/{g}Gbps/dp", 8, 16384, g, "dp", False) for g in (10, 40, 80)] + [
    (f"b8x16K/{g}Gbps/bumps", 8, 16384, g, "auto", True) for g in (10, 80)]


class Bumps:
    """F times 1 + 5% sin^2(t / 700), made nondecreasing: a profile that is not convex."""

    vectorized = True

    def __init__(self, base: object, top: int) -> None:
        grid = np.arange(top + 1)  # tabulated once, so a plan pays a lookup as it does for a profile
        f = np.asarray(base(grid))  # type: ignore[operator]
        self.v = np.maximum.accumulate(f * (1 + 0.05 * np.sin(grid / 700.0) ** 2))

    def __call__(self, t):  # type: ignore[no-untyped-def]
        out = self.v[np.asarray(t, dtype=np.int64)]
        return float(out) if out.ndim == 0 else out


def measure(reps: int) -> dict[str, dict]:
    """Per shape: percentiles of seconds per plan() call, with the kvtide on sys.path."""
    from kvtide.restore.costs import BlockCost, ExecutorReplayTime, RestoreRequest
    from kvtide.restore.planner import plan
    from kvtide.restore.profile import LatencyProfile

    prof_end = json.loads(PROFILE.read_text())["meta"]["profile_at_end"]
    prof = LatencyProfile()
    for t, y in zip(prof_end["knots_tokens"], prof_end["knots_seconds_per_layer"]):
        for _ in range(3):
            prof.observe(int(t), float(y), source="layer")
    out = {}
    for key, b, n, g, method, bumps in GRID + ISSUE:
        rt = ExecutorReplayTime(prof, prof_end["call_overhead_s"], b, prof_end["compute_scale_by_batch"][str(b)])
        cost = BlockCost(32, 131072.0, 0.0, replay_time=Bumps(rt, n + 16) if bumps else rt,
                         suffix_overhead=prof_end["suffix_overhead_s"], fixed_seconds=prof_end["fixed_overhead_s"],
                         suffix_scale=prof_end["suffix_scale"])
        reqs = [RestoreRequest(n, 16) for _ in range(b)]
        bw = g * 1e9 / 8
        n_reps = reps if key in dict.fromkeys(k for k, *_ in GRID) else max(20, reps // 20)
        for _ in range(max(2, n_reps // 25)):
            p = plan(reqs, cost, bw, 512, method=method)
        ts = []
        for _ in range(n_reps):
            t0 = time.perf_counter()
            p = plan(reqs, cost, bw, 512, method=method)
            ts.append(time.perf_counter() - t0)
        q = [float(v) for v in np.percentile(ts, [10, 50, 90])]
        out[key] = {"p10": q[0], "median": q[1], "p90": q[2], "calls": n_reps, "method": p.method,
                    "exact": p.exact, "predicted_s": p.predicted_seconds, "share": q[1] / p.predicted_seconds}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=500, help="plans per grid shape per round (issue shapes: 1/20)")
    rev_rounds.add_args(ap, "planner")
    load_before = os.getloadavg()
    a, rounds = rev_rounds.parse_and_run(ap, measure, __file__)
    if rounds is None:  # a --child round
        return 0
    res = {}
    for k in rounds["this"][0]:
        row: dict[str, object] = {}
        for side in ("this", "compare"):
            rs = [x[k] for x in rounds[side]]
            if not rs:
                continue
            for q in ("median", "p10", "p90"):
                row[f"{side}_{q}_us"] = 1e6 * statistics.median(x[q] for x in rs)
            row[f"{side}_share_of_restore"] = statistics.median(x["share"] for x in rs)
            row[f"{side}_method"], row[f"{side}_exact"] = rs[0]["method"], all(x["exact"] for x in rs)
            row[f"{side}_predicted_s"] = rs[0]["predicted_s"]
        if rounds["compare"]:
            row["speedup"] = row["compare_median_us"] / row["this_median_us"]  # type: ignore[operator]
        res[k] = row
        print(k, {n: round(v, 2) if isinstance(v, float) else v for n, v in row.items()})
    out = {"per_plan": res, "meta": {
        **rev_rounds.meta(a.compare),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "shapes": "32 blocks, 131072 stored B/token/block, chunk 512; grid: equal requests of 8192 cached + 16 new "
                  "tokens (auto); issue: 8 x 16384 + 16 (DP forced, or auto on the profile with 5% bumps)",
        "profile": f"knots and overheads of {PROFILE.name} (meta.profile_at_end)",
        "units": "microseconds per plan(), median over rounds of each round's percentile over --reps calls "
                 "(issue shapes: --reps / 20, at least 20); share_of_restore: median / predicted restoration"}}
    rev_rounds.write(out, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
