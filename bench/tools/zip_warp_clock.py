"""H200: when each warp of the CUDA ZipFusion decode kernel starts and ends, per launch plan (diagnostics).

Why: at 67 sequences x 8 KV heads the kernel costs more per sequence than at 66 (bench/tools/zip_splits.py: balanced runs
6.47 us a sequence against 6.37, even splits merged in a CTA 6.27 at 66), and timing whole launches cannot say
whether the last warps to finish are the ones whose runs cross a (sequence, KV head) boundary (two start-ups), a few
slow SMs, or every warp a little slower. The kernel built with ``WARP_CLOCK=1`` has every warp write its start and
end (%globaltimer), SM id and clock64 cycles; this bench launches it with L2 emptied before each launch and
summarises the records: launch span, warp durations, ends by how many pieces a warp's run holds, and per SM.

    python bench/tools/zip_warp_clock.py --real-kv bench/data/real_kv.safetensors --batches 66 67 --out $OUT/clock.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.zip_attention import D, HKV, HQ, PS, bench, cuda_inputs, equal_batch, real_kv, synth_kv  # noqa: E402
from kvtide.kernels import zip_attention_cuda as zc  # noqa: E402
from kvtide.kernels import zip_attention_ref as zr  # noqa: E402

MODES = {"plan": {}, "even": {"balanced": False}, "balanced": {"balanced": True}}


def pieces_per_warp(p: zc.CudaDecodePlan, indptr: list[int]) -> list[int]:
    """Pieces (units met) of every warp of ``p``'s grid: the balanced walk's (its host mirror), or 1 for a split."""
    warps = math.ceil((p.grid_warps if p.balanced else p.batch * p.num_kv_heads * p.num_splits) / p.warps) * p.warps
    if not p.balanced:
        return [1] * warps
    count = [0] * warps
    for w, *_ in zc.balanced_pieces(indptr, p.num_kv_heads, p.pages_per_split, p.grid_warps):
        count[w] += 1
    return count


def summarise(rec: torch.Tensor, pieces: list[int]) -> dict:
    """One launch's records [warps, 4] (start ns, end ns, SM, cycles) -> the figures this bench reports (us)."""
    t0, t1, sm = rec[:, 0].tolist(), rec[:, 1].tolist(), rec[:, 2].tolist()
    base = min(t0)
    start = [(t - base) / 1e3 for t in t0]
    end = [(t - base) / 1e3 for t in t1]
    dur = [e - s for s, e in zip(start, end)]
    q = statistics.quantiles
    by_pieces: dict[int, list[int]] = defaultdict(list)
    for i, n in enumerate(pieces):
        by_pieces[n].append(i)
    sm_end: dict[int, float] = defaultdict(float)
    sm_first: dict[int, float] = defaultdict(lambda: math.inf)
    for e, s_ in zip(end, sm):
        sm_end[s_] = max(sm_end[s_], e)
        sm_first[s_] = min(sm_first[s_], e)
    span = max(end)
    late = sorted(range(len(end)), key=lambda i: end[i])[-max(1, len(end) // 20):]  # the last 5% to finish
    return dict(
        span_us=span, start_spread_us=max(start),
        duration_us=dict(median=statistics.median(dur), p10=q(dur, n=10)[0], p90=q(dur, n=10)[-1], max=max(dur)),
        end_us=dict(median=statistics.median(end), p10=q(end, n=10)[0], p90=q(end, n=10)[-1]),
        by_pieces={n: dict(warps=len(ix), duration_median_us=statistics.median(dur[i] for i in ix),
                           end_median_us=statistics.median(end[i] for i in ix), end_max_us=max(end[i] for i in ix))
                   for n, ix in sorted(by_pieces.items())},
        last_5pct_pieces={n: sum(1 for i in late if pieces[i] == n) for n in sorted(by_pieces)},
        sm_end_us=dict(min=min(sm_end.values()), median=statistics.median(sm_end.values()), max=max(sm_end.values()),
                       sms=len(sm_end)),
        # within an SM: its last warp's end minus its first warp's end (warps that did work)
        sm_inner_spread_us=statistics.median(sm_end[k] - sm_first[k] for k in sm_end),
        sm_last_end_us={int(k): round(v, 2) for k, v in sorted(sm_end.items())},
    )


def rank_correlation(a: dict[int, float], b: dict[int, float]) -> float:
    """Spearman's rank correlation of two launches' per-SM last ends (same SMs): near 1 when the same SMs finish
    last in every launch (a property of the chip, e.g. SMs that share a GPC's bandwidth), near 0 when it is chance."""
    keys = sorted(set(a) & set(b))
    ra = {k: i for i, k in enumerate(sorted(keys, key=a.__getitem__))}
    rb = {k: i for i, k in enumerate(sorted(keys, key=b.__getitem__))}
    n = len(keys)
    return 1 - 6 * sum((ra[k] - rb[k]) ** 2 for k in keys) / (n * (n * n - 1)) if n > 1 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--real-kv", help="tile KV from this capture (else synthetic KV)")
    ap.add_argument("--context", type=int, default=8320, help="tokens per sequence (the engine's 8192 + 128 decoded)")
    ap.add_argument("--batches", type=int, nargs="+", default=[66, 67])
    ap.add_argument("--modes", nargs="+", default=["plan", "even", "balanced"], choices=sorted(MODES))
    ap.add_argument("--version", type=int, default=2)
    ap.add_argument("--launches", type=int, default=7, help="clocked launches per plan (L2 emptied before each)")
    ap.add_argument("--rep", type=int, default=30, help="do_bench rep of the unclocked build, for reference")
    args = ap.parse_args()

    t_start = time.time()
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    npg = -(-args.context // PS)
    last_len = args.context - (npg - 1) * PS
    pages = max(args.batches) * npg
    kv, _ = real_kv(args.real_kv, pages, gen) if args.real_kv else (synth_kv(pages, 0.16, 0.03, gen), None)
    pool, gstart, gdesc = cuda_inputs(kv, args.version)["cuda_zip"]
    perm = torch.randperm(pages, device=dev, generator=gen).to(torch.int32)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    src = zc.SOURCE.read_text()
    rows = []
    for b in args.batches:
        indices, indptr, last, q = equal_batch(perm, b, npg, last_len, dev, gen)
        ref = zr.decode_attention_f64(q[:2], kv, indptr[:3], indices[: 2 * npg], last[:2])
        for mode in args.modes:
            p = zc.plan(indptr, indices, last, HQ, HKV, D, PS, version=args.version, device=dev,
                        options=zc.LaunchOptions(**MODES[mode]))
            defs = {**zc.defines(D, args.version, p.warps, p.min_blocks, p.cta_merge, p.stage, p.balanced),
                    "WARP_CLOCK": 1}
            k = zc.build_source(src, dev.index or 0, defs)
            pieces = pieces_per_warp(p, indptr.tolist())
            clock = torch.zeros(len(pieces), 4, dtype=torch.int64, device=dev)
            out = torch.full_like(q, float("nan"))
            launches = []
            for _ in range(args.launches + 1):  # the first is a warm-up
                flush.zero_()
                clock.zero_()
                zc.launch(p, k, q, pool, gstart, gdesc, out, clock=clock)
                torch.cuda.synchronize()
                launches.append(summarise(clock.cpu(), pieces))
            launches = launches[1:]
            err = float((out[:2].double() - ref).norm() / ref.norm())
            if bool(out.isnan().any()) or err > 1e-2:
                raise AssertionError(f"batch {b} {mode}: outputs not all written or rel. err {err:.2e}")
            plain = bench(lambda: zc.run(p, q, pool, gstart, gdesc, out=out), args.rep)
            mid = sorted(launches, key=lambda r: r["span_us"])[len(launches) // 2]
            corr = [rank_correlation(launches[i]["sm_last_end_us"], launches[j]["sm_last_end_us"])
                    for i in range(len(launches)) for j in range(i + 1, len(launches))]
            for r in launches:
                if r is not mid:
                    del r["sm_last_end_us"]
            row = dict(batch=b, mode=mode, splits=p.num_splits, pages_per_split=p.pages_per_split, warps=p.warps,
                       min_blocks=p.min_blocks, cta_merge=p.cta_merge, balanced=p.balanced, grid_warps=len(pieces),
                       rel_err_f64=err, unclocked_do_bench_us=plain, spans_us=[r["span_us"] for r in launches],
                       sm_rank_correlation_between_launches=statistics.median(corr) if corr else None,
                       median_launch=mid)
            rows.append(row)
            bp = ", ".join(f"{n} piece(s): {v['warps']} warps end {v['end_median_us']:.1f} (max {v['end_max_us']:.1f}) "
                           f"dur {v['duration_median_us']:.1f}" for n, v in mid["by_pieces"].items())
            print(f"batch {b} {mode:8s} ({p.num_splits} splits x {p.pages_per_split} pages, balanced {p.balanced}, "
                  f"cta {p.cta_merge}): do_bench {plain:.1f} us; clocked span median {mid['span_us']:.1f} us "
                  f"(starts over {mid['start_spread_us']:.1f}); {bp}; SM ends {mid['sm_end_us']['min']:.1f}-"
                  f"{mid['sm_end_us']['max']:.1f} (inside an SM {mid['sm_inner_spread_us']:.1f}; rank correlation "
                  f"between launches {row['sm_rank_correlation_between_launches']:.2f}); last 5% by pieces "
                  f"{mid['last_5pct_pieces']}", flush=True)
    res = dict(suite="zip_warp_clock", date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               device=torch.cuda.get_device_name(0), sms=torch.cuda.get_device_properties(0).multi_processor_count,
               torch=torch.__version__, python=platform.python_version(),
               shape=dict(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS, context=args.context,
                          format_version=args.version),
               kv_data=f"real KV file {args.real_kv}" if args.real_kv else "synthetic",
               how="kernel built with WARP_CLOCK=1; L2 emptied (256 MB zero fill) before each clocked launch; "
                   "times in us from the launch's first warp start; median launch by span",
               wall_s=time.time() - t_start, results=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
