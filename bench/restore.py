"""CacheFlow restoration benchmark: isolated restorations (gain vs the overlap bound, predicted vs actual) and a
Mooncake trace replay (TTFT of CacheFlow vs recompute-only, load-only, Cake, layer-wise), all methods on the
same engine, executor and store; only the plan differs.

CPU (default): a bundled real model; bandwidths are picked around the balance point B* where loading a prefix
takes as long as recomputing it (measured first), since that is where the trade-off is real on this machine.
GPU: ``--device cuda --model random:llama3-8b`` (Llama-3.1-8B shape, RANDOM weights) at 10/40/80 Gbps and
batches 1/4/8. The link is a token bucket on the store's load path (kvtide.store.bandwidth).

    python bench/restore.py                 # --quick, ~8 min on a 2-core CPU
    python bench/restore.py --full          # more lengths, bandwidths, requests
    python bench/restore.py --device cuda --model random:llama3-8b --full
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvtide import CacheConfig, SamplingParams, SchedulerConfig  # noqa: E402
from kvtide.config import RestoreConfig  # noqa: E402
from kvtide.engine.llm import LLM  # noqa: E402
from kvtide.restore.methods import LABELS  # noqa: E402
from kvtide.store.bandwidth import BandwidthLimitedStore  # noqa: E402
from kvtide.store.memory import MemoryStore  # noqa: E402
from restore_trace import block_content, build_workload, load_trace, prefixes_to_preload, replay  # noqa: E402

ORDER = ["cacheflow", "recompute", "load", "cake", "layerwise"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def text_tokens(llm: LLM, n: int) -> list[int]:
    """Real text (Python's own pydoc topics) where there is a tokenizer; random ids for random-weight models."""
    try:
        from pydoc_data.topics import topics

        ids = llm.tokenizer.encode(" ".join(topics[k] for k in sorted(topics)))
        if len(ids) >= n:
            return ids[:n]
    except Exception:  # noqa: BLE001 - NullTokenizer (random weights) has no encode
        pass
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, llm.engine.model.args.vocab_size, (n,), generator=g).tolist()


class Bench:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.llm = LLM(a.model, device=a.device, progress=False,
                       cache=CacheConfig(kv_dtype="bfloat16", enable_prefix_caching=False,
                                         **({"num_pages": a.num_pages} if a.num_pages else {})),
                       scheduler=SchedulerConfig(max_num_batched_tokens=a.max_batched_tokens),
                       restore=RestoreConfig(store="memory", memory_bytes=a.store_gb << 30, chunk_tokens=a.chunk,
                                             max_batch=max(8, max(a.batches))))
        self.eng = self.llm.engine
        self.r = self.eng.restorer
        self.inner = self.r.store
        self.text = text_tokens(self.llm, 200_000 if a.device == "cpu" else 400_000)

    # ---- plumbing -----------------------------------------------------------------------------------------
    def set_link(self, g: float | None) -> None:
        """Emulated link of ``g`` Gbps (None: unthrottled memory tier); the bandwidth estimate starts over."""
        link = self.inner if g is None else BandwidthLimitedStore.at_gbps(self.inner, g)
        self.r.use_store(link, writes=self.inner)  # reads cross the link; finished chunks are written past it
        self.r.cfg.bandwidth_gbps = g
        self.r.profile.reset_bandwidth()

    def fresh_store(self, snapshot: MemoryStore | None = None) -> None:
        self.r.writer.flush()
        self.inner = snapshot.copy() if snapshot is not None else MemoryStore(self.a.store_gb << 30)
        self.r.use_store(self.inner)

    def populate(self, prompts: list[list[int]]) -> None:
        """Prefill each prompt once (untimed): its full chunks go to the store at finish."""
        for p in prompts:
            self.llm.generate(p, greedy(1))
        self.r.writer.flush()

    def restore(self, prompts: list[list[int]], method: str):
        """Restore a batch of prompts together; returns (TTFTs, the executor's record)."""
        self.r.cfg.method = method
        n0 = len(self.r.history)
        outs = self.llm.generate(prompts, greedy(1))
        recs = list(self.r.history)[n0:]
        assert recs and all(o.num_cached_tokens > 0 for o in outs), "restoration did not happen"
        return [o.ttft for o in outs], recs[0]

    def warm_profile(self, lengths: list[int]) -> None:
        """F(t) from ordinary prefills (what a serving engine runs anyway)."""
        for n in lengths:
            for _ in range(2):
                self.llm.generate(self.text[5000:5000 + n], greedy(1))
        out = self.llm.generate(self.text[9000:9000 + lengths[0]], greedy(5))[0]
        self.decode_step = (out.latency - out.ttft) / 4  # seconds per decode step at batch 1

    # ---- 1. isolated restorations ---------------------------------------------------------------------------
    def balance(self, n: int) -> dict:
        """T_recompute and T_load (unthrottled) of an n-token prefix; B* = stored bytes / T_recompute."""
        prefix = self.text[:n]
        self.fresh_store()
        self.set_link(None)
        self.populate([prefix])
        prompt = prefix + self.text[100_000:100_000 + self.a.suffix]
        t_rec = statistics.median(self.restore([prompt], "recompute")[1].total_seconds for _ in range(2))
        rec = self.restore([prompt], "load")[1]
        nbytes = n * self.r.num_layers * self.r.bytes_per_token
        b_star = nbytes / t_rec
        return {"tokens": n, "t_recompute_s": t_rec, "t_load_unthrottled_s": rec.total_seconds,
                "bytes": nbytes, "balance_bytes_per_s": b_star, "balance_gbps": b_star * 8 / 1e9,
                "recompute_ms_per_token": 1e3 * t_rec / n, "load_ms_per_token_unthrottled": 1e3 * rec.total_seconds / n}

    def isolated(self, lengths: list[int], bandwidths: list[float], batches: list[int], reps: int, bar) -> list[dict]:
        rows = []
        for n in lengths:
            prefixes = [self.text[i * 3000:i * 3000 + n] for i in range(max(batches))]
            self.fresh_store()
            self.populate(prefixes)
            for g in bandwidths:
                self.set_link(g)
                for b in batches:
                    prompts = [p + self.text[100_000 + 50 * i:100_000 + 50 * i + self.a.suffix]
                               for i, p in enumerate(prefixes[:b])]
                    self.restore(prompts, "load")  # the link's real rate is learned online, as it would be
                    for m in ORDER:
                        for rep in range(reps):
                            ttfts, rec = self.restore(prompts, m)
                            rows.append({"tokens": n, "gbps": g, "batch": b, "method": m, "rep": rep,
                                         "ttft_mean_s": statistics.mean(ttfts), "restore_s": rec.total_seconds,
                                         "predicted_s": rec.predicted_seconds,
                                         "predicted_compute_s": rec.predicted_compute_seconds,
                                         "predicted_load_s": rec.predicted_load_seconds,
                                         "recompute_s": rec.recompute_seconds, "load_s": rec.load_seconds,
                                         "wait_s": rec.wait_seconds, "suffix_s": rec.suffix_seconds,
                                         "planning_s": rec.planning_seconds, "boundaries": rec.boundaries,
                                         "bandwidth_assumed": rec.bandwidth})
                            bar()
        return rows

    # ---- 2. trace replay ------------------------------------------------------------------------------------
    def trace(self, bandwidths: list[float], bar) -> dict:
        a = self.a
        rows = load_trace()
        content = block_content(self.text[:150_000], a.block_tokens, self.eng.model.args.vocab_size)
        reqs = build_workload(rows, a.trace_start, a.requests, a.block_tokens, a.max_input, a.max_output,
                              a.min_reuse_blocks, content)
        self.fresh_store()
        self.set_link(None)
        self.populate(prefixes_to_preload(reqs, a.block_tokens))
        snapshot = self.inner.copy()
        # Offered load: a fraction of the recompute-only service rate (service time from the learned profile).
        L, F = self.r.num_layers, self.r.profile
        dec = self.decode_step
        service = statistics.mean(L * F(len(q.tokens)) + q.output * dec for q in reqs)
        span = max(reqs[-1].arrival - reqs[0].arrival, 1e-3)
        stretch = service * (len(reqs) - 1) / span / a.load
        out = {"requests": len(reqs), "stretch": stretch, "service_estimate_s": service, "offered_load": a.load,
               "mean_input_tokens": statistics.mean(len(q.tokens) for q in reqs),
               "mean_reused_tokens": statistics.mean(min(q.reused_blocks * a.block_tokens, len(q.tokens))
                                                     for q in reqs),
               "runs": []}
        for g in bandwidths:
            for m in ORDER:
                self.fresh_store(snapshot)
                self.set_link(g)
                self.r.cfg.method = m
                n0 = len(self.r.history)
                ttft = replay(self.eng, reqs, stretch, lambda q: greedy(q.output), on_first=bar)
                recs = list(self.r.history)[n0:]
                v = sorted(ttft.values())
                out["runs"].append({
                    "gbps": g, "method": m, "ttft_s": v, "mean_s": statistics.mean(v), "p95_s": _pct(v, 95),
                    "p99_s": _pct(v, 99), "restorations": len(recs),
                    "restored_requests": sum(len(x.cached) for x in recs),
                    "mean_batch": statistics.mean(len(x.cached) for x in recs) if recs else 0,
                    "planning_s_median": statistics.median(x.planning_seconds for x in recs) if recs else 0,
                    "fallbacks": self.r.stats.fallbacks})
        return out


def _loadavg() -> list[float] | None:
    try:
        import os

        return list(os.getloadavg())
    except OSError:
        return None


def _pct(v: list[float], p: float) -> float:
    if not v:
        return float("nan")
    k = min(len(v) - 1, max(0, round(p / 100 * (len(v) - 1))))
    return sorted(v)[k]


def summarize_isolated(rows: list[dict]) -> list[dict]:
    """Per (tokens, gbps, batch): ideal gain bound 1 + min/max of (recompute-only, load-only) vs CacheFlow's."""
    out = []
    keys = sorted({(r["tokens"], r["gbps"], r["batch"]) for r in rows})
    for k in keys:
        sel = [r for r in rows if (r["tokens"], r["gbps"], r["batch"]) == k]

        def t(m: str, sel: list[dict] = sel) -> float:
            return statistics.median(r["restore_s"] for r in sel if r["method"] == m)

        tr, tl = t("recompute"), t("load")
        ideal = 1 / (1 / tr + 1 / tl)
        best_single = min(tr, tl)
        cf = [r for r in sel if r["method"] == "cacheflow"]
        errs = [abs(r["restore_s"] - r["predicted_s"]) / r["predicted_s"] for r in cf]
        out.append({"tokens": k[0], "gbps": k[1], "batch": k[2], "t_recompute_s": tr, "t_load_s": tl,
                    "t_ideal_s": ideal, "ideal_gain": best_single / ideal,
                    "gains": {m: best_single / t(m) for m in ORDER},
                    "cacheflow_fraction_of_ideal_gain": (best_single / t("cacheflow")) / (best_single / ideal),
                    "cacheflow_pred_error_median": statistics.median(errs),
                    "cacheflow_within_10pct": sum(e <= 0.10 for e in errs) / len(errs),
                    "cacheflow_boundaries_distinct": sorted({j for r in cf for row in r["boundaries"] for j in row}),
                    "planning_fraction_of_ttft": statistics.median(r["planning_s"] / r["ttft_mean_s"] for r in cf)})
    return out


def plot(trace: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gs = sorted({r["gbps"] for r in trace["runs"]})
    fig, axes = plt.subplots(1, len(gs), figsize=(5.5 * len(gs), 4), squeeze=False)
    for ax, g in zip(axes[0], gs):
        for r in [x for x in trace["runs"] if x["gbps"] == g]:
            v = r["ttft_s"]
            ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post",
                    label=f"{LABELS[r['method']]} (mean {r['mean_s']:.2f}s)")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("CDF")
        ax.set_title(f"{g:g} Gbps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2-135m")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the default: a small run (~8 min on a 2-core CPU)")
    mode.add_argument("--full", action="store_true")
    ap.add_argument("--lengths", type=int, nargs="*", help="isolated prefix lengths (tokens)")
    ap.add_argument("--bandwidths", type=float, nargs="*", help="Gbps; default CPU: around the balance point")
    ap.add_argument("--batches", type=int, nargs="*", help="isolated batch sizes")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--suffix", type=int, default=16, help="new tokens after the restored prefix (isolated)")
    ap.add_argument("--requests", type=int, default=None, help="trace requests per method")
    ap.add_argument("--trace-start", type=int, default=2000, help="trace index where the replay window starts")
    ap.add_argument("--block-tokens", type=int, default=None, help="tokens per 512-token trace block (scale)")
    ap.add_argument("--max-input", type=int, default=None)
    ap.add_argument("--max-output", type=int, default=None)
    ap.add_argument("--min-reuse-blocks", type=int, default=2, help="keep requests reusing >= this many blocks")
    ap.add_argument("--load", type=float, default=0.9, help="offered load / recompute-only service rate")
    ap.add_argument("--store-gb", type=int, default=None)
    ap.add_argument("--num-pages", type=int, default=None)
    ap.add_argument("--max-batched-tokens", type=int, default=None)
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch compute threads (CPU default 1: on a shared 2-core machine a second OpenMP thread "
                         "stalls at every barrier when descheduled; 1 compute thread + the I/O thread is also the "
                         "'one compute resource, one link' of the model)")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    gpu = a.device.startswith("cuda")
    full = a.full
    d = {  # (cpu quick, cpu full, gpu quick, gpu full)
        "lengths": ([512], [256, 512, 1024], [8192], [4096, 16384, 32768]),
        "batches": ([1], [1, 4], [1, 4, 8], [1, 4, 8]),
        "reps": (2, 3, 3, 5),
        "chunk": (64, 64, 512, 512),
        "requests": (16, 32, 24, 64),
        "block_tokens": (8, 16, 512, 512),
        "max_input": (384, 1024, 16384, 32768),
        "max_output": (4, 8, 16, 32),
        "store_gb": (4, 4, 64, 96),
        "max_batched_tokens": (4096, 4096, 32768, 32768),
    }
    idx = (2 if gpu else 0) + (1 if full else 0)
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v[idx])
    torch.manual_seed(0)
    if a.threads is None and not gpu:
        a.threads = 1
    if a.threads:
        torch.set_num_threads(a.threads)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    con = Console()
    t_start = time.perf_counter()
    b = Bench(a)
    args = b.eng.model.args
    random_w = a.model.startswith("random:")
    con.print(f"[bold]restore bench[/]: {a.model} ({'RANDOM weights' if random_w else 'real weights'}), "
              f"{args.num_layers} layers, {args.num_kv_heads} KV heads x {args.head_dim}, KV bf16, device {a.device}, "
              f"chunk {a.chunk} tokens, {b.r.bytes_per_token:.0f} stored B/token/layer")
    b.warm_profile([64, 128, 256, 512] if not gpu else [1024, 4096, 8192])
    bal = b.balance(a.lengths[0])
    con.print(f"T_recompute {bal['recompute_ms_per_token']:.2f} ms/token, unthrottled load "
              f"{bal['load_ms_per_token_unthrottled']:.2f} ms/token -> balance B* = {bal['balance_gbps'] * 1e3:.1f} Mbps")
    if a.bandwidths is None:
        if gpu:
            a.bandwidths = [10.0, 40.0, 80.0]
        else:
            bs = bal["balance_gbps"]
            a.bandwidths = [round(bs * f, 4) for f in ((0.5, 1.0, 2.0) if full else (0.5, 1.0, 2.0))]
    trace_bw = a.bandwidths if (full or gpu) else [a.bandwidths[1] if len(a.bandwidths) > 1 else a.bandwidths[0]]
    n_iso = len(a.lengths) * len(a.bandwidths) * len(a.batches) * len(ORDER) * a.reps
    n_tr = 0 if a.no_trace else len(trace_bw) * len(ORDER) * a.requests
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=con, disable=a.no_progress) as prog:
        t1 = prog.add_task("isolated restorations", total=n_iso)
        iso = b.isolated(a.lengths, a.bandwidths, a.batches, a.reps, lambda: prog.advance(t1))
        trace = None
        if not a.no_trace:
            t2 = prog.add_task("trace replay (first tokens)", total=n_tr)
            trace = b.trace(trace_bw, lambda: prog.advance(t2))
    summary = summarize_isolated(iso)
    tag = f"{a.model.replace(':', '_')}_{a.device.split(':')[0]}{'_full' if full else ''}"
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"when": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(),
            "torch_threads": torch.get_num_threads(), "load_average_at_end": _loadavg(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if gpu else None, "model": a.model, "random_weights": random_w,
            "shape": {"layers": args.num_layers, "kv_heads": args.num_kv_heads, "head_dim": args.head_dim},
            "kv_dtype": "bfloat16", "compute_dtype": str(b.eng.config.torch_dtype), "chunk_tokens": a.chunk,
            "stored_bytes_per_token_per_layer": b.r.bytes_per_token, "link": "token bucket on the store load path",
            "store": "in-process memory tier (checksummed records)", "args": vars(a),
            "trace_scaling": f"each 512-token Mooncake block -> {a.block_tokens} tokens; inputs capped at "
                             f"{a.max_input}, outputs scaled the same and capped at {a.max_output}; window from "
                             f"trace index {a.trace_start}, requests reusing >= {a.min_reuse_blocks} leading blocks; "
                             "arrival times stretched so offered load = --load x recompute-only service rate; "
                             "device prefix cache off (every reuse is a store restoration); reused-before-window "
                             "prefixes pre-loaded into the store",
            "wall_seconds": time.perf_counter() - t_start}
    res = {"meta": meta, "balance": bal, "isolated": iso, "isolated_summary": summary, "trace": trace}
    jpath = out_dir / f"restore_{tag}.json"
    jpath.write_text(json.dumps(res, indent=1))
    _print(con, summary, trace)
    if trace is not None:
        plot(trace, out_dir / f"restore_{tag}.png",
             f"Mooncake trace replay, {a.model}{' (random weights)' if random_w else ''}, {a.device}; "
             f"{trace['requests']} requests, load {a.load} of recompute-only")
    con.print(f"wrote {jpath} ({meta['wall_seconds']:.0f}s)")
    return 0


def _print(con, summary: list[dict], trace: dict | None) -> None:
    from rich.table import Table

    t = Table(title="isolated restorations: gain over the best single resource (ideal = 1 + min/max)")
    for c in ("tokens", "Gbps", "batch", "T_rec s", "T_load s", "ideal", "CacheFlow", "Cake", "layer-wise",
              "of ideal", "pred err", "<=10%"):
        t.add_column(c, justify="right")
    for s in summary:
        g = s["gains"]
        t.add_row(str(s["tokens"]), f"{s['gbps']:g}", str(s["batch"]), f"{s['t_recompute_s']:.2f}",
                  f"{s['t_load_s']:.2f}", f"{s['ideal_gain']:.2f}x", f"{g['cacheflow']:.2f}x", f"{g['cake']:.2f}x",
                  f"{g['layerwise']:.2f}x", f"{s['cacheflow_fraction_of_ideal_gain']:.0%}",
                  f"{s['cacheflow_pred_error_median']:.0%}", f"{s['cacheflow_within_10pct']:.0%}")
    con.print(t)
    if trace is None:
        return
    t = Table(title=f"trace replay: TTFT over {trace['requests']} requests (s)")
    for c in ("Gbps", "method", "mean", "p95", "p99", "restored", "mean batch"):
        t.add_column(c, justify="right")
    for r in trace["runs"]:
        t.add_row(f"{r['gbps']:g}", LABELS[r["method"]], f"{r['mean_s']:.2f}", f"{r['p95_s']:.2f}",
                  f"{r['p99_s']:.2f}", str(r["restored_requests"]), f"{r['mean_batch']:.1f}")
    con.print(t)


if __name__ == "__main__":
    sys.exit(main())
