"""Where a restoration's time goes on one device: each method's recompute / suffix / load / wait split against
the plan's prediction, and a torch profile of one CacheFlow and one recompute-only restoration.

Why: the H200 run of bench/restore.py (restore_random_llama3-8b_cuda.json, torch attention backend) spent
84 ms in the 16-token suffix of a recompute-only restoration (2.6 ms per layer) and up to 260 ms under loads,
which caps CacheFlow at 59-82% of the ideal gain at 40/80 Gbps. This says whether the attention backend, the
host (plans, launches, the GIL shared with the I/O thread) or the device is the cause.

    python bench/restore_probe.py --device cuda --attention flashinfer --out $OUT/probe_fi.json   # ~2 min
    python bench/restore_probe.py --device cuda --switch-interval 0.0002 ...   # with a shorter GIL switch interval
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import restore as R  # noqa: E402

KEYS = ("total_seconds", "predicted_seconds", "recompute_seconds", "suffix_seconds", "load_seconds", "wait_seconds",
        "overhead_seconds", "link_wait_seconds", "stolen_tokens")


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
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.switch_interval:
        sys.setswitchinterval(a.switch_interval)
    gpu = a.device.startswith("cuda")
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
                    _, rec = b.restore(prompts, m)
                    rows.append({"gbps": g, "batch": bs, "method": m, "rep": rep,
                                 **{k: getattr(rec, k) for k in KEYS}, "boundaries": rec.boundaries})
                    print(f"{g:g} Gbps b{bs} {m:10s} total {rec.total_seconds:.3f} pred {rec.predicted_seconds:.3f} "
                          f"rec {rec.recompute_seconds:.3f} suffix {rec.suffix_seconds:.3f} load {rec.load_seconds:.3f} "
                          f"wait {rec.wait_seconds:.3f} ovh {rec.overhead_seconds:.3f}", flush=True)
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
                **{x: statistics.median(r[x] for r in v) for x in KEYS}} for k, v in med.items()]
    out = {"when": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if gpu else None, "model": a.model,
           "random_weights": a.model.startswith("random:"), "attention_backend": b.eng.runner.attention.name,
           "switch_interval_s": sys.getswitchinterval(), "tokens": n, "chunk": a.chunk, "suffix_tokens": 16,
           "summary": summary, "rows": rows, "profiles": profiles}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
