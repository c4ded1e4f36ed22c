"""GPU: does a CUDA graph's per-kernel cost grow with the graph's size? One chain of small kernels, the same total,
captured as graphs of k kernels each (k from a layer's half to a whole decode step) and replayed back to back.

Why: the H200 profile of a whole-step zip decode graph (~1,360 kernels) shows ~0.4 us of idle before each small
kernel, against ~0.1 us in the piecewise graphs of the FlashInfer engine (~20 kernels each), same kernels
(bench/results/zip_engine_profile67_h200*). If the chain shows the same, whole steps should be captured in pieces.

    python bench/tools/graph_chain.py --out $OUT/graph_chain_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
from pathlib import Path

import torch


def make_extra(kind: str, dev: torch.device):
    """The kernel inserted into the chain every --every kernels (None: nothing)."""
    if kind == "none":
        return None
    if kind == "torch":
        w = torch.zeros(16, device=dev)
        return lambda: w.add_(1.0)
    if kind == "triton":
        import triton
        import triton.language as tl

        @triton.jit
        def add_one(p, n, BLOCK: tl.constexpr):
            o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(p + o, tl.load(p + o, mask=o < n) + 1.0, mask=o < n)

        w = torch.zeros(16, device=dev)
        return lambda: add_one[(1,)](w, 16, BLOCK=16)
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.zip_attention import D, HKV, HQ, PS, cuda_inputs, synth_kv
    from kvtide.kernels import zip_attention_cuda as zc

    gen = torch.Generator(device="cuda").manual_seed(0)
    pool, gstart, gdesc = cuda_inputs(synth_kv(8, 0.1, 0.0, gen), 1)["cuda_zip"]
    p = zc.plan(torch.tensor([0, 8], dtype=torch.int32), torch.arange(8, dtype=torch.int32, device=dev),
                torch.tensor([PS], dtype=torch.int32), HQ, HKV, D, PS, version=1, device=dev,
                options=zc.LaunchOptions(num_splits=1))
    q = torch.randn(1, HQ, D, device=dev).bfloat16()
    out = torch.empty_like(q)
    return lambda: zc.run(p, q, pool, gstart, gdesc, out=out)


def idle_between_kernels(fn) -> dict:
    """Idle time between consecutive kernels of one call of ``fn`` under torch.profiler (CUPTI timestamps)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kern = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(kern, kern[1:])]
    return dict(kernels_traced=len(kern), gap_us_median=statistics.median(gaps) if gaps else None,
                gap_us_mean=statistics.mean(gaps) if gaps else None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernels", type=int, default=1440, help="kernels in the whole chain")
    ap.add_argument("--chunks", type=int, nargs="+", default=[12, 24, 45, 90, 180, 360, 720, 1440])
    ap.add_argument("--rows", type=int, default=67)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--insert", choices=["none", "torch", "triton", "zip"], default="none",
                    help="every --every kernels one more: a torch op, a Triton kernel, or the CUDA zip_decode "
                         "(NVRTC module, dynamic shared memory) over a one-sequence batch")
    ap.add_argument("--every", type=int, default=45)
    ap.add_argument("--profile", action="store_true",
                    help="also replay each chunking once under torch.profiler: median idle between kernels")
    args = ap.parse_args()
    dev = torch.device("cuda")
    x = torch.randn(args.rows, 4096, device=dev, dtype=torch.bfloat16)
    y = torch.randn(args.rows, 4096, device=dev, dtype=torch.bfloat16)

    z = torch.empty_like(x)

    extra = make_extra(args.insert, dev)

    def op(i: int) -> None:  # small elementwise kernels of a decode step's size, one kernel each, four kinds in turn
        if extra is not None and i % args.every == args.every - 1:
            extra()
            return
        [lambda: x.add_(y), lambda: x.mul_(0.999), lambda: torch.rsqrt(y, out=z), lambda: x.copy_(z)][i % 4]()

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        ms = []
        for _ in range(args.iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ms.append(a.elapsed_time(b))
        return statistics.median(ms) * 1e3  # us

    s = torch.cuda.Stream()
    rows, kept = [], []
    eager = timed(lambda: [op(i) for i in range(args.kernels)])
    for k in args.chunks:
        graphs = []
        pool = torch.cuda.graph_pool_handle()
        with torch.cuda.stream(s):
            for _ in range(3):
                for i in range(k):
                    op(i)
            torch.cuda.synchronize()
            for c in range(0, args.kernels, k):
                g = torch.cuda.CUDAGraph()
                g.capture_begin(pool=pool, capture_error_mode="thread_local")
                for i in range(c, min(args.kernels, c + k)):
                    op(i)
                g.capture_end()
                graphs.append(g)
        torch.cuda.synchronize()
        us = timed(lambda: [g.replay() for g in graphs])
        rows.append(dict(kernels_per_graph=k, graphs=len(graphs), us=us, us_per_kernel=us / args.kernels))
        kept.append(graphs)
        print(f"{k:5d} kernels per graph x {len(graphs):4d}: {us:8.1f} us, {us / args.kernels:.3f} us per kernel",
              flush=True)
    for row, graphs in zip(rows, kept) if args.profile else ():  # after every timing: the profiler slows replays
        row.update(idle_between_kernels(lambda: [g.replay() for g in graphs]))
        print(f"{row['kernels_per_graph']:5d} kernels per graph: idle between kernels {row['gap_us_median']:.2f} us "
              f"median, {row['gap_us_mean']:.2f} mean", flush=True)
    out = dict(suite="graph_chain", date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
               python=platform.python_version(), kernels=args.kernels, rows_per_kernel=args.rows,
               insert=args.insert, every=args.every,
               eager_us=eager, eager_us_per_kernel=eager / args.kernels, timing="CUDA events, median", results=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"eager: {eager:.1f} us; wrote {args.out}")


if __name__ == "__main__":
    main()
