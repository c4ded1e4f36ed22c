"""Where a KVServe pipeline's time goes on a device: cProfile of one encode and one decode (after a warm-up),
top functions by own time, with CUDA synchronised around each call so device time lands in the call that waits.

    python bench/tools/pipeline_stages.py --spec 'none|kivi|pack' --spec 'none|kivi|nvans' [--real-kv FILE]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.kvserve_gpu import make_kv  # noqa: E402
from kvtide.transfer.pipeline import Pipeline  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", action="append", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--real-kv", default=None)
    ap.add_argument("--top", type=int, default=18)
    a = ap.parse_args(argv)
    kv, _ = make_kv(a.layers, a.tokens, 8, 128, a.device, Path(a.real_kv) if a.real_kv else None, 0)
    nbytes = kv.numel() * 2
    for spec in a.spec:
        p = Pipeline(spec)
        blob = p.encode(kv)
        p.decode(blob, max_values=kv.numel(), device=a.device)
        for what, fn in (("encode", lambda: p.encode(kv)),
                         ("decode", lambda: p.decode(blob, max_values=kv.numel(), device=a.device))):
            sync(a.device)
            t = time.perf_counter()
            fn()
            sync(a.device)
            dt = time.perf_counter() - t
            pr = cProfile.Profile()
            sync(a.device)
            pr.enable()
            fn()
            sync(a.device)
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(a.top)
            print(f"=== {spec} {what}: {dt * 1e3:.1f} ms = {nbytes / dt / 1e9:.2f} GB/s (blob {len(blob) / 1e6:.1f} MB)")
            print("\n".join(s.getvalue().splitlines()[6:6 + a.top + 2]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
