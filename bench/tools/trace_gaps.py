"""Where the device waits: read a torch.profiler Chrome trace (``bench/zip_engine.py --profile-trace``) and report
device busy/idle time per host step, every idle gap with what the host was doing when it began and which launch
ended it, device time by kernel family, and the host's explicit waits for the device.

Why: under async scheduling a step takes max(host, device) only while the host stays ahead; a step that is longer
than its device work has gaps, and the gap's host context (a scheduler range, a sync inside compress, ...) names
the cause. Works on the gzipped or plain JSON; needs nothing but the standard library.

    python bench/tools/trace_gaps.py trace_zip.json.gz [--min-gap-us 20] [--out summary.json]
    python bench/tools/trace_gaps.py trace_zip.json.gz --steps [--marker ArgMaxOps] [--out steps.json]
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
STEP = "kvtide.bench_step"  # the bench's range around each engine.step()
MARKER = r"ArgMaxOps"  # a kernel launched once per decode step (greedy sampling), where device_steps cuts
SLOW_GAP_US = 0.25  # a device step whose median launch gap is above this ran in the slow-launch state
WAITS = r"Synchronize|^cudaMemcpy$|cudaMemcpy2D$|cudaHostAlloc|cudaFreeHost|cudaMallocHost"  # host calls that wait

FAMILIES = [  # (family, regex on the kernel name), first match wins
    ("zip attention (CUDA)", r"zip_decode|zipfusion|zip_attn"),
    ("flashinfer attention", r"flashinfer|BatchDecode|MergeStates|merge_state|VariableLengthMerge"),
    ("zip encode / pack", r"analyze|_pack|zip_encode|pack_kernel"),
    ("kv write", r"write_paged|write_pool|reshape_and_cache|AppendPaged"),
    ("gemm", r"gemm|Gemm|cutlass|sm90_xmma|nvjet|cublas|splitKreduce"),
    ("norm", r"rms|norm"),
    ("softmax / sampling", r"softmax|argmax|topk|sort|reduce_kernel"),
    ("copy / index", r"index|gather|scatter|copy|Copy|cat_|CatArray"),
    ("memcpy", r"^Memcpy"),
    ("memset", r"^Memset"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
]


def family(name: str) -> str:
    for fam, rx in FAMILIES:
        if re.search(rx, name):
            return fam
    return "other"


class Ranges:
    """Host ranges of one thread, for 'innermost range containing t'."""

    def __init__(self, events: list[dict]):
        ev = sorted(events, key=lambda e: e["ts"])
        self.ts = [e["ts"] for e in ev]
        self.ev = ev
        self.longest = max((e.get("dur", 0) for e in ev), default=0)

    def at(self, t: float) -> list[str]:
        """Names of the ranges containing t, outermost first."""
        i = bisect.bisect_right(self.ts, t)
        hits = []
        while i > 0:
            i -= 1
            e = self.ev[i]
            if t - e["ts"] > self.longest:
                break
            if e["ts"] <= t < e["ts"] + e.get("dur", 0):
                hits.append(e)
        hits.sort(key=lambda e: -e.get("dur", 0))
        return [e["name"] for e in hits]


def _ours(ranges: list[str]) -> list[str]:
    """kvtide's named ranges among ``ranges`` (the bench's step range left out: it holds everything)."""
    return [r for r in ranges if r.startswith("kvtide.") and r != STEP]


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def merge(intervals: list[tuple[float, float, dict]]) -> list[tuple[float, float, dict]]:
    """Union of device intervals: (start, end, the event that starts it)."""
    out: list[list] = []
    for s, e, ev in sorted(intervals, key=lambda x: x[0]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e, ev])
    return [(s, e, ev) for s, e, ev in out]


def analyze(events: list[dict], min_gap_us: float = 20.0, top: int = 25) -> dict:
    dev = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    calls = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")]
    runtime = {(e.get("args") or {}).get("correlation"): e for e in calls}
    steps = [e for e in events if e.get("ph") == "X" and e.get("name") == STEP and e.get("cat") == "user_annotation"]
    if not steps:
        raise SystemExit(f"no '{STEP}' ranges in the trace: profile with bench/zip_engine.py --profile-steps")
    tid = steps[0]["tid"]
    annos = Ranges([e for e in events if e.get("ph") == "X" and e.get("tid") == tid
                    and e.get("cat") in ("user_annotation", "cpu_op", "cuda_runtime", "cuda_driver")])
    t0 = min(s["ts"] for s in steps)
    t1 = max(s["ts"] + s["dur"] for s in steps)
    busy_iv = merge([(e["ts"], e["ts"] + e.get("dur", 0), e) for e in dev])
    busy = sum(min(e, t1) - max(s, t0) for s, e, _ in busy_iv if e > t0 and s < t1)
    gaps = []
    small: list[tuple[float, str, object, float]] = []  # idle under min_gap_us between back-to-back ops: launch
    # latency, not host; (gap, family of the op it ends at, that op's launch correlation, its start)
    for (s0, e0, _), (s1, e1, ev1) in zip(busy_iv, busy_iv[1:]):
        g = s1 - e0
        if e0 < t0 or s1 > t1:
            continue
        if g < min_gap_us:
            small.append((g, family(ev1["name"]), (ev1.get("args") or {}).get("correlation"), s1))
            continue
        launch = runtime.get((ev1.get("args") or {}).get("correlation"))
        gaps.append({
            "start_us": round(e0 - t0, 1), "gap_us": round(g, 1),
            "host_at_start": annos.at(e0)[-5:],
            "next_device_op": ev1["name"][:80],
            "launched_by": launch["name"] if launch else None,
            "launch_host_ranges": annos.at(launch["ts"])[-5:] if launch else None,
            "launch_after_gap_start_us": round(launch["ts"] - e0, 1) if launch else None,
        })
    by_start: dict[str, float] = defaultdict(float)
    by_launch: dict[str, float] = defaultdict(float)
    for g in gaps:
        kv = _ours(g["host_at_start"])
        fallback = g["host_at_start"][-1] if g["host_at_start"] else "(no host range)"
        by_start[" > ".join(kv[-2:]) or fallback] += g["gap_us"]
        kl = _ours(g["launch_host_ranges"] or [])
        by_launch[" > ".join(kl[-2:]) or "(unknown)"] += g["gap_us"]
    fam: dict[str, float] = defaultdict(float)
    names: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in dev:
        if t0 <= e["ts"] < t1:
            fam[family(e["name"])] += e.get("dur", 0)
            n = names[e["name"][:100]]
            n[0] += 1
            n[1] += e.get("dur", 0)
    waits: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in calls:
        if t0 <= e["ts"] < t1 and re.search(WAITS, e["name"]):
            where = _ours(annos.at(e["ts"]))
            w = waits[f"{e['name']} in {' > '.join(where[-2:]) or '(no kvtide range)'}"]
            w[0] += 1
            w[1] += e.get("dur", 0)
    n = len(steps)
    per_step = []
    for s in sorted(steps, key=lambda e: e["ts"]):
        a, b = s["ts"], s["ts"] + s["dur"]
        on = sum(min(e, b) - max(st, a) for st, e, _ in busy_iv if e > a and st < b)
        per_step.append({"host_ms": round(s["dur"] / 1e3, 3), "device_busy_ms": round(on / 1e3, 3)})
    return {
        "steps": n, "window_ms": round((t1 - t0) / 1e3, 3), "ms_per_step": round((t1 - t0) / 1e3 / n, 3),
        "device_busy_ms_per_step": round(busy / 1e3 / n, 3),
        "device_idle_ms_per_step": round((t1 - t0 - busy) / 1e3 / n, 3),
        "gaps_over_min": len(gaps), "min_gap_us": min_gap_us,
        "gap_ms_per_step_by_host_range_at_start": {k: round(v / 1e3 / n, 3) for k, v in
                                                   sorted(by_start.items(), key=lambda x: -x[1])},
        "gap_ms_per_step_by_range_of_late_launch": {k: round(v / 1e3 / n, 3) for k, v in
                                                    sorted(by_launch.items(), key=lambda x: -x[1])},
        "largest_gaps": sorted(gaps, key=lambda g: -g["gap_us"])[:top],
        "small_gaps": _small_gaps(small, n),
        "device_ms_per_step_by_family": {k: round(v / 1e3 / n, 3) for k, v in sorted(fam.items(), key=lambda x: -x[1])},
        "top_device_ops": [{"name": k, "calls_per_step": round(c / n, 2), "ms_per_step": round(t / 1e3 / n, 3)}
                           for k, (c, t) in sorted(names.items(), key=lambda x: -x[1][1])[:top]],
        "host_waits": {k: {"calls": c, "ms_per_step": round(t / 1e3 / n, 3)} for k, (c, t) in
                       sorted(waits.items(), key=lambda x: -x[1][1])},
        "per_step": per_step,
    }


def _small_gaps(small: list[tuple[float, str, object, float]], steps: int, min_launch_ops: int = 8) -> dict:
    """Idle between back-to-back device ops (each under the gap threshold): per step, its median, by the family of
    the op that ends it, and by quarter of the launch it belongs to. Why: inside a CUDA graph these are the launch
    latencies between kernels, ~1,400 of them a decode step; the H200 showed ~0.4 us each in zip's whole-step graph
    against ~0.1 in FlashInfer's piecewise graphs, a state an eager PDL launch clears (the engine's nudge before each
    replay). The quarters say whether the idle grows again inside one replay: ops of one graph launch share its
    correlation id, and launches of fewer than ``min_launch_ops`` ops (eager kernels) are left out of them."""
    fam: dict[str, float] = defaultdict(float)
    launches: dict[object, list[tuple[float, float]]] = defaultdict(list)
    for g, f, corr, ts in small:
        fam[f] += g
        if corr is not None:
            launches[corr].append((ts, g))
    quarters: list[list[float]] = [[], [], [], []]
    for ops in launches.values():
        if len(ops) >= min_launch_ops:
            for i, (_, g) in enumerate(sorted(ops)):
                quarters[min(3, 4 * i // len(ops))].append(g)
    gs = sorted(g for g, *_ in small)

    def med(x: list[float]) -> float | None:
        return round(sorted(x)[len(x) // 2], 3) if x else None

    return {"ms_per_step": round(sum(gs) / 1e3 / steps, 3), "count_per_step": round(len(gs) / steps, 1),
            "median_us": med(gs),
            "ms_per_step_by_next_family": {k: round(v / 1e3 / steps, 3) for k, v in
                                           sorted(fam.items(), key=lambda x: -x[1])},
            "median_us_by_quarter_of_launch": [med(q) for q in quarters],
            "count_by_quarter_of_launch": [len(q) for q in quarters]}


def device_steps(events: list[dict], marker: str = MARKER, slow_gap_us: float = SLOW_GAP_US,
                 min_gap_us: float = 20.0) -> dict:
    """The device timeline cut at each start of a once-a-step kernel (``marker``; greedy sampling's argmax):
    per device step its period, busy and idle time and the median launch gap (idle under ``min_gap_us``), and the
    steps grouped by that median. Why: the host's step ranges are a step ahead of the device under async
    scheduling, so they cannot say which device step idled; the twenty-eighth session found zip's whole-step
    replays in two states, ~0.1 and ~0.4 us between kernels, changing between steps of one run."""
    dev = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    cut = [i for i, e in enumerate(dev) if re.search(marker, e["name"])]
    steps = []
    for a, b in zip(cut, cut[1:]):
        seg = dev[a:b]
        period = dev[b]["ts"] - dev[a]["ts"]
        busy = sum(e - s for s, e, _ in merge([(e["ts"], e["ts"] + e.get("dur", 0), e) for e in seg]))
        gaps = sorted(y["ts"] - (x["ts"] + x.get("dur", 0)) for x, y in zip(seg, seg[1:]))
        small = [g for g in gaps if 0 <= g < min_gap_us]
        steps.append({"period_ms": round(period / 1e3, 4), "busy_ms": round(busy / 1e3, 4),
                      "idle_ms": round((period - busy) / 1e3, 4), "ops": len(seg),
                      "median_gap_us": round(small[len(small) // 2], 3) if small else None})
    states = {}
    for name, sel in (("slow", lambda g: g is not None and g > slow_gap_us),
                      ("fast", lambda g: g is not None and g <= slow_gap_us)):
        st = [s for s in steps if sel(s["median_gap_us"])]
        if st:
            states[name] = {"steps": len(st), **{out: round(sorted(s[k] for s in st)[len(st) // 2], 3) for out, k in
                                                 (("median_period_ms", "period_ms"), ("median_busy_ms", "busy_ms"),
                                                  ("median_idle_ms", "idle_ms"), ("median_gap_us", "median_gap_us"))}}
    return {"marker": marker, "slow_gap_us": slow_gap_us, "steps": len(steps), "by_state": states,
            "per_step": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--min-gap-us", type=float, default=20.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--steps", action="store_true",
                    help="per device step instead (cut at --marker): period, busy, idle, median launch gap")
    ap.add_argument("--marker", default=MARKER)
    a = ap.parse_args()
    if a.steps:
        r = device_steps(load(a.trace), a.marker, min_gap_us=a.min_gap_us)
        if a.out:
            a.out.write_text(json.dumps(r, indent=1))
        print(json.dumps({k: v for k, v in r.items() if k != "per_step"}, indent=1))
        return
    r = analyze(load(a.trace), a.min_gap_us, a.top)
    text = json.dumps(r, indent=1)
    if a.out:
        a.out.write_text(text)
    short = {k: v for k, v in r.items() if k not in ("per_step", "largest_gaps", "top_device_ops")}
    print(json.dumps(short, indent=1))
    for g in r["largest_gaps"][:10]:
        print(g)


if __name__ == "__main__":
    main()
