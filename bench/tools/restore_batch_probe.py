"""One batch of the CPU Mooncake trace replay restored alone, by every method (CPU, SmolLM2-135M, real weights).

Why: in bench/results/restore_smollm2-135m_cpu.json's trace this 5-request batch (cached 480/320/320/32/128 tokens,
new 32/153/32/480/335) spent 3.97 s in suffix calls under CacheFlow and 2.60 s under Cake. Restored alone, at the
same trace link (B*/2.56), methods interleaved over 3 reps, it shows whether the plan or the surroundings did that.

    python bench/tools/restore_batch_probe.py        # ~3 min on the 2-core CPU
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import restore as R  # noqa: E402

N = [480, 320, 320, 32, 128]
NS = [32, 153, 32, 480, 335]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "restore_batch_probe_cpu.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    b = R.Bench(argparse.Namespace(model="smollm2-135m", device="cpu", num_pages=None, max_batched_tokens=4096,
                                   store_gb=4, chunk=32, batches=[len(N)], suffix=16))
    b.warm_profile([64, 128, 256, 512])
    bal = b.balance(512)
    prefixes = [b.text[i * 2000: i * 2000 + n] for i, n in enumerate(N)]
    b.fresh_store()
    b.set_link(None)
    b.populate(prefixes)
    prompts = [p + b.text[150_000 + 1000 * i: 150_000 + 1000 * i + s] for i, (p, s) in enumerate(zip(prefixes, NS))]
    gbps = bal["balance_gbps"] / 2.56
    b.set_link(gbps)
    keys = ("total_seconds", "recompute_seconds", "suffix_seconds", "load_seconds", "wait_seconds")
    runs = {m: [] for m in R.ORDER}
    for _ in range(a.reps):
        for m in R.ORDER:
            _, rec = b.restore(prompts, m)
            runs[m].append({k: getattr(rec, k) for k in keys})
    med = {m: {k: statistics.median(r[k] for r in v) for k in keys} for m, v in runs.items()}
    res = {"when": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(), "torch": torch.__version__,
           "torch_threads": 1, "model": "smollm2-135m (real weights)", "cached_tokens": N, "new_tokens": NS,
           "link_gbps": gbps, "link": "B*/2.56, as the CPU trace replay", "reps": a.reps, "median": med, "runs": runs}
    Path(a.out).write_text(json.dumps(res, indent=1))
    for m, v in med.items():
        print(f"{m:10s} total {v['total_seconds']:.2f} s  recompute {v['recompute_seconds']:.2f}  suffix "
              f"{v['suffix_seconds']:.2f}  load {v['load_seconds']:.2f}  wait {v['wait_seconds']:.2f}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
