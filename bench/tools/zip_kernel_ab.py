"""A/B of CUDA ZipFusion decode-kernel variants beside FlashInfer, in one process (H200).

Why beside ``bench/zip_attention.py``: that bench tunes launch shapes and times one kernel build; a kernel change
worth 1-2% needs the old and the new build timed in the same process, in turn, with FlashInfer between them, or
the device's drift from run to run (a few us at 8192 x 64) hides it. Each variant is ``cuda/zip_decode.cu`` (or
another source file) compiled with the default launch shape's -D list plus its own overrides; every variant is
checked against the float64 reference (all outputs written) before it is timed.

    python bench/tools/zip_kernel_ab.py --real-kv bench/data/real_kv.safetensors \\
        --variant base --variant staged:stage=1 --variant v2:VERSION=2 --out $OUT/ab.json

Rounds: FlashInfer, then every variant (the order rotates each round), do_bench each (L2 cleared between calls);
per variant the median of its per-round ratios to FlashInfer. KV: as bench/zip_attention.py (``--real-kv``).
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
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import zip_attention as zab  # noqa: E402

from kvtide.cache import zip_blocks as zb  # noqa: E402
from kvtide.kernels import zip_attention_cuda as zc  # noqa: E402
from kvtide.kernels import zip_attention_ref as zr  # noqa: E402

HQ, HKV, D, PS, BLOCK = zab.HQ, zab.HKV, zab.D, zab.PS, zab.BLOCK
PLAN_KEYS = ("warps", "min_blocks", "num_splits", "stage", "balanced")


@dataclass
class Variant:
    name: str
    source: Path
    overrides: dict[str, int] = field(default_factory=dict)  # -D constants (upper case keys)
    plan_options: dict[str, int] = field(default_factory=dict)  # zc.plan keywords (lower case keys: warps, ...)

    @property
    def version(self) -> int | None:
        return self.overrides.get("VERSION")


def launch_scalar_split(p: zc.CudaDecodePlan, k: dict, q: torch.Tensor, pool: torch.Tensor, starts: torch.Tensor,
                        desc: torch.Tensor, out: torch.Tensor) -> None:
    """zc.launch for sources from before the kernel read pages per split from device memory (it was a launch
    argument; variant key ``SCALAR_SPLIT=1``, e.g. ``old@zip_decode_64f6991.cu:SCALAR_SPLIT=1``)."""
    split = p.num_splits > 1 and not p.cta_merge
    grid = (math.ceil(p.batch * p.num_kv_heads * p.num_splits / p.warps), 1, 1)
    k["zip_decode"].launch(grid, 32 * p.warps, [
        q, out, p.opart if split else out, p.lse if split else out, p.indptr, p.indices, p.kv_lens, pool, starts,
        desc, float(p.sm_scale * zc.LOG2E), p.pages_per_split, p.num_splits, p.num_kv_heads, p.group, p.batch],
        smem=zc.smem_bytes(p.head_dim, p.warps, p.stage))
    if split:
        k["zip_merge"].launch((p.batch, p.num_qo_heads, 1), p.head_dim, [
            p.opart, p.lse, out, p.kv_lens, p.pages_per_split * 16, p.num_splits, p.num_qo_heads])


def parse_variant(text: str) -> Variant:
    """``name[@source.cu][:KEY=VAL,...]`` -> a Variant (source defaults to the package's zip_decode.cu); upper-case
    keys are -D constants, lower-case ones ``zc.plan`` launch options (warps, min_blocks, num_splits)."""
    head, _, defs = text.partition(":")
    name, _, src = head.partition("@")
    if not name:
        raise argparse.ArgumentTypeError(f"variant {text!r}: empty name")
    overrides, plan_options = {}, {}
    for kv in filter(None, defs.split(",")):
        key, sep, val = kv.partition("=")
        if not sep or not key.isidentifier():
            raise argparse.ArgumentTypeError(f"variant {text!r}: {kv!r} is not KEY=VALUE")
        if key in PLAN_KEYS:
            plan_options[key] = int(val, 0)
        elif key.isupper():
            overrides[key] = int(val, 0)
        else:
            raise argparse.ArgumentTypeError(f"variant {text!r}: {key!r} is neither a -D constant (upper case) nor "
                                             f"a plan option {PLAN_KEYS}")
    source = Path(src) if src else zc.SOURCE
    if not source.is_file():
        raise argparse.ArgumentTypeError(f"variant {text!r}: no source file {source}")
    return Variant(name, source, overrides, plan_options)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real-kv", help="tile KV from this capture (else synthetic KV)")
    ap.add_argument("--variant", type=parse_variant, action="append", required=True,
                    help="name[@source.cu][:KEY=VAL,...] (repeat; the first is the reference for bit-equality)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 2048])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 32])
    ap.add_argument("--version", type=int, default=1, help="format version of variants that do not set VERSION")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if len({v.name for v in args.variant}) != len(args.variant):
        ap.error("variant names must differ")
    import flashinfer

    t0 = time.time()
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    fi = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    sources = {v.name: v.source.read_text() for v in args.variant}
    built: dict[tuple, dict] = {}
    results = []
    for ctx in args.contexts:
        npg = ctx // PS
        pages = max(args.batches) * npg
        if args.real_kv:
            kv, _ = zab.real_kv(args.real_kv, pages, gen)
        else:
            kv = zab.synth_kv(pages, 0.16, 0.03, gen)
        versions = sorted({v.version or args.version for v in args.variant})
        pools = {ver: zab.cuda_inputs(kv, ver)["cuda_zip"] for ver in versions}
        perm = torch.randperm(pages, device=dev, generator=gen).to(torch.int32)
        for b in sorted(args.batches):
            indices, indptr, last, q = zab.equal_batch(perm, b, npg, PS, dev, gen)
            zab.plan_flashinfer(fi, indptr, indices, last, dev)
            nref = 3
            ref = zr.decode_attention_f64(q[:nref], kv, indptr[: nref + 1], indices[: nref * npg], last[:nref])
            raw_bytes = b * ctx * HKV * D * 2 * 2
            row = dict(context=ctx, batch=b, raw_bytes=raw_bytes, variants={})
            used = indices.long()
            for ver, (_, _, gd) in pools.items():
                dsc = gd[used]
                row[f"v{ver}_bytes"] = int(zb.block_sizes(dsc.view(used.numel(), -1), BLOCK).sum()) + \
                    used.numel() * HKV * 2 * (8 + dsc.shape[-1])
                row[f"v{ver}_k_compressible"] = float((dsc[:, :, 0] != zb.RAW).float().mean())
                row[f"v{ver}_v_compressible"] = float((dsc[:, :, 1] != zb.RAW).float().mean())
            fns = {}
            first_out = {}
            for v in args.variant:
                ver = v.version or args.version
                p = zc.plan(indptr, indices, last, HQ, HKV, D, PS, version=ver, device=dev,
                            options=zc.LaunchOptions(**v.plan_options))
                defs = {**zc.defines(D, ver, p.warps, p.min_blocks, p.cta_merge, p.stage, p.balanced), **v.overrides}
                key = (v.name, tuple(sorted(defs.items())))
                try:
                    if key not in built:
                        built[key] = zc.build_source(sources[v.name], dev.index or 0, defs)
                except Exception as exc:  # noqa: BLE001 - a variant that does not build at this shape is recorded
                    row["variants"][v.name] = dict(defines=defs, error=repr(exc)[-400:])
                    print(f"ctx {ctx} B {b} {v.name}: does not build ({repr(exc)[-200:]})", flush=True)
                    continue
                k = built[key]
                cp, cs, cd = pools[ver]
                out = torch.full_like(q, float("nan"))
                go = launch_scalar_split if v.overrides.get("SCALAR_SPLIT") else zc.launch
                go(p, k, q, cp, cs, cd, out)
                torch.cuda.synchronize()
                err = float((out[:nref].double() - ref).norm() / ref.norm())
                written = not bool(out.isnan().any())
                same = None
                if ver in first_out:
                    same = bool(torch.equal(out, first_out[ver][1]))
                else:
                    first_out[ver] = (v.name, out)
                info = dict(defines=defs, source=str(v.source), registers=k["zip_decode"].num_regs,
                            local_bytes=k["zip_decode"].local_bytes, splits=p.num_splits,
                            launch=[p.warps, p.min_blocks], cta_merge=p.cta_merge, balanced=p.balanced,
                            stage=p.stage,
                            smem=zc.smem_bytes(D, p.warps, p.stage), rel_err_f64=err,
                            all_written=written, bit_equal_to_first_of_version=same)
                row["variants"][v.name] = info
                if not written or not err < 1e-2:
                    print(f"ctx {ctx} B {b} {v.name}: WRONG (rel err {err:.2e}, all written {written}); not timed",
                          flush=True)
                    continue
                fns[v.name] = (lambda p=p, k=k, cp=cp, cs=cs, cd=cd, out=out, go=go: go(p, k, q, cp, cs, cd, out))
            rounds = {"flashinfer": [], **{n: [] for n in fns}}
            names = list(fns)
            for r in range(args.rounds if names else 0):  # nothing to time when no variant passed its check
                rounds["flashinfer"].append(zab.bench(lambda: fi.run(q, kv), args.rep))
                for n in names[r % len(names):] + names[: r % len(names)]:
                    rounds[n].append(zab.bench(fns[n], args.rep))
            row["rounds_us"] = rounds
            row["flashinfer_us_median"] = statistics.median(rounds["flashinfer"]) if names else None
            if not names:
                results.append(row)
                continue
            line = f"ctx {ctx:5d} B {b:3d}  FI {row['flashinfer_us_median']:7.1f}us"
            for n in names:
                info = row["variants"][n]
                ratios = [f / z for f, z in zip(rounds["flashinfer"], rounds[n])]
                info["us_median"] = statistics.median(rounds[n])
                info["speedup_vs_flashinfer_rounds"] = ratios
                info["speedup_vs_flashinfer_median"] = statistics.median(ratios)
                ver = info["defines"]["VERSION"]
                info["TBps"] = row[f"v{ver}_bytes"] / info["us_median"] / 1e6
                line += (f"  {n} {info['us_median']:7.1f}us x{info['speedup_vs_flashinfer_median']:.3f} "
                         f"({min(ratios):.3f}-{max(ratios):.3f}, {info['registers']} regs)")
            print(line, flush=True)
            results.append(row)
        kv = pools = None  # freed before the next context is built
        torch.cuda.empty_cache()
    meta = dict(suite="zip_kernel_ab", date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                device=torch.cuda.get_device_name(0), torch=torch.__version__,
                flashinfer=getattr(flashinfer, "__version__", "?"), python=platform.python_version(),
                shape=dict(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS, block_size=BLOCK),
                kv_data=(f"real: tiled from {args.real_kv} (as bench/zip_attention.py); random q" if args.real_kv
                         else "synthetic (bench/zip_attention.py synth_kv); random q"),
                timing=f"{args.rounds} rounds of FlashInfer then every variant (rotating order), triton do_bench "
                       f"median each (rep {args.rep}, L2 cleared between calls); ratio per round, median of rounds",
                variants=[dict(name=v.name, source=str(v.source), overrides=v.overrides, plan_options=v.plan_options)
                          for v in args.variant],
                wall_s=time.time() - t0, results=results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
