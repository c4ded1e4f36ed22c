"""H200: how the CUDA ZipFusion kernel's time moves with its split count, per batch, against what the plan picks.

Why: the plan's wave model (``zip_attention_cuda.split_cost``) rounds warps up to whole waves. Just past a wave
boundary (8B shape, 16 warps per SM: 66 sequences x 8 KV heads x 4 splits fill 132 SMs exactly; 67 do not) it
jumps to many more splits and a global merge, and the engine's largest zip batch sits right there. This sweeps
every split count with both merges (in a CTA, or zip_merge) and both launch shapes at the engine's shape
(Llama-3.1-8B attention, page 16, format of the engine's pool), beside FlashInfer, so a split rule can be judged on
measured times, not on the model.

    python bench/tools/zip_splits.py --real-kv bench/data/real_kv.safetensors --out $OUT/zip_splits_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.zip_attention import (BLOCK, D, HKV, HQ, PS, bench, cuda_inputs, equal_batch,  # noqa: E402
                                plan_flashinfer, real_kv, synth_kv)
from kvtide.cache import zip_blocks as zb  # noqa: E402
from kvtide.kernels import zip_attention_cuda as zc  # noqa: E402
from kvtide.kernels import zip_attention_ref as zr  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--real-kv", help="tile KV from this capture (else synthetic KV)")
    ap.add_argument("--context", type=int, default=8320, help="tokens per sequence (the engine's 8192 + 128 decoded)")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 52, 64, 66, 67, 68, 72, 80, 96])
    ap.add_argument("--splits", type=int, nargs="+", default=list(range(1, 17)) + [18, 20, 24, 32])
    ap.add_argument("--shapes", nargs="+", default=["4,3", "4,4"], help="warps,CTAs per SM of the split kernel")
    ap.add_argument("--version", type=int, default=2, help="format version (the engine's default is 2)")
    ap.add_argument("--balanced", action="store_true",
                    help="instead of the sweep: the plan's choice, even splits (balanced=False) and balanced runs "
                         "(balanced=True), each batch, in turn for --rounds rounds")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--contexts", type=int, nargs="*", default=[],
                    help="with --balanced: more contexts after --context (each its own pool of pages)")
    ap.add_argument("--rep", type=int, default=30)
    args = ap.parse_args()
    import flashinfer

    t0 = time.time()
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    fi = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    rows = []
    for ctx in [args.context, *args.contexts]:
        npg = -(-ctx // PS)
        last_len = ctx - (npg - 1) * PS
        pages = max(args.batches) * npg
        kv, models = real_kv(args.real_kv, pages, gen) if args.real_kv else (synth_kv(pages, 0.16, 0.03, gen), None)
        pool, gstart, gdesc = cuda_inputs(kv, args.version)["cuda_zip"]
        perm = torch.randperm(pages, device=dev, generator=gen).to(torch.int32)
        for b in args.batches:
            indices, indptr, last, q = equal_batch(perm, b, npg, last_len, dev, gen)
            plan_flashinfer(fi, indptr, indices, last, dev)
            fi_us = bench(lambda: fi.run(q, kv), args.rep)
            ref = zr.decode_attention_f64(q[:2], kv, indptr[:3], indices[: 2 * npg], last[:2])

            def timed(**opts) -> dict:
                p = zc.plan(indptr, indices, last, HQ, HKV, D, PS, version=args.version, device=dev,
                            options=zc.LaunchOptions(**opts))
                out = torch.full_like(q, float("nan"))
                zc.run(p, q, pool, gstart, gdesc, out=out)
                torch.cuda.synchronize()
                err = float((out[:2].double() - ref).norm() / ref.norm())
                if bool(out.isnan().any()) or err > 1e-2:
                    raise AssertionError(f"batch {b} {opts}: outputs not all written or rel. err {err:.2e}")
                us = bench(lambda: zc.run(p, q, pool, gstart, gdesc, out=out), args.rep)
                return dict(splits=p.num_splits, pages_per_split=p.pages_per_split, warps=p.warps,
                            min_blocks=p.min_blocks, cta_merge=p.cta_merge, balanced=p.balanced, us=us,
                            rel_err_f64=err)

            own = timed()
            if args.balanced:
                modes = {"plan": {}, "even": {"balanced": False}, "balanced": {"balanced": True}}  # plan: the default
                rounds = {m: [] for m in ("flashinfer", *modes)}
                for _ in range(args.rounds):
                    rounds["flashinfer"].append(bench(lambda: fi.run(q, kv), args.rep))
                    for m, opts in modes.items():
                        rounds[m].append(timed(**opts))
                med = {m: sorted(r["us"] if isinstance(r, dict) else r for r in v)[len(v) // 2] for m, v in rounds.items()}
                row = dict(batch=b, context=ctx, rounds=rounds, median_us=med,
                           plan=rounds["plan"][0], even=rounds["even"][0], balanced=rounds["balanced"][0],
                           even_over_balanced=med["even"] / med["balanced"], fi_over_plan=med["flashinfer"] / med["plan"])
                rows.append(row)
                print(f"ctx {ctx:5d} batch {b:3d}: FlashInfer {med['flashinfer']:7.1f} us | plan "
                      f"{'balanced' if row['plan']['balanced'] else 'even'} {med['plan']:7.1f} | even "
                      f"{row['even']['splits']:2d} splits cta {int(row['even']['cta_merge'])} {med['even']:7.1f} | balanced "
                      f"{row['balanced']['pages_per_split']} pages/warp {med['balanced']:7.1f} "
                      f"(even / balanced {row['even_over_balanced']:.3f})", flush=True)
                continue
            sweep = []
            for w, mb in shapes:
                for s in args.splits:
                    for cta in (False, True):
                        if s > npg:
                            continue
                        r = timed(num_splits=s, warps=w, min_blocks=mb, cta_merge=cta)
                        if cta and not r["cta_merge"]:
                            continue  # the plan declined the CTA merge: the same launch as cta_merge=False
                        sweep.append(dict(r, shape=[w, mb]))
            best = min(sweep, key=lambda r: r["us"])
            dsc = gdesc[indices.long()]
            row = dict(batch=b, context=ctx, flashinfer_us=fi_us, plan=own, best=best,
                       plan_over_best=own["us"] / best["us"], fi_over_plan=fi_us / own["us"], fi_over_best=fi_us / best["us"],
                       k_compressible=float((dsc[:, :, 0] != zb.RAW).float().mean()),
                       v_compressible=float((dsc[:, :, 1] != zb.RAW).float().mean()), sweep=sweep)
            rows.append(row)
            print(f"batch {b:3d}: FlashInfer {fi_us:7.1f} us | plan {own['splits']:2d} splits {own['warps']}x"
                  f"{own['min_blocks']} cta {int(own['cta_merge'])} {own['us']:7.1f} us ({fi_us / own['us']:.3f}x) | best "
                  f"{best['splits']:2d} splits {best['shape']} cta {int(best['cta_merge'])} {best['us']:7.1f} us "
                  f"({fi_us / best['us']:.3f}x)", flush=True)
    out = dict(suite="zip_splits", date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               device=torch.cuda.get_device_name(), sms=torch.cuda.get_device_properties(dev).multi_processor_count,
               torch=torch.__version__, triton=triton.__version__, flashinfer=getattr(flashinfer, "__version__", "?"),
               python=platform.python_version(),
               shape=dict(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS, block_size=BLOCK,
                          format_version=args.version, context=args.context),
               kv_data=f"real KV file {args.real_kv}" if args.real_kv else "synthetic", kv_models=models,
               timing="triton.testing.do_bench median (L2 cleared between calls)", wall_s=time.time() - t0,
               results=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
