"""Device-wise CacheFlow (CacheFlow §3.1, appendix A.2; issue 6): mean TTFT on an S-shard pipeline of
device-wise CacheFlow (per-shard DP plans, cached boundary activations, shards restore at once) against
single-device CacheFlow (one staircase over all layers, downstream shards wait for upstream activations) and
the baselines recompute-only, load-only and Cake, all on the same pipeline layout, engine, executor and stores.

Workload: the Mooncake conversation trace (bench/restore_trace.py builds it; its scaling is stated in the
result), requests replayed one after another in trace order (batch 1, no queueing: TTFT = restoration + first
token); each request's chunks are written when it finishes, so later turns reuse earlier ones. Every method
starts from the same store snapshot (the prefixes reused from before the replay window). Methods run request by
request in a rotating order, after one untimed warm-up restoration of the request (``_warm_up``): the first run
of a new shape in a process pays one-off costs, and with a fixed order device-wise always paid them (its S=1
TTFT was 1.7x the single-device plan's, with the same plan and the same code path). Per-shard records carry a
timeline on one clock (``--device cuda`` prints the mean per shard: did the shards restore at once?).

GPU: ``--device cuda`` (default model random:llama3-8b = Llama-3.1-8B shape, RANDOM weights), S = 1, 2, 4 GPUs
(one process each, NCCL, NCCL_NVLS_ENABLE=0), 10 Gbps emulated link per GPU (a token bucket on each shard's load
path). An S with fewer GPUs than shards is skipped with a message.
CPU: ``--device cpu`` (default; the bundled SmolLM2-135M, real weights, S = 2 processes over gloo, 1 thread
each); the link is set at the balance point B* where loading a shard's prefix takes as long as replaying it
(measured), since 10 Gbps would make loading free next to CPU compute.

    python bench/restore_devicewise.py                      # CPU, S=2 (~5 min on a 2-core machine)
    python bench/restore_devicewise.py --device cuda        # S = 1, 2, 4 where that many GPUs are present
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from restore_trace import (block_content, build_workload, load_trace, prefixes_to_preload,  # noqa: E402
                           text_tokens)

from bench import report  # noqa: E402
from kvtide.parallel.pipeline import PipelineConfig, PipelineEngine, launch  # noqa: E402
from kvtide.restore.devicewise import shard_ranges  # noqa: E402

# (key, planner method, device-wise, label)
METHODS = [
    ("cacheflow_dw", "cacheflow", True, "CacheFlow device-wise"),
    ("cacheflow_seq", "cacheflow", False, "CacheFlow single-device plan"),
    ("recompute", "recompute", False, "recompute-only"),
    ("load", "load", False, "load-only"),
    ("cake", "cake", False, "Cake (token-wise)"),
]
PAPER = "CacheFlow Fig. 11 (H100, Llama-3.1-8B, 10 Gbps/GPU): mean TTFT 1.59 s (1 GPU) -> 0.96 s (2) -> 0.67 s (4)"


# ---- run inside the shard processes (module-level: pickled by reference) -------------------------------------


def _fork(eng: PipelineEngine, keys: list[str], gigabits: float) -> None:
    """One copy of the pre-loaded store per method (each then evolves with its own replay), one link."""
    eng._bench_tiers = {k: eng.tier.copy() for k in keys}  # type: ignore[attr-defined]
    eng.set_link(gigabits)


def _use(eng: PipelineEngine, key: str) -> None:
    eng.use_tier(eng._bench_tiers[key])  # type: ignore[attr-defined]


def driver(eng: PipelineEngine, a: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 of one layout: warm the profile, fill the store, replay the trace once per method."""
    text = text_tokens(eng.tokenizer, eng.args.vocab_size, 200_000)
    content = block_content(text[:150_000], a["block_tokens"], eng.args.vocab_size)
    reqs = build_workload(load_trace(), a["trace_start"], a["requests"], a["block_tokens"], a["max_input"], 1,
                          a["min_reuse_blocks"], content)
    for n in a["warm_lengths"]:  # F(t) from ordinary prefills, as a serving engine learns it
        for i in range(2):
            eng.generate([text[5000 + i * 1000:5000 + i * 1000 + n]], 1, restore=False, save=False)
    isolated = _isolated(eng, text, a) if a["isolated_tokens"] else None
    for p in prefixes_to_preload(reqs, a["block_tokens"]):
        eng.generate([p], 1, restore=False, save=True)

    g = a["gbps"]
    if g is None:  # CPU: the balance point of one shard (load its prefix = replay it), per shard link
        n = int(statistics.median(len(q.tokens) for q in reqs))
        g = eng.bytes_per_token * n / float(eng.profile(n)) * 8 / 1e9
    out: dict[str, Any] = {"gbps_per_shard": g, "requests": len(reqs),
                           "mean_input_tokens": statistics.mean(len(q.tokens) for q in reqs),
                           "mean_reused_tokens": statistics.mean(min(q.reused_blocks * a["block_tokens"],
                                                                     len(q.tokens)) for q in reqs),
                           "profile_knots": [x.tolist() for x in eng.profile.knots()], "isolated": isolated,
                           "methods": {}}
    methods = [m for m in METHODS if m[0] in a["methods"]]
    eng.call(_fork, [k for k, *_ in methods], g)
    res = {k: {"ttft_s": [], "cached_tokens": [], "shards": []} for k, *_ in methods}
    warm: dict[str, list] = {"ttft_s": [], "cached_tokens": []}
    # Methods interleaved request by request (a shared machine's load then hits every method alike), in an order
    # that rotates from request to request, after an untimed warm-up of the request (see _warm_up): whichever
    # method ran a new shape first used to pay for it (CUDA memory, kernels), and that was always device-wise.
    for i, q in enumerate(reqs):
        if a["warm_up"]:
            eng.call(_use, methods[0][0])
            o = _warm_up(eng, q.tokens)
            warm["ttft_s"].append(o.ttft)
            warm["cached_tokens"].append(o.cached_tokens)
        for key, method, dw, _ in _rotated(methods, i):
            eng.call(_use, key)
            o = eng.generate([q.tokens], 1, method=method, devicewise=dw, save=True)[0]
            m = res[key]
            m["ttft_s"].append(o.ttft)
            m["cached_tokens"].append(o.cached_tokens)
            if eng.last_records:
                m["shards"].append(_shard_records(eng))
    out["warm_up"] = warm
    for key, m in res.items():
        out["methods"][key] = {**m, "mean_s": statistics.mean(m["ttft_s"]), "p50_s": statistics.median(m["ttft_s"]),
                               "restorations": len(m["shards"])}
    return out


def _isolated(eng: PipelineEngine, text: list[int], a: dict[str, Any]) -> dict[str, Any]:
    """One long cached prefix + a short suffix, every method ``reps`` times (median): the restoration itself,
    the case appendix A.2 analyses, without the trace's long uncached suffixes. Same link as the trace."""
    n, ns = a["isolated_tokens"], a["isolated_suffix"]
    prefix = text[160_000:160_000 + n]  # past the text the trace's blocks are cut from
    eng.generate([prefix], 1, restore=False, save=True)
    g = a["gbps"]
    if g is None:
        g = eng.bytes_per_token * n / float(eng.profile(n)) * 8 / 1e9
    eng.call(set_link, g)
    prompt = prefix + text[170_000:170_000 + ns]
    eng.generate([prompt], 1, method="load", save=False)  # the link's rate is learned online, as it would be
    out: dict[str, Any] = {"cached_tokens": n, "suffix_tokens": ns, "gbps_per_shard": g, "methods": {}}
    methods = [m for m in METHODS if m[0] in a["methods"]]
    if a["warm_up"]:
        out["warm_up_ttft_s"] = _warm_up(eng, prompt).ttft
    for rep in range(a["reps"]):
        for key, method, dw, _ in _rotated(methods, rep):
            o = eng.generate([prompt], 1, method=method, devicewise=dw, save=False)[0]
            m = out["methods"].setdefault(key, {"ttft_s": [], "shards": []})
            m["ttft_s"].append(o.ttft)
            m["shards"].append(_shard_records(eng))
    for m in out["methods"].values():
        m["median_s"] = statistics.median(m["ttft_s"])
    return out


def set_link(eng: PipelineEngine, gigabits: float | None) -> None:
    eng.set_link(gigabits)


SHARD_FIELDS = ("boundaries", "total_seconds", "predicted_seconds", "predicted_boundary_seconds",
                "planning_seconds", "recompute_seconds", "suffix_seconds", "load_seconds", "load_wait_seconds",
                "overhead_seconds", "upstream_wait_seconds", "boundary_seconds", "boundary_bytes", "load_bytes",
                "boundary_fallbacks", "upstream_rows", "poisoned")


def _shard_records(eng: PipelineEngine) -> list[dict[str, Any]]:
    """Each shard's record, with its timeline moved onto rank 0's clock origin (its ``generate`` start): the
    stamps of all shards are one host clock (CLOCK_MONOTONIC), so they show what ran at the same time."""
    base = eng.last_records[0].t0
    out = []
    for r in eng.last_records:
        d = {k: r.__dict__[k] for k in SHARD_FIELDS}
        d["timeline"] = {k: round(r.t0 + v - base, 6) for k, v in r.timeline.items()}
        out.append(d)
    return out


def _rotated(methods: list, i: int) -> list:
    """The methods starting from the i-th (mod their number): each goes first equally often."""
    k = i % len(methods)
    return methods[k:] + methods[:k]


def set_observe(eng: PipelineEngine, on: bool) -> None:
    eng.set_observe(on)


def _warm_up(eng: PipelineEngine, prompt: list[int]):  # noqa: ANN202 - a GenerateOutput
    """One untimed restoration of ``prompt`` before the timed ones (recompute-only, single-device layout, no
    store writes, nothing fed to the latency profiles): it runs the shapes every method of this request meets
    for the first time (its cached prefix and its suffix through every layer). The first run of a new shape in a
    process pays one-off costs (on CUDA: growing the caching allocator for the suffix's attention, first kernel
    launches); a serving engine pays them once, not per request and method."""
    eng.call(set_observe, False)
    try:
        return eng.generate([prompt], 1, method="recompute", devicewise=False, save=False)[0]
    finally:
        eng.call(set_observe, True)


# ---- the parent ----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--model", default=None, help="default: smollm2-135m (cpu), random:llama3-8b (cuda)")
    ap.add_argument("--shards", type=int, nargs="*", help="layouts to run; default 2 (cpu), 1 2 4 (cuda)")
    ap.add_argument("--gbps", type=float, default=None, help="link per shard; default 10 (cuda), balance point (cpu)")
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--block-tokens", type=int, default=None, help="tokens per 512-token trace block (scale)")
    ap.add_argument("--max-input", type=int, default=None)
    ap.add_argument("--trace-start", type=int, default=2000)
    ap.add_argument("--min-reuse-blocks", type=int, default=2)
    ap.add_argument("--store-gb", type=float, default=None, help="KV store of all shards together (split by S)")
    ap.add_argument("--isolated-tokens", type=int, default=None, help="cached prefix of the isolated case (0: skip)")
    ap.add_argument("--isolated-suffix", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the isolated case")
    ap.add_argument("--methods", nargs="*", default=[k for k, *_ in METHODS], choices=[k for k, *_ in METHODS],
                    help="methods to run (cacheflow_seq is the reference of the printed ratios: keep it)")
    ap.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                    help="no untimed warm-up run per request (the order still rotates)")
    ap.add_argument("--mask-suffix", action="store_true",
                    help="CUDA: suffix rows after a prefix attend through a boolean mask (SDPA's math kernel), as "
                         "before FlashAttention's bottom-right causal path was used")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    a = ap.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    gpu = a.device == "cuda"
    d = {"model": ("smollm2-135m", "random:llama3-8b"), "shards": ([2], [1, 2, 4]), "gbps": (None, 10.0),
         "chunk": (32, 512), "requests": (24, 24), "block_tokens": (16, 512), "max_input": (512, 16384),
         "store_gb": (4.0, 96.0), "isolated_tokens": (480, 16384), "isolated_suffix": (16, 64)}
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v[int(gpu)])
    have = torch.cuda.device_count() if gpu else None
    runnable = [s for s in a.shards if not gpu or s <= have]
    skipped = [s for s in a.shards if s not in runnable]
    for s in skipped:
        print(f"skip S={s}: needs {s} GPUs, {have} visible (run on a machine with {s} or more GPUs)")
    if not runnable:
        print("nothing to run: no requested layout fits the GPUs present; no result written")
        return 0

    warm = [1024, 4096, 8192] if gpu else [64, 128, 256]
    drv = {"block_tokens": a.block_tokens, "max_input": a.max_input, "requests": a.requests,
           "trace_start": a.trace_start, "min_reuse_blocks": a.min_reuse_blocks, "gbps": a.gbps, "warm_lengths": warm,
           "isolated_tokens": a.isolated_tokens, "isolated_suffix": a.isolated_suffix, "reps": a.reps,
           "methods": list(a.methods), "warm_up": a.warm_up}
    t_start = time.perf_counter()
    runs: dict[str, Any] = {}
    for S in runnable:
        cfg = PipelineConfig(model=a.model, num_shards=S, device=a.device, chunk_tokens=a.chunk,
                             max_model_len=max(a.max_input, a.isolated_tokens + a.isolated_suffix) + 2 * a.chunk,
                             max_batch=1,
                             memory_bytes=int(a.store_gb * 2**30 / S), method="cacheflow", timeout_s=1800,
                             flash_suffix=not a.mask_suffix)
        print(f"S={S}: {a.model} on {S} {'GPU' if gpu else 'CPU process'}(es), layers "
              f"{[(r.start, r.stop) for r in shard_ranges(_num_layers(a.model), S)]} ...", flush=True)
        t = time.perf_counter()
        runs[str(S)] = launch(cfg, driver, drv)
        runs[str(S)]["wall_seconds"] = time.perf_counter() - t
        _print(S, runs[str(S)])
        _write(a, runs, skipped, have, gpu, t_start)  # after each layout: a run cut short keeps what it has
    return 0


def _write(a: argparse.Namespace, runs: dict[str, Any], skipped: list[int], have: int | None, gpu: bool,
           t_start: float) -> None:
    from kvtide.parallel.shard_model import model_args

    args = model_args(a.model)
    random_w = a.model.startswith("random:")
    meta = {"when": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(),
            "cpu_threads_per_shard": 1 if not gpu else None, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if gpu else None, "model": a.model, "random_weights": random_w,
            "shape": {"layers": args.num_layers, "hidden": args.hidden_size, "kv_heads": args.num_kv_heads,
                      "head_dim": args.head_dim},
            "compute_dtype": "float32" if not gpu else "bfloat16", "kv_dtype": "bfloat16",
            "boundary_dtype": "compute dtype (bit-exact replay)", "chunk_tokens": a.chunk,
            "suffix_attention": "boolean mask (SDPA picks its math kernel on CUDA)" if a.mask_suffix or not gpu else
                                "FlashAttention, bottom-right causal (torch.nn.attention.bias.causal_lower_right)",
            "link": "token bucket per shard on its store's load path (writes not throttled)",
            "gbps_per_shard": {S: r["gbps_per_shard"] for S, r in runs.items()},
            "store": "per-shard in-process memory tier (checksummed records), split of --store-gb",
            "layout": "pipeline: S contiguous layer shards, one process each "
                      f"({'NCCL' if gpu else 'gloo'}), activations passed shard to shard",
            "methods": {k: lab for k, _, _, lab in METHODS if k in a.methods},
            "method_order": "interleaved request by request, starting one method later each request (rotation); "
                            + ("before each request an untimed warm-up restoration (recompute-only, single-device "
                               "layout, no store writes, latency profiles frozen) runs its new shapes once"
                               if a.warm_up else "no warm-up run"),
            "single_device_plan": "one staircase over all L layers at S x the per-shard link rate, planned on "
                                  "rank 0; downstream shards replay from upstream's rows (no boundary activations)",
            "trace_scaling": f"Mooncake conversation trace from index {a.trace_start}, requests reusing >= "
                             f"{a.min_reuse_blocks} leading blocks; each 512-token block -> {a.block_tokens} tokens "
                             f"(fixed content per block id), inputs capped at {a.max_input}; replayed in order, one "
                             "request at a time (no queueing), 1 output token; prefixes reused from before the "
                             "window pre-loaded; every method starts from the same store snapshot",
            "skipped_shards": {str(s): f"needs {s} GPUs, {have} visible" for s in skipped},
            "paper": PAPER, "args": vars(a), "wall_seconds": time.perf_counter() - t_start,
            "load_average_at_end": list(os.getloadavg()),
            "note": "CPU: both shard processes share a 2-core machine with other users' jobs; device-wise "
                    "restoration runs both shards' replay (and their I/O threads' checksumming) at once, so it "
                    "competes for the same cores, unlike S GPUs" if not gpu else ""}
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = f"{a.model.replace(':', '_')}_{a.device}"
    jpath = out_dir / f"restore_devicewise_{tag}.json"
    report.write(jpath, {"meta": meta, "runs": runs}, draw, a.argv)
    print(f"wrote {jpath} ({meta['wall_seconds']:.0f}s)")


def _num_layers(model: str) -> int:
    from kvtide.parallel.shard_model import model_args

    return model_args(model).num_layers


def _ran(methods: dict[str, Any]) -> list[tuple[str, str]]:
    return [(k, lab) for k, _, _, lab in METHODS if k in methods]


def _print(S: int, run: dict[str, Any]) -> None:
    iso = run.get("isolated")
    if iso:
        ms = iso["methods"]
        base = ms["cacheflow_seq"]["median_s"] if "cacheflow_seq" in ms else None
        print(f"  S={S} isolated: {iso['cached_tokens']} cached + {iso['suffix_tokens']} new tokens, link "
              f"{iso['gbps_per_shard'] * 1e3:.1f} Mbps per shard, median of {len(next(iter(ms.values()))['ttft_s'])}")
        for key, label in _ran(ms):
            m = ms[key]
            ratio = f"  ({base / m['median_s']:.2f}x vs single-device plan)" if base else ""
            print(f"    {label:32s} TTFT {m['median_s'] * 1e3:8.1f} ms{ratio}")
        _print_timeline(ms)
    ms = run["methods"]
    base = ms["cacheflow_seq"]["mean_s"] if "cacheflow_seq" in ms else None
    print(f"  S={S}: {run['requests']} requests, mean input {run['mean_input_tokens']:.0f} tokens "
          f"(reused {run['mean_reused_tokens']:.0f}), link {run['gbps_per_shard'] * 1e3:.1f} Mbps per shard")
    warm = run.get("warm_up", {}).get("ttft_s")
    if warm:
        print(f"    (untimed warm-up runs, recompute-only: mean {statistics.mean(warm) * 1e3:.1f} ms)")
    for key, label in _ran(ms):
        m = ms[key]
        fb = sum(r["boundary_fallbacks"] for rs in m["shards"] for r in rs)
        ratio = f"{base / m['mean_s']:.2f}x vs single-device plan; " if base else ""
        print(f"    {label:32s} mean TTFT {m['mean_s'] * 1e3:8.1f} ms  p50 {m['p50_s'] * 1e3:8.1f} ms  "
              f"({ratio}{m['restorations']} restored, {fb} fallbacks)")
    _print_timeline(ms)


def _print_timeline(ms: dict[str, Any]) -> None:
    """Mean per shard (rank 0's clock, ms): boundary rows on the device, executor start and end, TTFT."""
    for key in ("cacheflow_dw", "cacheflow_seq"):
        runs = ms.get(key, {}).get("shards", [])
        if not runs or len(runs[0]) < 2:
            continue
        parts = []
        for s in range(len(runs[0])):
            tl = [rs[s]["timeline"] for rs in runs]
            mean = {k: statistics.mean(t[k] for t in tl) * 1e3 for k in ("boundary", "exec", "exec_end")}
            parts.append(f"shard {s}: boundary {mean['boundary']:.0f}, exec {mean['exec']:.0f}-{mean['exec_end']:.0f}")
        print(f"    timeline {key} (mean ms from generate start): " + "; ".join(parts))


def draw(doc: dict, plt):
    """Headline figure: mean TTFT of the trace replay (and the isolated case's median) per layout and method."""
    runs, m = doc["runs"], doc["meta"]
    title = (f"Mooncake trace, {m['model']}{' (RANDOM weights)' if m.get('random_weights') else ''}, "
             f"{m['args']['device']}; {'10 Gbps' if m.get('gpu') else 'balance-point link'} per shard")
    shards = sorted(runs, key=int)
    panels = [("trace replay: mean TTFT (s)", lambda s, k: runs[s]["methods"][k]["mean_s"])]
    if all(runs[s].get("isolated") for s in shards):
        iso = runs[shards[0]]["isolated"]
        panels.append((f"isolated: {iso['cached_tokens']} cached + {iso['suffix_tokens']} new, median TTFT (s)",
                       lambda s, k: runs[s]["isolated"]["methods"][k]["median_s"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(len(panels) * (1.8 + 2.2 * len(shards)), 4), squeeze=False)
    ran = _ran(runs[shards[0]]["methods"])
    w = 0.8 / len(ran)
    for ax, (name, val) in zip(axes[0], panels):
        for i, (key, label) in enumerate(ran):
            xs = [j + (i - (len(ran) - 1) / 2) * w for j in range(len(shards))]
            ys = [val(s, key) for s in shards]
            bars = ax.bar(xs, ys, w, label=label)
            for b, y in zip(bars, ys):
                ax.text(b.get_x() + b.get_width() / 2, y, f"{y:.2f}", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(shards)), [f"S={s}" for s in shards])
        ax.set_title(name, fontsize=8)
        ax.legend(fontsize=6)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    sys.exit(main())
