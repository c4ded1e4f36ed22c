"""GPU benchmark (`kvtide bench zip-attention`): ZipFusion decode attention (CUDA and Triton) vs FlashInfer tensor-core decode vs our raw kernel
vs decompress-then-FlashInfer, at the Llama-3.1-8B attention shape (32 q heads, 8 KV heads, d=128, page 16).

KV (``--real-kv``, the default for reported runs) is tiled from real KV of the bundled models: ``--capture``
(run on the CPU) runs SmolLM2-135M and Qwen2.5-Coder-0.5B in bf16 over a prose and a code window and saves
every (layer, KV head) stream of K and V; each stream's head_dim-64 rows are paired ([T, 64] -> [T/2, 128], two
consecutive tokens per row), so a 512-value block of the 8B shape (4 rows x 128) holds exactly the 8 tokens x 64
values of one real-model block and the compressible fraction of the tiled KV is the real one (it is reported).
Pages take random 16-row groups of these streams. Format v2 by default, the one the engine's compressed pool
stores (``--version 1``: the paper's format, which leaves more K blocks raw: K 79% compressed against 93%). Without ``--real-kv`` the KV is synthetic (Gaussian,
log-normal key channel scales, exact zeros in a chosen fraction of blocks). Weights play no part. Each batch
entry has its own pages, scattered through the pool by a random page table. L2 is cleared between calls
(do_bench).

    python bench/zip_attention.py --capture bench/data/real_kv.safetensors         # CPU, ~2 min
    python bench/zip_attention.py --real-kv bench/data/real_kv.safetensors --out $OUT/zip_attention.json

Diagnostics beside the do_bench figures (the goals' measure): ``--clean-flush`` (L2 emptied by a read-only sweep, no
dirty lines left for the timed call), ``--breakdown`` (device time per kernel, CUPTI). The CUDA kernel's launch shapes (``CUDA_CONFIGS``, the first being the plan's own
choice, as the engine runs it) are tuned with the splits merged in a CTA and with the zip_merge launch, and the best of
each is timed again (``cta_merge_ab``); ``--stage`` picks where the kernel stages the next page (default: the plan's).
Kernel changes worth 1-2% are A/B'd with ``bench/tools/zip_kernel_ab.py`` (variants in one process, in turn).
Writes JSON (machine header first) and a PNG of the speedups over FlashInfer beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvtide.extras import require  # noqa: E402

triton = require("triton", "gpu", "kvtide bench zip-attention")
from triton.testing import do_bench  # noqa: E402

from bench import report  # noqa: E402
from kvtide.cache import zip_order  # noqa: E402
from kvtide.cache import zip_blocks as zb  # noqa: E402
from kvtide.kernels import zip_attention as za  # noqa: E402
from kvtide.kernels import zip_attention_cuda as zc  # noqa: E402
from kvtide.kernels import zip_attention_ref as zr  # noqa: E402
from kvtide.kernels import zip_encode as ze  # noqa: E402

HQ, HKV, D, PS, BLOCK = 32, 8, 128, 16, 512
# (tile tokens, warps, stages, waves for the split heuristic[, zip mode, prefetch, trans, late_v, maxnreg, pipe]);
# the best per shape is timed again against FlashInfer
CONFIGS = {
    "raw": [(32, 4, 1, 4), (64, 4, 1, 4), (64, 4, 2, 4), (128, 8, 1, 4), (32, 4, 1, 2), (32, 4, 1, 4, 0, 1, 1),
            (64, 4, 2, 4, 0, 1, 1)],
    # the zip kernel walks one page per step (tile = page); see zip_attention._zip_load for the modes
    "zip": [(16, 1, 1, 4, 1, 0, 0, 0, 0),  # q heads as M (the first version of this kernel)
            (16, 1, 1, 8, 1, 0, 1, 1, 128), (16, 1, 1, 8, 1, 0, 1, 0, 128),  # the best of the last sweep
            (16, 1, 1, 8, 2, 0, 1, 1, 128), (16, 2, 1, 8, 1, 0, 1, 1, 0),
            # pipe: loads staged through shared memory by Triton's software pipeliner (num_stages >= 2)
            (16, 1, 3, 8, 1, 0, 1, 0, 0, 1), (16, 1, 2, 8, 1, 0, 1, 0, 0, 1), (16, 1, 4, 8, 1, 0, 1, 0, 0, 1),
            (16, 1, 3, 8, 1, 0, 1, 0, 168, 1), (16, 1, 3, 4, 1, 0, 1, 0, 0, 1), (16, 1, 3, 16, 1, 0, 1, 0, 0, 1),
            (16, 2, 3, 8, 1, 0, 1, 0, 0, 1), (16, 2, 3, 4, 1, 0, 1, 0, 0, 1), (16, 1, 3, 8, 2, 0, 1, 0, 0, 1),
            (16, 1, 3, 8, 0, 0, 1, 0, 0, 1), (16, 1, 3, 8, 1, 0, 1, 1, 0, 1), (32, 2, 3, 8, 1, 0, 1, 0, 0, 1),
            (16, 1, 3, 8, 1, 0, 0, 0, 0, 1)],
}


def synth_kv(pages: int, k_zero_frac: float, v_zero_frac: float, gen: torch.Generator) -> torch.Tensor:
    """NHD bf16 [pages, 2, PS, HKV, D] on the GPU; an exact zero in a chosen fraction of 512-value blocks."""
    dev = "cuda"
    chan = torch.exp(torch.randn(HKV, D, device=dev, generator=gen) * 0.35)
    kv = torch.empty(pages, 2, PS, HKV, D, dtype=torch.bfloat16, device=dev)
    step = 4096
    for s in range(0, pages, step):
        e = min(pages, s + step)
        x = torch.randn(e - s, 2, PS, HKV, D, device=dev, generator=gen)
        x[:, 0] *= chan
        x[:, 1] *= 0.25
        rows = BLOCK // D  # tokens per block
        for kv_i, frac in ((0, k_zero_frac), (1, v_zero_frac)):
            hit = torch.rand(e - s, PS // rows, HKV, device=dev, generator=gen) < frac  # [p, block, head]
            p_i, b_i, h_i = hit.nonzero(as_tuple=True)
            col = torch.randint(0, D, (p_i.numel(),), device=dev, generator=gen)
            x[p_i, kv_i, b_i * rows, h_i, col] = 0.0
        kv[s:e] = x.bfloat16()
    return kv


def capture(path: str, tokens: int) -> None:
    """Real KV rows of both bundled models (CPU, bf16 compute) as [rows, 128] K and V streams."""
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from zip_format import MODELS, capture_kv  # noqa: E402

    k_rows, v_rows, info = [], [], {}
    for name in MODELS:
        shape, kv = capture_kv(name, "cpu", tokens)
        if shape["head_dim"] * 2 != D:
            raise SystemExit(f"{name}: head_dim {shape['head_dim']} cannot be paired into {D}")
        for layer in kv:  # [pages, 2, PS, Hkv, 64] of two texts, pages in order within each text
            x = layer.permute(1, 3, 0, 2, 4).reshape(2, layer.shape[3], -1, shape["head_dim"])  # [2, H, T, 64]
            x = x.reshape(2, x.shape[1], -1, D)  # two consecutive tokens per row
            k_rows.append(x[0].reshape(-1, D))
            v_rows.append(x[1].reshape(-1, D))
        info[name] = shape
    k, v = torch.cat(k_rows).contiguous(), torch.cat(v_rows).contiguous()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({"k_rows": k, "v_rows": v}, path, metadata={"models": json.dumps(info)})
    print(f"saved {k.shape[0]} K and V rows of 128 values to {path}")


def real_kv(path: str, pages: int, gen: torch.Generator) -> tuple[torch.Tensor, dict]:
    """NHD bf16 [pages, 2, PS, HKV, D] on the GPU from random 16-row groups of the captured real streams."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        k = f.get_tensor("k_rows").cuda()
        v = f.get_tensor("v_rows").cuda()
        info = json.loads(f.metadata()["models"])
    ngroups = k.shape[0] // PS  # each stream holds pages x 8 rows (even page counts): no group spans two streams
    kg, vg = k[: ngroups * PS].view(ngroups, PS, D), v[: ngroups * PS].view(ngroups, PS, D)
    pick = torch.randint(0, ngroups, (pages, HKV), device="cuda", generator=gen)
    kv = torch.empty(pages, 2, PS, HKV, D, dtype=torch.bfloat16, device="cuda")
    kv[:, 0] = kg[pick].permute(0, 2, 1, 3)
    kv[:, 1] = vg[pick].permute(0, 2, 1, 3)
    return kv, info


def equal_batch(perm: torch.Tensor, batch: int, npg: int, last_len: int, dev, gen: torch.Generator):
    """(page ids, indptr, last page lengths, q) of ``batch`` sequences of ``npg`` pages each, taken in order from
    ``perm`` (page ids stay on its device, the other tables on the host as the plans take them), q drawn from ``gen``."""
    indices = perm[: batch * npg].contiguous()
    indptr = torch.arange(0, batch + 1, dtype=torch.int32) * npg
    last = torch.full((batch,), last_len, dtype=torch.int32)
    q = torch.randn(batch, HQ, D, device=dev, generator=gen).bfloat16()
    return indices, indptr, last, q


def plan_flashinfer(fi, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, dev) -> None:
    """FlashInfer's decode wrapper planned over these tables at the bench's shape (bf16, no RoPE)."""
    fi.plan(indptr.to(dev), indices, last.to(dev), HQ, HKV, D, PS, pos_encoding_mode="NONE",
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)


def encode_nhd(kv: torch.Tensor, version: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPU page compression (Triton encoder) into the storage contract's pool / group_start / group_desc."""
    p = kv.shape[0]
    groups = kv.permute(0, 3, 1, 2, 4).reshape(p * HKV * 2, PS * D).contiguous()
    e = ze.encode_groups(groups, BLOCK, version)
    del groups
    nb = PS * D // BLOCK
    return e.data, e.starts.view(p, HKV, 2), e.desc.view(p, HKV, 2, nb)


def cuda_inputs(kv: torch.Tensor, version: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The CUDA kernel's inputs: the same pages in the "mma" value order, compressed (GPU encoder) and all raw."""
    p = kv.shape[0]
    groups = zip_order.to_stored(kv.permute(0, 3, 1, 2, 4).reshape(p, HKV, 2, PS * D), "mma", PS, D).contiguous()
    e = ze.encode_groups(groups.view(-1, PS * D), BLOCK, version)
    nb = PS * D // BLOCK
    return {"cuda_zip": (e.data, e.starts.view(p, HKV, 2), e.desc.view(p, HKV, 2, nb)), "cuda_raw": zc.raw_pool(groups)}


def tune_cuda(pool, gstart, gdesc, q, indptr, indices, last, ref, o_fi, nref, args, dev) -> dict:
    """Every CUDA_CONFIGS launch shape checked (f64 reference, all outputs written) and timed; the best kept."""
    tuned = []
    for (warps, min_blocks, waves), cta in [(s, c) for s in args.cuda_launch for c in (False, True)]:
        opts = dict(warps=warps or None, min_blocks=min_blocks or None, waves=waves, cta_merge=cta, stage=args.stage)
        try:
            p = zc.plan(indptr, indices, last, HQ, HKV, D, PS, version=args.version, device=dev,
                        options=zc.LaunchOptions(**opts))
            if cta and not p.cta_merge:  # the plan kept the global merge: the same kernel as cta_merge=False
                continue
            out = torch.full_like(q, float("nan"))
            zc.run(p, q, pool, gstart, gdesc, out=out, check=True)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a launch shape the device refuses is recorded, not fatal
            tuned.append(dict(options=opts, error=repr(exc)[:300]))
            continue
        ok = not bool(out.isnan().any())
        err = float((out[:nref].double() - ref).norm() / ref.norm())
        vs_fi = float((out.float() - o_fi.float()).norm() / o_fi.float().norm())
        us = bench(lambda: zc.run(p, q, pool, gstart, gdesc, out=out), args.tune_rep) if ok and err < 1e-2 \
            else float("inf")
        k = zc.kernels(dev.index or 0, D, args.version, p.warps, p.min_blocks, p.cta_merge, p.stage,
                       p.balanced)["zip_decode"]
        tuned.append(dict(options=opts, splits=p.num_splits, launch=[p.warps, p.min_blocks], stage=p.stage, us=us,
                          all_written=ok,
                          rel_err_f64=err, rel_diff_vs_flashinfer=vs_fi, registers=k.num_regs,
                          local_bytes=k.local_bytes))
    good = [t for t in tuned if t.get("us", float("inf")) < float("inf")]
    if not good:
        return dict(error="no launch shape passed", tuned=tuned)
    # the best with the splits merged in a CTA and the best with zip_merge, both timed again at the end
    by_merge = {c: min((t for t in good if t["options"]["cta_merge"] == c), key=lambda t: t["us"], default=None)
                for c in (False, True)}
    return dict(min(good, key=lambda t: t["us"]), tuned=tuned,
                best_by_merge={str(c): t["options"] for c, t in by_merge.items() if t is not None})


def make_plan(kind: str, cfg, indptr, indices, last, version: int, dev) -> za.DecodePlan:
    return za.plan(indptr, indices, last, HQ, HKV, D, PS, version=version, device=dev, kernel=kind,
                   **config_options(cfg))


def config_options(cfg) -> dict:
    """A CONFIGS tuple as ``za.plan`` keyword arguments (maxnreg 0: no register cap)."""
    defaults = (16, 1, 1, 4.0, 0, False, False, False, 0, False)
    tile, warps, stages, waves, mode, pf, tr, lv, mr, pipe = (*cfg, *defaults[len(cfg):])
    return dict(tile=tile, num_warps=warps, num_stages=stages, waves=waves, mode=mode, prefetch=bool(pf),
                trans=bool(tr), late_v=bool(lv), maxnreg=mr, pipe=bool(pipe))

# CUDA kernel (kvtide/kernels/zip_attention_cuda.py): (warps per CTA, CTAs per SM for the register cut, waves;
# None = the plan's wave model for the split count); (0, 0, None) = the plan's own choice of launch shape, as the
# engine runs it
CUDA_CONFIGS = [(0, 0, None), (4, 3, None), (4, 4, None), (2, 6, None), (1, 12, None), (4, 2, None), (4, 3, 2.0),
                (4, 3, 4.0), (2, 6, 4.0)]


def parse_launch(text: str) -> tuple[int, int, float | None]:
    """``warps,min_blocks[,waves]`` -> a CUDA_CONFIGS entry."""
    w, mb, *wv = text.split(",")
    return int(w), int(mb), (float(wv[0]) if wv and wv[0] not in ("", "None") else None)


def bench(fn, rep: int) -> float:
    return do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3  # us


_SWEEP: list[torch.Tensor] = []


def bench_clean_flush(fn, n: int = 200) -> float:
    """Median us of ``fn`` with L2 emptied before each call by a read-only sweep of 512 MB (a sum), CUDA events.

    Why next to do_bench: do_bench empties L2 by zero-filling 256 MB, which leaves L2 full of dirty lines (the
    H200's is ~50 MB); the timed call then pays their write-back to DRAM on top of its own reads, the same
    absolute time for every kernel, so it narrows the ratio of a kernel that reads fewer bytes. A decode step's
    attention follows kernels that mostly read (weights), which the sweep resembles. The goals are judged on
    do_bench; this is a second, labelled figure."""
    if not _SWEEP:
        _SWEEP.extend([torch.ones(128 << 20, dtype=torch.float32, device="cuda"),
                       torch.empty((), dtype=torch.float32, device="cuda")])
    buf, sink = _SWEEP
    fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in ev:
        torch.sum(buf, (0,), out=sink)
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in ev)
    return times[len(times) // 2] * 1e3


def kernel_breakdown(fn, n: int = 30) -> dict:
    """Device time of each kernel ``fn`` launches (torch.profiler, CUPTI), L2 emptied by the read-only sweep before
    each call: which part of a call is the decode kernel, the split merge and the gaps between them."""
    from torch.profiler import ProfilerActivity, profile

    bench_clean_flush(fn, 3)  # warm, and the sweep buffer exists
    buf, sink = _SWEEP
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            torch.sum(buf, (0,), out=sink)
            fn()
        torch.cuda.synchronize()
    kern = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)
    calls, cur = [], []
    for e in kern:  # the sweep's reduction kernels separate the calls
        if "reduce" in e.name.lower() or "sum" in e.name.lower():
            if cur:
                calls.append(cur)
            cur = []
        else:
            cur.append(e)
    if cur:
        calls.append(cur)
    per: dict[str, list[float]] = {}
    spans = []
    for c in calls:
        for e in c:
            per.setdefault(e.name[:60], []).append(e.time_range.elapsed_us())
        spans.append(c[-1].time_range.end - c[0].time_range.start)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"calls": len(calls), "span_us_median": med(spans) if spans else None,
            "kernels_us_median": {k: med(v) for k, v in per.items()}}


def draw(doc: dict, plt):
    """Headline figure: each kernel's speedup over FlashInfer per (context, batch), round medians where timed in
    rounds, beside the byte ceiling of the CUDA kernel's pages."""
    rows = doc["results"]
    kinds = [k for k in ("cuda_zip", "cuda_raw", "zip", "raw") if any("us" in r.get(k, {}) for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4))
    width = 0.8 / max(1, len(kinds))
    for i, kind in enumerate(kinds):
        ys = [r.get(kind, {}).get("speedup_vs_flashinfer_rounds_median",
                                  r.get(kind, {}).get("speedup_vs_flashinfer", 0)) for r in rows]
        ax.bar([j + (i - (len(kinds) - 1) / 2) * width for j in range(len(rows))], ys, width, label=kind)
    ax.plot(range(len(rows)), [r["cuda_ceiling_speedup"] for r in rows], "k_", markersize=20, label="byte ceiling")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(rows)), [f"{r['context']} x {r['batch']}" for r in rows])
    ax.set_xlabel("context x batch")
    ax.set_ylabel("speedup over FlashInfer (x)")
    ax.set_title(f"decode attention, {doc.get('device', '')}, format v{doc.get('shape', {}).get('format_version')}")
    ax.legend(fontsize=8)
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="decode attention kernels against FlashInfer (CUDA)")
    ap.add_argument("--out", help="JSON result (a PNG is written beside it)")
    ap.add_argument("--capture", help="CPU: capture real KV of the bundled models to this safetensors file")
    ap.add_argument("--capture-tokens", type=int, default=512)
    ap.add_argument("--real-kv", help="tile KV from this capture (else synthetic KV)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 64, 96])
    ap.add_argument("--version", type=int, default=2,
                    help="ZipFusion format of the pages: 2 (exact-zero escapes; the engine's pool format, "
                         "CacheConfig.format_version's default) or 1 (the paper's)")
    ap.add_argument("--k-zero-frac", type=float, default=0.16)
    ap.add_argument("--v-zero-frac", type=float, default=0.03)
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--tune-rep", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=5,
                    help="after the single timings: this many rounds of FlashInfer and the CUDA kernels timed in turn "
                         "(do_bench each); the per-round ratio's median is reported beside the single figure")
    ap.add_argument("--skip-triton", action="store_true", help="time only FlashInfer and the CUDA kernel")
    ap.add_argument("--breakdown", action="store_true",
                    help="device time per kernel of FlashInfer and the best kernels (torch.profiler, clean flush)")
    ap.add_argument("--clean-flush", action="store_true",
                    help="also time FlashInfer and the best kernels with L2 emptied by a read-only sweep")
    ap.add_argument("--stage", type=int, default=None,
                    help="CUDA kernel: where the next page's groups wait (zc.STAGES; default: the plan's)")
    ap.add_argument("--cuda-launch", type=parse_launch, nargs="+", default=CUDA_CONFIGS,
                    help="CUDA kernel launch shapes tried: warps,min_blocks[,waves] (default: CUDA_CONFIGS)")
    args = ap.parse_args(argv)
    if args.capture:
        capture(args.capture, args.capture_tokens)
        return
    if not args.out:
        ap.error("--out is required")
    import flashinfer

    t_start = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.device("cuda")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    fi = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    results = []
    for ctx in args.contexts:
        bmax = max(args.batches)
        npg = ctx // PS
        pages = bmax * npg
        if args.real_kv:
            kv, kv_models = real_kv(args.real_kv, pages, gen)
        else:
            kv, kv_models = synth_kv(pages, args.k_zero_frac, args.v_zero_frac, gen), None
        pool, gstart, gdesc = encode_nhd(kv, args.version)
        cuda_in = cuda_inputs(kv, args.version)
        perm = torch.randperm(pages, device=dev, generator=gen).to(torch.int32)
        sizes = zb.block_sizes(gdesc.view(pages, -1), BLOCK).sum(1)  # stored bytes per page
        for b in sorted(args.batches):
            indices, indptr, last, q = equal_batch(perm, b, npg, PS, dev, gen)
            used = indices.long()
            dsc = gdesc[used]
            k_frac = float((dsc[:, :, 0] != zb.RAW).float().mean())
            v_frac = float((dsc[:, :, 1] != zb.RAW).float().mean())
            raw_bytes = b * ctx * HKV * D * 2 * 2
            zip_bytes = int(sizes[used].sum()) + used.numel() * HKV * 2 * (8 + dsc.shape[-1])
            plan_flashinfer(fi, indptr, indices, last, dev)
            o_fi = fi.run(q, kv)
            # correctness on the full shape: f64 reference on a few sequences, all outputs written
            nref = 3
            ref = zr.decode_attention_f64(q[:nref], kv, indptr[: nref + 1], indices[: nref * npg], last[:nref])
            row = dict(context=ctx, batch=b, k_compressible=k_frac, v_compressible=v_frac, raw_bytes=raw_bytes,
                       zip_bytes=zip_bytes, bytes_ratio=zip_bytes / raw_bytes)
            row["flashinfer_rel_err"] = float((o_fi[:nref].double() - ref).norm() / ref.norm())
            best = {}

            def cplan(**opts) -> zc.CudaDecodePlan:  # the CUDA kernel's plan of this batch, launch options as given
                return zc.plan(indptr, indices, last, HQ, HKV, D, PS, version=args.version, device=dev,
                               options=zc.LaunchOptions(**{"stage": args.stage, **opts}))

            for kind, (cp, cs, cd) in cuda_in.items():  # the CUDA kernel over the mma-ordered pool, and all-raw
                row[kind] = tune_cuda(cp, cs, cd, q, indptr, indices, last, ref, o_fi, nref, args, dev)
                if "us" in row[kind]:
                    opts = row[kind]["options"]
                    best[kind] = lambda p=cplan(**opts), cp=cp, cs=cs, cd=cd: zc.run(p, q, cp, cs, cd)  # noqa: E731
            cdsc = cuda_in["cuda_zip"][2][used]
            cuda_bytes = int(zb.block_sizes(cdsc.view(used.numel(), -1), BLOCK).sum()) + \
                used.numel() * HKV * 2 * (8 + cdsc.shape[-1])
            row.update(cuda_k_compressible=float((cdsc[:, :, 0] != zb.RAW).float().mean()),
                       cuda_v_compressible=float((cdsc[:, :, 1] != zb.RAW).float().mean()), cuda_zip_bytes=cuda_bytes)
            for kind in () if args.skip_triton else ("raw", "zip"):
                tuned = []
                for cfg in CONFIGS[kind]:
                    p = make_plan(kind, cfg, indptr, indices, last, args.version, dev)
                    out = torch.full_like(q, float("nan"))
                    if kind == "zip":
                        fn = lambda p=p, out=out: za.run_zip(p, q, pool, gstart, gdesc, out=out)  # noqa: E731
                    else:
                        fn = lambda p=p, out=out: za.run_raw(p, q, kv, out=out)  # noqa: E731
                    try:
                        fn()
                        torch.cuda.synchronize()
                    except Exception as exc:  # a config that does not compile (e.g. out of shared memory)
                        tuned.append(dict(config=list(cfg), error=repr(exc)[:200]))
                        continue
                    ok = not bool(out.isnan().any())
                    err = float((out[:nref].double() - ref).norm() / ref.norm())
                    vs_fi = float((out.float() - o_fi.float()).norm() / o_fi.float().norm())
                    us = bench(fn, args.tune_rep) if ok and err < 1e-2 else float("inf")
                    tuned.append(dict(config=list(cfg), splits=p.num_splits, us=us,
                                      all_written=ok, rel_err_f64=err, rel_diff_vs_flashinfer=vs_fi))
                good = [t for t in tuned if t.get("us", float("inf")) < float("inf")]
                if not good:
                    row[kind] = dict(error="no config passed", tuned=tuned)
                    continue
                top = min(good, key=lambda t: t["us"])
                p = make_plan(kind, top["config"], indptr, indices, last, args.version, dev)
                if kind == "zip":
                    fn = lambda p=p: za.run_zip(p, q, pool, gstart, gdesc)  # noqa: E731
                else:
                    fn = lambda p=p: za.run_raw(p, q, kv)  # noqa: E731
                best[kind] = fn
                row[kind] = dict(top, options=config_options(top["config"]), tuned=tuned)
            buf = torch.empty_like(kv)
            page_ids = indices

            def decomp_then_fi() -> torch.Tensor:
                za.decompress_pages(pool, gstart, gdesc, PS, D, BLOCK, args.version, out=buf, page_ids=page_ids)
                return fi.run(q, buf)

            o_dc = decomp_then_fi()
            row["decompress_rel_diff_vs_flashinfer"] = float((o_dc.float() - o_fi.float()).norm()
                                                             / o_fi.float().norm())
            row["decompress_bit_exact"] = bool(torch.equal(buf[used].view(torch.int16), kv[used].view(torch.int16)))
            # final timings, interleaved in one run
            row["flashinfer_us"] = bench(lambda: fi.run(q, kv), args.rep)
            for kind, fn in best.items():
                row[kind]["us"] = bench(fn, args.rep)
            if args.rounds > 0:  # FlashInfer and the CUDA kernels in turn: drift of the device over the run (clocks,
                # heat) lands on both sides of each round's ratio instead of between two single figures
                cuda_best = {k: fn for k, fn in best.items() if k.startswith("cuda_")}
                rounds = {"flashinfer": [], **{k: [] for k in cuda_best}}
                for _ in range(args.rounds):
                    rounds["flashinfer"].append(bench(lambda: fi.run(q, kv), args.rep))
                    for kind, fn in cuda_best.items():
                        rounds[kind].append(bench(fn, args.rep))
                row["rounds"] = {"n": args.rounds, "us": rounds}
                for kind in cuda_best:
                    ratios = [f / z for f, z in zip(rounds["flashinfer"], rounds[kind])]
                    row[kind]["speedup_vs_flashinfer_rounds"] = ratios
                    row[kind]["speedup_vs_flashinfer_rounds_median"] = statistics.median(ratios)
                    row[kind]["us_rounds_median"] = statistics.median(rounds[kind])
                row["flashinfer_us_rounds_median"] = statistics.median(rounds["flashinfer"])
                print(f"ctx {ctx:5d} B {b:3d}  {args.rounds} rounds: FI {row['flashinfer_us_rounds_median']:7.1f}us  "
                      + "  ".join(f"{k} {row[k]['us_rounds_median']:7.1f}us x{row[k]['speedup_vs_flashinfer_rounds_median']:.3f} "
                                  f"({min(row[k]['speedup_vs_flashinfer_rounds']):.3f}-"
                                  f"{max(row[k]['speedup_vs_flashinfer_rounds']):.3f})" for k in cuda_best), flush=True)
            if args.breakdown:
                try:
                    row["flashinfer_breakdown"] = kernel_breakdown(lambda: fi.run(q, kv))
                    for kind, fn in best.items():
                        row[kind]["breakdown"] = kernel_breakdown(fn)
                except Exception as exc:  # noqa: BLE001 - a diagnostic: its failure must not cost the run
                    row["breakdown_error"] = repr(exc)[:300]
                    row["flashinfer_breakdown"] = {}
                    for kind in best:
                        row[kind]["breakdown"] = {}
                print(f"ctx {ctx:5d} B {b:3d}  breakdown: FI {row['flashinfer_breakdown']}; "
                      f"{ {k: row[k]['breakdown'] for k in best} }", flush=True)
            for kind in ("cuda_zip", "cuda_raw"):  # A/B: splits merged in a CTA against the zip_merge launch
                bm = row.get(kind, {}).get("best_by_merge", {})
                if len(bm) < 2:
                    continue
                cp, cs, cd = cuda_in[kind]
                ab = {}
                for c, opts in bm.items():
                    cpl = cplan(**opts)
                    afn = lambda cpl=cpl, cp=cp, cs=cs, cd=cd: zc.run(cpl, q, cp, cs, cd)  # noqa: E731
                    ab[c] = dict(options=opts, us=bench(afn, args.rep))
                    if args.clean_flush:
                        ab[c]["us_clean_flush"] = bench_clean_flush(afn)
                row[kind]["cta_merge_ab"] = ab
                print(f"ctx {ctx:5d} B {b:3d}  {kind} merge in CTA vs zip_merge: "
                      + "  ".join(f"{c}: {v['us']:.1f}us" + (f" (clean {v['us_clean_flush']:.1f})" if args.clean_flush
                                                            else "") for c, v in ab.items()), flush=True)
            if args.clean_flush:  # a second figure, L2 emptied without dirty lines (see bench_clean_flush)
                row["flashinfer_us_clean_flush"] = bench_clean_flush(lambda: fi.run(q, kv))
                for kind, fn in best.items():
                    row[kind]["us_clean_flush"] = us_c = bench_clean_flush(fn)
                    row[kind]["speedup_vs_flashinfer_clean_flush"] = row["flashinfer_us_clean_flush"] / us_c
            row["decompress_only_us"] = bench(lambda: za.decompress_pages(
                pool, gstart, gdesc, PS, D, BLOCK, args.version, out=buf, page_ids=page_ids), args.rep)
            row["decompress_then_flashinfer_us"] = bench(decomp_then_fi, args.rep)
            fi_us = row["flashinfer_us"]
            row["flashinfer_TBps"] = raw_bytes / fi_us / 1e6
            for kind in best:
                us = row[kind]["us"]
                row[kind]["speedup_vs_flashinfer"] = fi_us / us
                nbytes = {"zip": zip_bytes, "cuda_zip": cuda_bytes}.get(kind, raw_bytes)
                row[kind]["TBps"] = nbytes / us / 1e6
            row["ceiling_speedup"] = raw_bytes / zip_bytes
            row["cuda_ceiling_speedup"] = raw_bytes / cuda_bytes
            results.append(row)
            z, r = row.get("zip", {}), row.get("raw", {})
            cz, cr = row.get("cuda_zip", {}), row.get("cuda_raw", {})
            if args.clean_flush:
                print(f"ctx {ctx:5d} B {b:3d}  clean flush: FI {row['flashinfer_us_clean_flush']:7.1f}us  cuda zip "
                      f"{cz.get('us_clean_flush', 0):7.1f} x{cz.get('speedup_vs_flashinfer_clean_flush', 0):.3f}  "
                      f"cuda raw {cr.get('us_clean_flush', 0):7.1f}", flush=True)
            print(f"ctx {ctx:5d} B {b:3d}  FI {fi_us:7.1f}us  cuda raw {cr.get('us', 0):7.1f}  cuda zip "
                  f"{cz.get('us', 0):7.1f} x{cz.get('speedup_vs_flashinfer', 0):.3f} (ceil "
                  f"x{row['cuda_ceiling_speedup']:.3f})  triton raw {r.get('us', 0):7.1f}  zip {z.get('us', 0):7.1f}"
                  f"  x{z.get('speedup_vs_flashinfer', 0):.3f} (ceil x{row['ceiling_speedup']:.3f})"
                  f"  decomp+FI {row['decompress_then_flashinfer_us']:7.1f}  K {k_frac:.3f} V {v_frac:.3f}",
                  flush=True)
            del buf
        del kv, pool, gstart, gdesc, cuda_in
        torch.cuda.empty_cache()
    meta = dict(
        suite="zip_attention", date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        device=torch.cuda.get_device_name(0), sms=torch.cuda.get_device_properties(0).multi_processor_count,
        torch=torch.__version__, triton=triton.__version__, flashinfer=getattr(flashinfer, "__version__", "?"),
        python=platform.python_version(), shape=dict(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS,
                                                      block_size=BLOCK, format_version=args.version,
                                                      cuda_stage=args.stage if args.stage is not None else
                                                      zc.default_stage(D)),
        kv_data=(f"real: tiled from {args.real_kv} (16-row groups of paired head_dim-64 streams of the bundled "
                 f"models, bf16 compute; see module doc); random q" if args.real_kv else
                 "synthetic, exponent statistics of the bundled real models (DESIGN.md): Gaussian, log-normal "
                 f"key channel scales, exact zeros in {args.k_zero_frac:.0%} of K and {args.v_zero_frac:.0%} of V "
                 "blocks; random q; no model weights involved"),
        kv_models=kv_models,
        timing="triton.testing.do_bench median, L2 cleared between calls, same process for all kernels; "
               f"rounds: {args.rounds} rounds of FlashInfer then each CUDA kernel, do_bench each, ratio per round" + (
            "; *_clean_flush: median of CUDA-event timings with L2 emptied by a read-only 512 MB sweep before "
            "each call (no dirty lines left; bench_clean_flush)" if args.clean_flush else ""),
        wall_s=time.time() - t_start, results=results,
    )
    report.write(args.out, meta, draw, argv)
    for r in results:
        if "rounds" in r:
            cz = r.get("cuda_zip", {})
            print(f"{r['context']:5d} {r['batch']:3d}  rounds median: FI {r['flashinfer_us_rounds_median']:7.1f}us  "
                  f"cuda zip {cz.get('us_rounds_median', 0):7.1f}us  x{cz.get('speedup_vs_flashinfer_rounds_median', 0):.3f}")
    print("\nctx   B    FlashInfer  cuda-raw  cuda-zip  cz/FI  ceiling  triton-raw  triton-zip  tz/FI  decomp+FI")
    for r in results:
        g = lambda k, f="us": r.get(k, {}).get(f, 0)  # noqa: E731
        print(f"{r['context']:5d} {r['batch']:3d}  {r['flashinfer_us']:9.1f}  {g('cuda_raw'):8.1f}  {g('cuda_zip'):8.1f}"
              f"  {g('cuda_zip', 'speedup_vs_flashinfer'):5.3f}  {r['cuda_ceiling_speedup']:7.3f}  {g('raw'):10.1f}"
              f"  {g('zip'):10.1f}  {g('zip', 'speedup_vs_flashinfer'):5.3f}  {r['decompress_then_flashinfer_us']:9.1f}")


if __name__ == "__main__":
    main()
