"""Where a restoration's time goes on one device: each method's recompute / suffix / load / wait split against
the plan's prediction, and a torch profile of one CacheFlow and one recompute-only restoration.

Why: the H200 run of bench/restore.py (restore_random_llama3-8b_cuda.json, torch attention backend) spent
84 ms in the 16-token suffix of a recompute-only restoration (2.6 ms per layer) and up to 260 ms under loads,
which caps CacheFlow at 59-82% of the ideal gain at 40/80 Gbps. This says whether the attention backend, the
host (plans, launches, the GIL shared with the I/O thread) or the device is the cause.

    python bench/tools/restore_probe.py --device cuda --attention flashinfer --out $OUT/probe_fi.json   # ~2 min
    python bench/tools/restore_probe.py --device cuda --switch-interval 0.0002 ...   # with a shorter GIL switch interval
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import restore as R

from kvtide.engine.restore_port import EnginePort
from kvtide.restore.executor import LoadConfig

HOST: list[tuple[int, int, float]] = []  # (layer, rows, host seconds) of every layer call


def _timed_run_layer(orig):
    def run_layer(self, layer, h, segments):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = orig(self, layer, h, segments)
        HOST.append((layer, sum(s.length for s in segments), time.perf_counter() - t))
        return out
    return run_layer


def _host_split(suffix_rows: int) -> dict:
    """Median host seconds per layer call, staircase vs suffix (calls since the last reset)."""
    st = [x[2] for x in HOST if x[1] != suffix_rows]
    su = [x[2] for x in HOST if x[1] == suffix_rows]
    med = lambda v: statistics.median(v) if v else 0.0
    return {"stair_calls": len(st), "stair_host_ms_median": 1e3 * med(st), "stair_host_ms_sum": 1e3 * sum(st),
            "suffix_calls": len(su), "suffix_host_ms_median": 1e3 * med(su), "suffix_host_ms_sum": 1e3 * sum(su)}

KEYS = ("total_seconds", "predicted_seconds", "recompute_seconds", "suffix_seconds", "load_seconds", "wait_seconds",
        "overhead_seconds", "link_wait_seconds", "stolen_tokens")
HOST_KEYS = ("stair_host_ms_median", "suffix_host_ms_median", "stair_host_ms_sum", "suffix_host_ms_sum")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--attention", default="auto", choices=["auto", "torch", "flashinfer"])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--gbps", type=float, nargs="*", default=[40.0])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--methods", nargs="*", default=["recompute", "load", "cacheflow", "layerwise"])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval for the run (s)")
    ap.add_argument("--profile-rows", type=int, default=30)
    ap.add_argument("--workers", type=int, default=None, help="verify/stage threads of the load path (default: auto)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.switch_interval:
        sys.setswitchinterval(a.switch_interval)
    gpu = a.device.startswith("cuda")
    EnginePort.run_layer = _timed_run_layer(EnginePort.run_layer)
    if a.workers is not None:
        LoadConfig.resolved_workers = lambda self, device: a.workers  # type: ignore[method-assign]
    b = R.Bench(argparse.Namespace(model=a.model, device=a.device, num_pages=None, max_batched_tokens=32768,
                                   store_gb=64 if gpu else 4, chunk=a.chunk, batches=a.batches, suffix=16,
                                   attention=a.attention))
    b.warm_profile([1024, 4096, a.tokens] if gpu else [64, 128, 256, 512])
    n = a.tokens
    prefixes = [b.text[i * 3000:i * 3000 + n] for i in range(max(a.batches))]
    b.fresh_store()
    b.set_link(None)
    b.populate(prefixes)
    rows = []
    for g in a.gbps:
        b.set_link(g)
        for bs in a.batches:
            prompts = [p + b.text[100_000 + 50 * i:100_000 + 50 * i + 16] for i, p in enumerate(prefixes[:bs])]
            b.restore(prompts, "load")  # learn the link
            for m in a.methods:
                b.restore(prompts, m)  # untimed: first use of this shape
            for rep in range(a.reps):
                for m in a.methods:
                    HOST.clear()
                    _, rec = b.restore(prompts, m)
                    host = _host_split(16 * bs)
                    rows.append({"gbps": g, "batch": bs, "method": m, "rep": rep,
                                 **{k: getattr(rec, k) for k in KEYS}, **host, "boundaries": rec.boundaries})
                    print(f"{g:g} Gbps b{bs} {m:10s} total {rec.total_seconds:.3f} pred {rec.predicted_seconds:.3f} "
                          f"rec {rec.recompute_seconds:.3f} suffix {rec.suffix_seconds:.3f} load {rec.load_seconds:.3f} "
                          f"wait {rec.wait_seconds:.3f} ovh {rec.overhead_seconds:.3f} | host ms/call stair "
                          f"{host['stair_host_ms_median']:.2f} suffix {host['suffix_host_ms_median']:.2f}", flush=True)
    profiles = {}
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
    b.set_link(a.gbps[0])
    prompts = [prefixes[0] + b.text[100_000:100_016]]
    for m in ("cacheflow", "recompute"):
        with torch.profiler.profile(activities=acts) as prof:
            _, rec = b.restore(prompts, m)
        ka = prof.key_averages()
        profiles[m] = {
            "total_seconds": rec.total_seconds, "suffix_seconds": rec.suffix_seconds,
            "by_device_time": ka.table(sort_by="self_cuda_time_total" if gpu else "self_cpu_time_total",
                                       row_limit=a.profile_rows),
            "by_cpu_time": ka.table(sort_by="cpu_time_total", row_limit=a.profile_rows)}
        print(profiles[m]["by_device_time"])
    med = {}
    for r in rows:
        med.setdefault((r["gbps"], r["batch"], r["method"]), []).append(r)
    summary = [{"gbps": k[0], "batch": k[1], "method": k[2],
                **{x: statistics.median(r[x] for r in v) for x in KEYS + HOST_KEYS}} for k, v in med.items()]
    out = {"when": datetime.now(UTC).isoformat(), "machine": platform.platform(), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if gpu else None, "model": a.model,
           "random_weights": a.model.startswith("random:"), "attention_backend": b.eng.runner.attention.name,
           "switch_interval_s": sys.getswitchinterval(),
           "load_workers": a.workers if a.workers is not None else LoadConfig().resolved_workers(b.eng.runner.device), "tokens": n, "chunk": a.chunk, "suffix_tokens": 16,
           "summary": summary, "rows": rows, "profiles": profiles}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
