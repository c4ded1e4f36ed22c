"""One decode-attention call each of FlashInfer, the CUDA ZipFusion kernel (v1 and v2 pools) and its all-raw
control, for Nsight Compute to profile (H200): where the compressed stream's bytes/s go.

Run under ncu, which then sees only the profiled calls (the warm-up runs before the profiler starts)::

    ncu --clock-control none --profile-from-start off --set full -o $OUT/zip_ncu \\
        python bench/tools/zip_kernel_ncu.py --real-kv bench/data/real_kv.safetensors
    ncu --import $OUT/zip_ncu.ncu-rep --page details --csv > $OUT/zip_ncu_details.csv

KV as bench/zip_attention.py (``--real-kv``); the launch shape is the plan's default, as the engine runs it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import zip_attention as zab  # noqa: E402

from kvtide.kernels import zip_attention_cuda as zc  # noqa: E402

HQ, HKV, D, PS = zab.HQ, zab.HKV, zab.D, zab.PS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real-kv", help="tile KV from this capture (else synthetic KV)")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--versions", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--plan-options", nargs="*", default=[],
                    help="also profile the v1 pool under plans with these zc.plan options, e.g. stage=1,warps=4")
    args = ap.parse_args()
    import flashinfer

    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    npg = args.context // PS
    pages = args.batch * npg
    kv = zab.real_kv(args.real_kv, pages, gen)[0] if args.real_kv else zab.synth_kv(pages, 0.16, 0.03, gen)
    perm = torch.randperm(pages, device=dev, generator=gen).to(torch.int32)
    indices, indptr, last, q = zab.equal_batch(perm, args.batch, npg, PS, dev, gen)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    fi = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    zab.plan_flashinfer(fi, indptr, indices, last, dev)
    calls = {"flashinfer": lambda: fi.run(q, kv)}
    for ver in args.versions:
        inputs = zab.cuda_inputs(kv, ver)
        p = zc.plan(indptr, indices, last, HQ, HKV, D, PS, version=ver, device=dev)
        names = ("cuda_zip", "cuda_raw") if ver == args.versions[0] else ("cuda_zip",)
        for name in names:
            cp, cs, cd = inputs[name]
            calls[f"{name}_v{ver}"] = lambda p=p, cp=cp, cs=cs, cd=cd: zc.run(p, q, cp, cs, cd)
        print(f"v{ver}: splits {p.num_splits}, launch {p.warps} warps x {p.min_blocks}, cta_merge {p.cta_merge}")
        for text in args.plan_options if ver == args.versions[0] else ():
            opts = {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}
            po = zc.plan(indptr, indices, last, HQ, HKV, D, PS, version=ver, device=dev,
                         options=zc.LaunchOptions(**opts))
            cp, cs, cd = inputs["cuda_zip"]
            calls[f"cuda_zip_v{ver}_{text}"] = lambda p=po, cp=cp, cs=cs, cd=cd: zc.run(p, q, cp, cs, cd)
            print(f"v{ver} {text}: splits {po.num_splits}, launch {po.warps} warps x {po.min_blocks}, "
                  f"cta_merge {po.cta_merge}, stage {po.stage}")
    for fn in calls.values():  # warm: builds, FlashInfer's JIT, first-touch
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in calls.items():
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled, in order:", ", ".join(calls))


if __name__ == "__main__":
    main()
