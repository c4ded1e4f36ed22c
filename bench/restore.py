"""CacheFlow restoration benchmark: isolated restorations (gain vs the overlap bound, predicted vs actual) and a
Mooncake trace replay (TTFT of CacheFlow vs recompute-only, load-only, Cake, layer-wise), all methods on the
same engine, executor and store; only the plan differs.

CPU (default): a bundled real model; bandwidths are picked around the balance point B* where loading a prefix
takes as long as recomputing it (measured first), since that is where the trade-off is real on this machine.
The trace runs at a "10 Gbps-equivalent" link, B* / 2.56: the ratio T_load / T_recompute that a Llama-3.1-8B
shape has on an H200 at 10 Gbps (131 KiB of KV per token at 1.25 GB/s against 0.041 ms of recompute per token,
restore_random-llama3-8b_h200.json); ``--full`` also at B*.
GPU: ``--device cuda --model random:llama3-8b`` (Llama-3.1-8B shape, RANDOM weights) at 10/40/80 Gbps and
batches 1/4/8, trace replay included, inside ``--deadline-s`` (default 450 s on CUDA: runs left when it passes are
skipped and listed). The link is a token bucket on the store's load path (kvtide.store.bandwidth).

Trace load: a closed-loop run of the same requests under recompute-only (all arriving at once; the second of two,
the first pays one-off costs) measures its saturation throughput mu; the trace's arrival pattern is then stretched
so the offered rate is ``--load`` x mu (default 0.9; ``--extra-loads``, default 0.7 and 1.0: more rates, first link).
Every method replays the same arrivals from the same store snapshot, and on CUDA decodes through the same CUDA graphs
(``--no-cuda-graphs`` for eager decode steps); ``--trace-reps`` (default 3) replays every cell, reps outermost, and
the goals take medians over reps with the per-rep ratios beside them (64 requests by default).
The goals also hold the trace's service-time bound (``service_bound``): how much faster than recompute-only any
overlap of compute and link could serve the same restorations, before queueing multiplies it.

    python bench/restore.py                 # --quick; its trace (64 requests x 3 reps x 3 loads) takes hours on a 2-core CPU
    python bench/restore.py --no-trace        # the isolated grid alone, ~10 min
    python bench/restore.py --full          # more lengths, bandwidths, requests
    python bench/restore.py --device cuda --model random:llama3-8b     # the H200 run; runs past --deadline-s (450 s) are skipped and listed
    python bench/restore.py --device cuda --model random:llama3-8b --no-isolated   # the trace replay alone
    python bench/restore.py --device cuda --model random:llama3-8b --no-trace --store pinned   # the latest H200 grid

``--store pinned`` keeps the host tier's records in page-locked memory, so loads go to the GPU by DMA from the record
(``kvtide/store/pinned.py``); the default ``memory`` stages them through a pinned buffer.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import report  # noqa: E402
from kvtide import CacheConfig, SamplingParams, SchedulerConfig  # noqa: E402
from kvtide.config import RestoreConfig  # noqa: E402
from kvtide.engine.llm import LLM  # noqa: E402
from kvtide.restore.executor import LoadConfig  # noqa: E402
from kvtide.restore.methods import LABELS  # noqa: E402
from kvtide.restore.profile import LatencyProfile, ProfileConfig  # noqa: E402
from kvtide.store.bandwidth import BandwidthLimitedStore, gbps  # noqa: E402
from kvtide.store.keys import chunk_keys  # noqa: E402
from kvtide.store.memory import MemoryStore  # noqa: E402
from kvtide.store.pinned import PinnedMemoryStore  # noqa: E402
from restore_trace import (block_content, build_workload, load_trace, prefixes_to_preload, replay,  # noqa: E402
                           text_tokens)

ORDER = ["cacheflow", "recompute", "load", "cake", "layerwise"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _pinned_growth() -> dict:
    """How often, and for how long, torch's pinned host cache grew (``cudaHostAlloc``): the finished requests'
    chunks cross to host memory through it, and each growth blocks the step loop that asks for the buffer."""
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    if not torch.cuda.is_available() or stats is None:
        return {}
    s = stats()
    return {"pinned_grows": s.get("num_host_alloc", 0), "pinned_grow_s": s.get("host_alloc_time.total", 0) / 1e6}


class Bench:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.llm = LLM(a.model, device=a.device, progress=False, attention_backend=getattr(a, "attention", "auto"),
                       cuda_graphs=bool(getattr(a, "cuda_graphs", False)),
                       cache=CacheConfig(kv_dtype="bfloat16", enable_prefix_caching=False,
                                         **({"num_pages": a.num_pages} if a.num_pages else {})),
                       scheduler=SchedulerConfig(max_num_batched_tokens=a.max_batched_tokens),
                       restore=RestoreConfig(store=getattr(a, "store", "memory"), memory_bytes=a.store_gb << 30,
                                             chunk_tokens=a.chunk,
                                             max_batch=max(8, max(a.batches)),
                                             merge_load_layers=getattr(a, "merge_load_layers", 1),
                                             load_workers=getattr(a, "load_workers", None),
                                             load_read_ahead=getattr(a, "read_ahead", None),
                                             store_codec=getattr(a, "codec", None)))
        self.eng = self.llm.engine
        self.r = self.eng.restorer
        if getattr(a, "mixed_load_rate", False):  # A/B: one load-rate estimate over every load, as before
            self.r.profile = LatencyProfile(ProfileConfig(separate_overlapped_loads=False))
        self.inner = self.r.store
        self.text = text_tokens(self.llm.tokenizer, self.llm.engine.model.args.vocab_size,
                                 200_000 if a.device == "cpu" else 400_000)

    def capture_graphs(self, up_to: int) -> float:
        """Capture the decode graphs of batch sizes 1..``up_to`` before anything is timed (seconds taken), so no
        replay pays a first capture; every method then decodes through the same graphs."""
        g = self.eng.runner.graphs
        if g is None:
            return 0.0
        t0 = time.perf_counter()
        g.max_sizes = max(g.max_sizes, up_to)
        for n in range(1, up_to + 1):
            g.get(n)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def capture_layer_graphs(self) -> float:
        """Capture the restore port's layer graphs (every row bucket) before anything is timed; seconds taken."""
        lg = self.eng.runner.layer_graphs
        if lg is None:
            return 0.0
        t0 = time.perf_counter()
        lg.prepare()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    # ---- plumbing -----------------------------------------------------------------------------------------
    def set_link(self, g: float | None) -> None:
        """Emulated link of ``g`` Gbps (None: unthrottled memory tier); the bandwidth estimate starts over."""
        link = self.inner if g is None else BandwidthLimitedStore.at_gbps(self.inner, g)
        self.r.use_store(link, writes=self.inner)  # reads cross the link; finished chunks are written past it
        self.r.cfg.bandwidth_gbps = g
        self.r.profile.reset_bandwidth()

    def fresh_store(self, snapshot: MemoryStore | None = None) -> None:
        """An empty tier (``--store``), or one holding ``snapshot``'s entries."""
        self.r.writer.flush()
        cap = self.a.store_gb << 30
        if getattr(self.a, "store", "memory") == "pinned":  # page-locked slabs, allocated as the tier fills
            self.inner = PinnedMemoryStore(cap) if snapshot is None else PinnedMemoryStore.filled_from(snapshot, cap)
        else:
            self.inner = snapshot.copy() if snapshot is not None else MemoryStore(cap)
        self.r.use_store(self.inner)

    def snapshot(self) -> MemoryStore:
        """The tier's entries as a plain in-memory store (a pinned tier is not copied into more pinned memory)."""
        return MemoryStore.filled_from(self.inner, self.a.store_gb << 30)

    def populate(self, prompts: list[list[int]]) -> int:
        """Prefill each prompt once (untimed): its full chunks go to the store at finish. Each prompt's writes are
        waited for before the next: the writer's host-memory bound (RestoreConfig.write_queue_bytes, 8 GiB) would
        otherwise drop chunks of a burst of long prefixes (1 GiB per 8K tokens at the 8B shape). Returns the
        prompts' full chunks that are still missing from the store (0 unless the tier refused writes)."""
        missing = 0
        for p in prompts:
            self.llm.generate(p, greedy(1))
            self.r.writer.flush()
            keys = chunk_keys(p[: (len(p) - 1) // self.r.chunk * self.r.chunk], self.r.keyspace)
            missing += sum(not self.inner.contains(k, self.r.num_layers - 1) for k in keys)
        return missing

    def restore(self, prompts: list[list[int]], method: str):
        """Restore a batch of prompts together; returns (TTFTs, the executor's record)."""
        self.r.cfg.method = method
        n0 = len(self.r.history)
        outs = self.llm.generate(prompts, greedy(1))
        recs = list(self.r.history)[n0:]
        assert recs and all(o.num_cached_tokens > 0 for o in outs), "restoration did not happen"
        return [o.ttft for o in outs], recs[0]

    def warm_profile(self, lengths: list[int]) -> None:
        """F(t) from ordinary prefills (what a serving engine runs anyway). Three per length: the first prefill of
        a shape pays one-off costs (kernel selection, allocator growth) and F's bucket takes the median, which
        with two observations is their mean; a server outvotes that first call with later ones, this bench has
        only these until its layer calls come in (none at the long lengths where a trace's suffixes lie)."""
        o = 110_000  # distinct prompts: a shared prefix would be restored from the store, not prefilled
        runs = [n for n in lengths for _ in range(3)]
        for i, n in enumerate(runs):
            self.llm.generate(self.text[o:o + n], greedy(1))
            o += n + 1000
            if i + 1 < len(runs):
                # Each prefill is timed as restorations run, with the writer not encoding beside it (they hold
                # it): at the 8B shape a 16K-token prefill leaves 2 GiB of chunks for the writer, whose hashing
                # and copies would otherwise share the GIL with the next prefill. The last one's chunks stay
                # queued for the decode-step probe below.
                self.r.writer.flush()
        # Seconds per decode step at batch 1 (the last step includes the finish, whose chunks go to the writer),
        # first with the writer still encoding the prefills' chunks, then with it idle. On the H200 the first read
        # 4.5-6.4 s a step in earlier runs: the stack dumps below showed the step inside FlashInfer's JIT build of
        # its decode module (the first decode plan of the process), not waiting on the writer, which sat idle
        # having drained its backlog meanwhile. The backend now builds its modules when the engine is made. The
        # trail records when each token came and how far the writer had got by then.
        self.writer_backlog_bytes = self.r.writer.queued_bytes
        w0 = self.r.writer.stats.bytes
        t0 = time.perf_counter()
        trail = []  # per token: (seconds since the request was added, bytes the writer has written since)
        # Where a stalled step waits: every thread's stack, every 3 s while the probe runs (how the ~19 s stall
        # above was found: the main thread in FlashInfer's ninja build, the writer thread idle).
        stacks = Path(self.a.out_dir) / "decode_probe_stacks.txt"
        stacks.parent.mkdir(parents=True, exist_ok=True)
        with open(stacks, "w") as dump:
            faulthandler.dump_traceback_later(3.0, repeat=True, file=dump)
            try:
                for out in self.llm.stream(self.text[o:o + lengths[0]], greedy(5)):
                    trail.append((time.perf_counter() - t0, self.r.writer.stats.bytes - w0))
            finally:
                faulthandler.cancel_dump_traceback_later()
        self.probe_stacks = str(stacks) if stacks.stat().st_size else None
        if self.probe_stacks is None:
            stacks.unlink()  # no step stalled long enough to dump: leave nothing behind
        self.decode_step_writer_busy = (out.latency - out.ttft) / 4
        self.probe_trail = {"token_times_s": [x for x, _ in trail], "writer_bytes_written": [y for _, y in trail],
                            "writer_backlog_after_bytes": self.r.writer.queued_bytes}
        self.r.writer.flush()
        o += lengths[0] + 1000
        out = self.llm.generate(self.text[o:o + lengths[0]], greedy(5))[0]
        self.decode_step = (out.latency - out.ttft) / 4
        self.r.writer.flush()

    # ---- 1. isolated restorations ---------------------------------------------------------------------------
    def balance(self, n: int) -> dict:
        """T_recompute and T_load (unthrottled) of an n-token prefix; B* = stored bytes / T_recompute."""
        prefix = self.text[:n]
        self.fresh_store()
        self.set_link(None)
        self.populate([prefix])
        prompt = prefix + self.text[100_000:100_000 + self.a.suffix]
        for m in ORDER:  # untimed: a process's first restorations pay one-off costs (kernels, allocator, pinned pages)
            self.restore([prompt], m)
        t_rec = statistics.median(self.restore([prompt], "recompute")[1].total_seconds for _ in range(2))
        recs = [self.restore([prompt], "load")[1] for _ in range(2)]
        rec = min(recs, key=lambda x: x.total_seconds)
        nbytes = n * self.r.num_layers * self.r.bytes_per_token
        b_star = nbytes / t_rec
        return {"tokens": n, "t_recompute_s": t_rec, "t_load_unthrottled_s": rec.total_seconds,
                "bytes": nbytes, "balance_bytes_per_s": b_star, "balance_gbps": b_star * 8 / 1e9,
                "recompute_ms_per_token": 1e3 * t_rec / n, "load_ms_per_token_unthrottled": 1e3 * rec.total_seconds / n,
                "load_path_gbps": rec.load_bytes * 8 / 1e9 / max(rec.load_seconds, 1e-9),
                "load_path_seconds": rec.load_seconds}

    def isolated(self, lengths: list[int], bandwidths: list[float], batches: list[int], reps: int, bar) -> list[dict]:
        """Every method on the same prompts; reps interleave the methods, so a noisy spell hits all of them."""
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
                    # the link's real rate is learned online, as it would be: alone (load-only plans) and beside a
                    # replay (hybrid plans; a server's restorations are mostly hybrid), untimed
                    self.restore(prompts, "load")
                    self.restore(prompts, "cacheflow")
                    for rep in range(reps):
                        for m in ORDER:
                            ttfts, rec = self.restore(prompts, m)
                            rows.append({"tokens": n, "gbps": g, "batch": b, "method": m, "rep": rep,
                                         "ttft_mean_s": statistics.mean(ttfts), **record_row(rec)})
                            bar()
        return rows

    def busy(self, since: dict | None = None, recs: list | None = None) -> dict:
        """Where the step loop's time went (seconds): restorations, the engine's own prefill and decode steps,
        queueing finished requests' chunks for the store, waiting for writes a lookup needed. With ``since`` (an
        earlier reading) and ``recs`` (the restorations run since), the differences."""
        e, st = self.eng.stats, self.r.stats
        now = {"prefill_s": e.prefill_seconds, "decode_s": e.decode_seconds, "store_write_s": st.write_seconds,
               "store_write_wait_s": st.write_wait_seconds, **_pinned_growth()}
        if since is None:
            return now
        out = {k: v - since[k] for k, v in now.items()}
        out["restore_s"] = sum(x.total_seconds for x in recs or [])
        return out

    # ---- 2. trace replay ------------------------------------------------------------------------------------
    def trace(self, links: list[tuple[float, str]], bar, deadline: float) -> dict:
        a = self.a
        rows = load_trace()
        content = block_content(self.text[:150_000], a.block_tokens, self.eng.model.args.vocab_size)
        reqs = build_workload(rows, a.trace_start, a.requests, a.block_tokens, a.max_input, a.max_output,
                              a.min_reuse_blocks, content)
        self.fresh_store()
        self.set_link(None)
        pre = prefixes_to_preload(reqs, a.block_tokens)
        missing = self.populate(pre)
        snapshot = self.snapshot()
        span = max(reqs[-1].arrival - reqs[0].arrival, 1e-3)
        # Saturation of recompute-only: all requests at once, completions per second (first link: it is idle).
        # Run twice and take the second: the first pays one-off costs no later run pays (on the H200 its step
        # loop spent 3.5 s growing the pinned host buffers the finished requests' chunks are copied into, against
        # 0.1-0.7 s in every replay after it), and a makespan with them understates mu, so "0.9 x saturation"
        # would be well below it.
        self.set_link(links[0][0])
        self.r.cfg.method = "recompute"
        makespans, closed_busy = [], {}
        for _ in range(2):
            self.fresh_store(snapshot)
            n0, b0 = len(self.r.history), self.busy()
            t0 = time.perf_counter()
            replay(self.eng, reqs, 0.0, lambda q: greedy(q.output))
            makespans.append(time.perf_counter() - t0)
            closed_busy = self.busy(b0, list(self.r.history)[n0:])
        makespan = makespans[-1]
        mu = len(reqs) / makespan
        stretch = (len(reqs) - 1) / (span * a.load * mu)
        out = {"requests": len(reqs), "stretch": stretch, "offered_load": a.load,
               "preloaded_prefixes": len(pre), "preloaded_chunks_missing": missing,
               "recompute_saturation_req_per_s": mu, "closed_loop_makespan_s": makespan,
               "closed_loop_makespans_s": makespans, "closed_loop_busy_s": closed_busy,
               "offered_req_per_s": a.load * mu,
               "mean_input_tokens": statistics.mean(len(q.tokens) for q in reqs),
               "mean_reused_tokens": statistics.mean(min(q.reused_blocks * a.block_tokens, len(q.tokens))
                                                     for q in reqs),
               "mean_output_tokens": statistics.mean(q.output for q in reqs),
               "runs": [], "load_sweep": [], "skipped": []}
        # Reps outermost, then offered loads, links, methods: drift of the machine spreads over every cell alike.
        # The other loads (--extra-loads) run at the first link; recompute-only loads nothing, so its run at the
        # first link stands for every link.
        first = links[0][0]
        for rep in range(a.trace_reps):
            for load in [a.load] + list(a.extra_loads or []):
                main = load == a.load
                st = (len(reqs) - 1) / (span * load * mu)
                for g, label in (links if main else links[:1]):
                    for m in (a.extra_load_methods if not main else a.trace_methods if g == first
                              else a.link_methods or a.trace_methods):
                        if m == "recompute" and g != first:
                            continue
                        if time.perf_counter() > deadline:
                            out["skipped"].append({"gbps": g, "method": m, "rep": rep, "load": load, "why": "deadline"})
                            continue
                        r = self.replay_method(reqs, snapshot, g, label, m, st, bar)
                        r.update(rep=rep, offered_load=load, offered_req_per_s=load * mu, stretch=st)
                        out["runs" if main else "load_sweep"].append(r)
        return out

    def replay_method(self, reqs, snapshot, g: float, label: str, m: str, stretch: float, bar) -> dict:
        """One method's replay of the trace from the store snapshot over a ``g`` Gbps link."""
        self.fresh_store(snapshot)
        self.set_link(g)
        self.r.cfg.method = m
        n0 = len(self.r.history)
        st0 = dict(vars(self.r.stats))
        b0 = self.busy()
        t1 = time.perf_counter()
        ttft = replay(self.eng, reqs, stretch, lambda q: greedy(q.output), on_first=bar)
        wall = time.perf_counter() - t1
        recs = list(self.r.history)[n0:]
        v = sorted(ttft.values())
        st = {k: v2 - st0.get(k, 0) for k, v2 in vars(self.r.stats).items()}
        ratio = [x.planning_seconds / t for x in recs for t in [x.total_seconds] if t > 0]
        return {
            "gbps": g, "link": label, "method": m, "ttft_s": v, "mean_s": statistics.mean(v),
            "p50_s": _pct(v, 50), "p95_s": _pct(v, 95), "p99_s": _pct(v, 99), "wall_s": wall,
            "restorations": len(recs), "restored_requests": sum(len(x.cached) for x in recs),
            "mean_batch": statistics.mean(len(x.cached) for x in recs) if recs else 0,
            "restore_seconds_total": sum(x.total_seconds for x in recs),
            "restore_seconds_mean": statistics.mean(x.total_seconds for x in recs) if recs else 0,
            "predicted_seconds_total": sum(x.predicted_seconds for x in recs),
            "planning_s_median": statistics.median(x.planning_seconds for x in recs) if recs else 0,
            "planning_fraction_of_restore_median": statistics.median(ratio) if ratio else 0,
            # the measure: a request's TTFT (queueing included) against the planning of the restoration
            # that served it
            "planning_fraction_of_ttft": [x.planning_seconds / ttft[rid] for x in recs for rid in x.request_ids
                                          if ttft.get(rid)],
            "recomputed_tokens": st["recomputed_tokens"], "loaded_tokens": st["loaded_tokens"],
            "stolen_tokens": st["stolen_tokens"], "fallbacks": st["fallbacks"],
            "writes_dropped": st["writes_dropped"], "store_evictions": self.inner.stats.evictions,
            "restored_cached_tokens": sum(sum(x.cached) for x in recs),
            "restored_suffix_tokens": sum(sum(x.suffix) for x in recs),
            "busy_s": self.busy(b0, recs),
            "restorations_detail": [record_row(x) for x in recs]}


def record_row(rec) -> dict:
    """The executor's record of one restoration, flattened for the result file."""
    return {"restore_s": rec.total_seconds, "predicted_s": rec.predicted_seconds,
            "predicted_compute_s": rec.predicted_compute_seconds, "predicted_load_s": rec.predicted_load_seconds,
            "predicted_recompute_s": rec.predicted_recompute_seconds,
            "predicted_suffix_per_block_s": rec.predicted_suffix_seconds,
            "predicted_fixed_s": rec.predicted_fixed_seconds,
            "recompute_s": rec.recompute_seconds, "load_s": rec.load_seconds, "wait_s": rec.wait_seconds,
            "suffix_s": rec.suffix_seconds, "overhead_s": rec.overhead_seconds,
            "link_wait_s": rec.link_wait_seconds, "load_bytes": rec.load_bytes, "load_batches": rec.load_batches,
            "stolen_tokens": rec.stolen_tokens, "planned_load_s": rec.planned_load_seconds,
            "planned_load_bytes": rec.planned_load_bytes, "layer_recompute_s": rec.layer_recompute_seconds,
            "planning_s": rec.planning_seconds, "boundaries": rec.boundaries, "cached": rec.cached,
            "suffix": rec.suffix, "bandwidth_assumed": rec.bandwidth}


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


def _err(r: dict) -> float:
    return (r["restore_s"] - r["predicted_s"]) / r["predicted_s"]


def _balance(r: dict, layers: int) -> float:
    """|compute path - load path| / total: recompute + suffix against loads + the last block's suffix."""
    comp = r["recompute_s"] + r["suffix_s"]
    load = r["load_s"] + r["suffix_s"] / layers
    return abs(comp - load) / max(r["restore_s"], 1e-9)


def summarize_isolated(rows: list[dict], layers: int) -> list[dict]:
    """Per (tokens, gbps, batch): goal (a) CacheFlow's share of the ideal gain, with T_ideal = 1/(1/T_rec + 1/T_load)
    from the medians of recompute-only and load-only on the same prompts; goal (b) predicted vs actual per
    restoration; goal (d) planning time over TTFT."""
    out = []
    keys = sorted({(r["tokens"], r["gbps"], r["batch"]) for r in rows})
    for k in keys:
        sel = [r for r in rows if (r["tokens"], r["gbps"], r["batch"]) == k]

        def t(m: str, sel: list[dict] = sel) -> float:
            return statistics.median(r["restore_s"] for r in sel if r["method"] == m)

        tr, tl = t("recompute"), t("load")
        ideal = 1 / (1 / tr + 1 / tl)
        best_single = min(tr, tl)
        by = {m: [r for r in sel if r["method"] == m] for m in ORDER}
        cf = by["cacheflow"]
        errs = [_err(r) for r in cf]
        # The same bound when the suffix is compute-only (as it is: new tokens have no stored KV): split the prefix
        # work x : 1-x so that x P + L sigma = (1-x) Q + sigma, from the single-resource runs' own parts.
        med = lambda m, f, sel=sel: statistics.median(r[f] for r in sel if r["method"] == m)  # noqa: E731
        P, S, Q = med("recompute", "recompute_s"), med("recompute", "suffix_s"), med("load", "load_s")
        sig, fixed = S / layers, med("recompute", "overhead_s")
        x = min(max((Q + sig - S) / max(P + Q, 1e-12), 0.0), 1.0)
        ideal_sfx = max(x * P + S, (1 - x) * Q + sig) + fixed
        # The link as the hybrid methods saw it: loads beside a replay share the host and the device with it. The
        # ideal with that rate is what overlap can reach once the two paths slow each other down.
        def rate(rs: list[dict]) -> float | None:
            vals = [r["load_bytes"] / r["load_s"] for r in rs if r["load_s"] > 0 and r["load_bytes"] > 0]
            return statistics.median(vals) if vals else None

        hybrid = [r for m in ("cacheflow", "cake", "layerwise") for r in by[m] if r["recompute_s"] > 0]
        rate_alone = rate(by["load"])
        rate_beside = rate(hybrid) or rate_alone
        ideal_beside = 1 / (1 / tr + 1 / (tl * rate_alone / rate_beside)) if rate_alone and rate_beside else None
        out.append({"tokens": k[0], "gbps": k[1], "batch": k[2], "t_recompute_s": tr, "t_load_s": tl,
                    "t_ideal_s": ideal, "ideal_gain": best_single / ideal, "t_ideal_suffix_aware_s": ideal_sfx,
                    "cacheflow_fraction_of_suffix_aware_ideal": ideal_sfx / t("cacheflow"),
                    "median_s": {m: t(m) for m in ORDER},
                    "gains": {m: best_single / t(m) for m in ORDER},
                    "cacheflow_fraction_of_ideal_gain": (best_single / t("cacheflow")) / (best_single / ideal),
                    "load_rate_alone_bytes_per_s": rate_alone, "load_rate_beside_replay_bytes_per_s": rate_beside,
                    "t_ideal_beside_replay_s": ideal_beside,
                    "cacheflow_fraction_of_ideal_gain_beside_replay": ideal_beside / t("cacheflow") if ideal_beside
                    else None,
                    "cacheflow_assumed_over_measured_rate": statistics.median(
                        r["bandwidth_assumed"] * r["load_s"] / r["load_bytes"] for r in cf if r["load_bytes"] > 0)
                    if any(r["load_bytes"] > 0 for r in cf) else None,
                    "cacheflow_pred_errors": errs,
                    "cacheflow_pred_error_median": statistics.median(abs(e) for e in errs),
                    "cacheflow_within_10pct": sum(abs(e) <= 0.10 for e in errs) / len(errs),
                    "within_10pct_by_method": {m: sum(abs(_err(r)) <= 0.10 for r in by[m]) / len(by[m]) for m in ORDER},
                    "cacheflow_balanced_10pct": sum(_balance(r, layers) <= 0.10 for r in cf) / len(cf),
                    "cacheflow_stolen_tokens": [r["stolen_tokens"] for r in cf],
                    "cacheflow_boundaries_distinct": sorted({j for r in cf for row in r["boundaries"] for j in row}),
                    "planning_fraction_of_ttft": statistics.median(r["planning_s"] / r["ttft_mean_s"] for r in cf)})
    return out


def service_bound(trace: dict, bytes_per_token_layer: float, layers: int) -> dict:
    """Per link: each method's restorations summed into one service time, against the overlap bound.

    From recompute-only's own run: P = seconds recomputing cached tokens, S = seconds on new tokens; the link
    would carry the cached tokens' records in Lt = bytes / rate. With compute and link overlapped (new tokens beside
    loads too) the least total is Lt (P + S) / (P + Lt): what any plan can save per request before queueing
    multiplies it. Methods that restored other token counts (load-only hands some requests to plain prefill)
    are not comparable: each lists its restored cached tokens."""
    out = {}
    for link in sorted({r["link"] for r in trace["runs"]}):
        by = _by_method(trace["runs"], link)
        recs = [r for r in by.get("recompute", []) if r["restorations_detail"]]
        if not recs:
            continue
        P = statistics.median(sum(x["recompute_s"] for x in r["restorations_detail"]) for r in recs)
        S = statistics.median(sum(x["suffix_s"] for x in r["restorations_detail"]) for r in recs)
        Lt = recs[0]["restored_cached_tokens"] * bytes_per_token_layer * layers / gbps(recs[0]["gbps"])
        ideal = Lt * (P + S) / (P + Lt)
        total = {m: statistics.median(r["restore_seconds_total"] for r in rs) for m, rs in by.items()}
        base = total["recompute"]
        out[link] = {"recompute_only_recompute_s": P, "recompute_only_suffix_s": S, "link_s_all_cached": Lt,
                     "ideal_s": ideal, "ideal_service_gain": base / ideal, "restore_seconds_total": total,
                     "restored_cached_tokens": {m: rs[0]["restored_cached_tokens"] for m, rs in by.items()},
                     "service_gain": {m: base / t for m, t in total.items() if t > 0}}
    return out


def _paired(cacheflow: list[dict], other: list[dict]) -> list[float]:
    """Per rep: the other method's mean TTFT over CacheFlow's (same rep, same machine state)."""
    o = {r["rep"]: r["mean_s"] for r in other}
    return [o[r["rep"]] / r["mean_s"] for r in cacheflow if r["rep"] in o]


def _by_method(runs: list[dict], link: str) -> dict[str, list[dict]]:
    """A link's trace runs per method (one per --trace-reps), in method order."""
    by: dict[str, list[dict]] = {}
    for r in runs:
        if r["link"] == link:
            by.setdefault(r["method"], []).append(r)
    return by


def goals(rows: list[dict], summary: list[dict], trace: dict | None, layers: int,
          bytes_per_token_layer: float | None = None) -> dict:
    """The issue's goals (a)-(d) over the whole run, as measured (see summarize_isolated)."""
    cf = [r for r in rows if r["method"] == "cacheflow"]
    errs = [abs(_err(r)) for r in cf]
    g: dict = {} if not cf else {
        "a_fraction_of_ideal_gain": {f"{s['tokens']}tok/{s['gbps']:g}Gbps/b{s['batch']}":
                                     s["cacheflow_fraction_of_ideal_gain"] for s in summary},
        "a_fraction_of_ideal_gain_min": min(s["cacheflow_fraction_of_ideal_gain"] for s in summary),
        "a_fraction_of_ideal_gain_median": statistics.median(s["cacheflow_fraction_of_ideal_gain"] for s in summary),
        "a_fraction_of_suffix_aware_ideal_min": min(s["cacheflow_fraction_of_suffix_aware_ideal"] for s in summary),
        "b_within_10pct_of_prediction": sum(e <= 0.10 for e in errs) / len(errs),
        "b_pred_error_median": statistics.median(errs),
        "b_balanced_within_10pct": sum(_balance(r, layers) <= 0.10 for r in cf) / len(cf),
        "d_planning_fraction_of_ttft_median": statistics.median(r["planning_s"] / r["ttft_mean_s"] for r in cf),
    }
    if trace is not None:
        c = {}
        recompute_runs = [r for r in trace["runs"] if r["method"] == "recompute"]
        for link in sorted({r["link"] for r in trace["runs"]}):
            by = _by_method(trace["runs"], link)
            if "recompute" not in by and recompute_runs:  # it loads nothing: one link's run stands for all
                by["recompute"] = recompute_runs
            mean = {m: statistics.median(r["mean_s"] for r in rs) for m, rs in by.items()}  # median over reps
            singles = [m for m in ("recompute", "load") if m in mean]
            if "cacheflow" not in mean or not singles:
                continue
            best = min(mean[m] for m in singles)
            c[link] = {"gbps": by["cacheflow"][0]["gbps"], "mean_ttft_s": mean, "best_single_of": singles,
                       "gain_over_best_single": best / mean["cacheflow"],
                       "gain_over_cake": (mean["cake"] / mean["cacheflow"]) if "cake" in mean else None}
            if max(len(rs) for rs in by.values()) > 1:
                c[link]["mean_ttft_s_by_rep"] = {m: [r["mean_s"] for r in rs] for m, rs in by.items()}
                c[link]["gain_over_recompute_by_rep"] = _paired(by["cacheflow"], by.get("recompute", []))
                if "cake" in by:  # same rep, same machine state: the pairwise ratio
                    c[link]["gain_over_cake_by_rep"] = _paired(by["cacheflow"], by["cake"])
        g["c_trace"] = c
        if bytes_per_token_layer:
            g["c_trace_service_bound"] = service_bound(trace, bytes_per_token_layer, layers)
        # CacheFlow's median mean TTFT per link, slowest link first: a faster link must not be slower (the ratio of
        # each link's figure to the previous one; > 1 beyond the reps' spread would be a miss)
        cf = sorted((v["gbps"], v["mean_ttft_s"]["cacheflow"]) for v in c.values())
        g["c_trace_cacheflow_by_gbps"] = {f"{x:g}": t for x, t in cf}
        g["c_trace_faster_link_over_slower"] = [b[1] / a_[1] for a_, b in zip(cf, cf[1:])]
        sweep: dict = {}
        for load in sorted({r["offered_load"] for r in trace.get("load_sweep", [])} | {trace["offered_load"]}):
            rows_l = [r for r in trace.get("load_sweep", []) if r["offered_load"] == load] or \
                [r for r in trace["runs"] if r["gbps"] == trace["runs"][0]["gbps"]]
            by: dict[str, list[dict]] = {}
            for r in rows_l:
                by.setdefault(r["method"], []).append(r)
            med = {m: statistics.median(r["mean_s"] for r in rs) for m, rs in by.items()}
            row = {"mean_ttft_s": med}
            if "cacheflow" in med and ("recompute" in med or "load" in med):
                row["gain_over_best_single"] = min(med[m] for m in ("recompute", "load") if m in med) / med["cacheflow"]
                row["gain_over_recompute_by_rep"] = _paired(by["cacheflow"], by.get("recompute", []))
            if "cacheflow" in med and "cake" in med:
                row["gain_over_cake_by_rep"] = _paired(by["cacheflow"], by["cake"])
            sweep[f"{load:g}"] = row
        g["c_trace_by_load"] = sweep
        fr = [x["planning_s"] / x["restore_s"] for r in trace["runs"] if r["method"] == "cacheflow"
              for x in r["restorations_detail"] if x["restore_s"] > 0]
        g["d_trace_planning_fraction_of_restore_median"] = statistics.median(fr) if fr else None
        ft = [v for r in trace["runs"] if r["method"] == "cacheflow" for v in r.get("planning_fraction_of_ttft", [])]
        g["d_trace_planning_fraction_of_ttft_median"] = statistics.median(ft) if ft else None
    return g


def draw(doc: dict, plt):
    """Headline figure: TTFT CDFs of the trace replay per link and method; without a replay, each method's gain
    over the better single resource on the isolated grid."""
    m, trace = doc.get("meta", {}), doc.get("trace")
    if trace and trace.get("runs"):
        args = m.get("args", {})
        return _ttft_cdfs(trace, plt, f"Mooncake trace replay, {m.get('model')}"
                          f"{' (random weights)' if m.get('random_weights') else ''}, {args.get('device')}; "
                          f"{trace['requests']} requests at {args.get('load')} x recompute-only saturation")
    rows = doc.get("isolated_summary") or []
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(rows)), 4))
    width = 0.8 / len(ORDER)
    for i, meth in enumerate(ORDER):
        ax.bar([j + (i - (len(ORDER) - 1) / 2) * width for j in range(len(rows))],
               [r["gains"].get(meth, 0) for r in rows], width, label=LABELS[meth])
    ax.plot(range(len(rows)), [r["ideal_gain"] for r in rows], "k_", markersize=16, label="ideal overlap")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(rows)), [f"{r['tokens']}\n{r['gbps']:g} Gbps\nb{r['batch']}" for r in rows], fontsize=7)
    ax.set_ylabel("gain over the better of recompute / load")
    ax.set_title(f"isolated restorations, {m.get('model')}", fontsize=9)
    ax.legend(fontsize=7)
    return fig


def _ttft_cdfs(trace: dict, plt, title: str):
    gs = list(dict.fromkeys(r["link"] for r in trace["runs"]))
    fig, axes = plt.subplots(1, len(gs), figsize=(max(8.0, 5.5 * len(gs)), 4.3), squeeze=False)
    for ax, g in zip(axes[0], gs):
        for r in [x for x in trace["runs"] if x["link"] == g]:
            v = r["ttft_s"]
            tag = f" rep {r['rep']}" if r.get("rep") else ""
            ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post",
                    label=f"{LABELS[r['method']]}{tag} (mean {r['mean_s']:.2f}s)")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("CDF")
        ax.set_title(g)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8, wrap=True)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2-135m")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the default: the isolated grid and the trace at 64 requests")
    mode.add_argument("--full", action="store_true")
    ap.add_argument("--lengths", type=int, nargs="*", help="isolated prefix lengths (tokens)")
    ap.add_argument("--bandwidths", type=float, nargs="*", help="Gbps; default CPU: around the balance point")
    ap.add_argument("--batches", type=int, nargs="*", help="isolated batch sizes")
    ap.add_argument("--trace-bandwidths", type=float, nargs="*",
                    help="GPU: trace replay links in Gbps (default: the isolated --bandwidths)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--suffix", type=int, default=16, help="new tokens after the restored prefix (isolated)")
    ap.add_argument("--requests", type=int, default=None, help="trace requests per method")
    ap.add_argument("--trace-start", type=int, default=2000, help="trace index where the replay window starts")
    ap.add_argument("--block-tokens", type=int, default=None, help="tokens per 512-token trace block (scale)")
    ap.add_argument("--max-input", type=int, default=None)
    ap.add_argument("--max-output", type=int, default=None)
    ap.add_argument("--min-reuse-blocks", type=int, default=2, help="keep requests reusing >= this many blocks")
    ap.add_argument("--load", type=float, default=0.9, help="offered rate / recompute-only saturation throughput")
    ap.add_argument("--trace-methods", nargs="+", default=ORDER, choices=ORDER,
                    help="methods replayed at --load on every trace link (a long trace may leave out load-only, "
                         "measured on a shorter one, when it is far from the best single method)")
    ap.add_argument("--merge-load-layers", type=int, default=1,
                    help="most consecutive layers whose loads share a fetch (RestoreConfig.merge_load_layers; 1: one "
                         "fetch per layer)")
    ap.add_argument("--mixed-load-rate", action="store_true",
                    help="A/B: plan with one load-rate estimate over every load (loads alone and beside a replay), "
                         "as before ProfileConfig.separate_overlapped_loads")
    ap.add_argument("--per-entry-writes", action="store_true",
                    help="A/B: place every loaded entry with its own page writes (the executor before runs of whole "
                         "chunks went in one write each)")
    ap.add_argument("--link-methods", nargs="+", default=None, choices=ORDER,
                    help="methods replayed at the links after the first (default: --trace-methods)")
    ap.add_argument("--trace-reps", type=int, default=3,
                    help="replays of every --trace-methods run (interleaved); goals take the median per method")
    ap.add_argument("--extra-loads", type=float, nargs="*", default=[0.7, 1.0],
                    help="also replay the trace at these offered loads (x recompute-only saturation), first link")
    ap.add_argument("--extra-load-methods", nargs="*", default=["cacheflow", "recompute", "cake"],
                    choices=ORDER, help="methods replayed at --extra-loads")
    ap.add_argument("--trace-ratio", type=float, default=2.56,
                    help="CPU trace link = B* / this (T_load/T_recompute of Llama-8B shape on an H200 at 10 Gbps)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="skip trace runs that would start after this many seconds (default: 450 on CUDA)")
    ap.add_argument("--store-gb", type=int, default=None)
    ap.add_argument("--num-pages", type=int, default=None)
    ap.add_argument("--max-batched-tokens", type=int, default=None)
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("--no-isolated", action="store_true",
                    help="skip the isolated restorations (the trace replay alone, e.g. inside one GPU call's time limit)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch compute threads (CPU default 1: on a shared 2-core machine a second OpenMP thread "
                         "stalls at every barrier when descheduled; 1 compute thread + the I/O thread is also the "
                         "'one compute resource, one link' of the model)")
    ap.add_argument("--attention", default="auto", choices=["auto", "torch", "flashinfer"],
                    help="engine attention backend (auto: FlashInfer on CUDA when importable, else the torch reference)")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="decode steps as CUDA graphs (EngineConfig.cuda_graphs; default on with --device cuda), "
                         "the same for every method")
    ap.add_argument("--store", choices=("memory", "pinned"), default="memory",
                    help="the host tier behind the emulated link: records as bytes (loads staged through a pinned "
                         "buffer) or in page-locked slabs (loads go to the GPU by DMA from the record)")
    ap.add_argument("--load-workers", type=int, default=None,
                    help="threads verifying and staging loads (RestoreConfig.load_workers; default: 2 on CUDA, 0 on CPU)")
    ap.add_argument("--read-ahead", type=int, default=None,
                    help="fetches booked on the link beyond the one being verified and placed "
                         "(RestoreConfig.load_read_ahead; default: 2 on CUDA, 1 on CPU)")
    ap.add_argument("--codec", choices=["zip"], default=None,
                    help="store entries in the ZipFusion format (RestoreConfig.store_codec): lossless, fewer bytes "
                         "over the link, encoded and decoded on the GPU; every method reads the same store")
    ap.add_argument("--layer-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="with --cuda-graphs: restorations' layer calls of <= 128 rows (the suffix) as CUDA graphs "
                         "(ModelRunner.layer_graphs); --no-layer-graphs runs them as plain calls (A/B)")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the whole run (seconds; Python's default 0.005): a diagnostic "
                         "for GIL hand-offs between the engine thread and the store writer")
    a = ap.parse_args(argv)
    if a.trace_reps < 1:
        ap.error(f"--trace-reps must be >= 1, got {a.trace_reps}")
    if a.per_entry_writes:  # the executor takes the grouped write only where the port offers it
        from kvtide.engine.restore_port import EnginePort
        EnginePort.write_kv_chunks = None  # type: ignore[assignment]
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    gpu = a.device.startswith("cuda")
    full = a.full
    d = {  # (cpu quick, cpu full, gpu quick, gpu full)
        "lengths": ([512], [256, 512, 1024], [8192], [4096, 16384, 32768]),
        "batches": ([1], [1, 4], [1, 4, 8], [1, 4, 8]),
        "reps": (3, 3, 2, 5),
        "chunk": (32, 32, 512, 512),
        "requests": (64, 96, 64, 96),
        "block_tokens": (16, 16, 512, 512),
        "max_input": (512, 768, 16384, 32768),
        "max_output": (8, 8, 16, 32),
        "store_gb": (4, 4, 64, 96),
        "max_batched_tokens": (4096, 4096, 32768, 32768),
    }
    idx = (2 if gpu else 0) + (1 if full else 0)
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v[idx])
    if a.deadline_s is None and gpu and not full:
        a.deadline_s = 450.0
    if a.cuda_graphs is None:
        a.cuda_graphs = gpu
    torch.manual_seed(0)
    if a.threads is None and not gpu:
        a.threads = 1
    if a.threads:
        torch.set_num_threads(a.threads)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    con = Console()
    t_start = time.perf_counter()
    deadline = t_start + (a.deadline_s if a.deadline_s is not None else float("inf"))
    b = Bench(a)
    args = b.eng.model.args
    random_w = a.model.startswith("random:")
    con.print(f"[bold]restore bench[/]: {a.model} ({'RANDOM weights' if random_w else 'real weights'}), "
              f"attention {b.eng.runner.attention.name}, {args.num_layers} layers, {args.num_kv_heads} KV heads x {args.head_dim}, KV bf16, device {a.device}, "
              f"chunk {a.chunk} tokens, {b.r.bytes_per_token:.0f} stored B/token/layer; load avg {_loadavg()}")
    if a.cuda_graphs:
        graphs_s = b.capture_graphs(max(a.requests, max(a.batches)))
        con.print(f"decode CUDA graphs captured for batch sizes 1..{b.eng.runner.graphs.captures} ({graphs_s:.1f} s)")
        if not a.layer_graphs:  # A/B: restorations' short layer calls as plain calls, as before
            b.eng.runner.layer_graphs = None
        b.layer_graphs_s = b.capture_layer_graphs()
        if b.eng.runner.layer_graphs is not None:
            con.print(f"restore layer graphs captured for {b.eng.runner.layer_graphs.captures} row buckets up to "
                      f"{b.eng.runner.layer_graphs.max_rows} rows ({b.layer_graphs_s:.1f} s)")
    b.warm_profile([64, 128, 256, 512] if not gpu else [1024, 4096, 8192, a.max_input])
    con.print(f"decode step at batch 1: {b.decode_step * 1e3:.1f} ms with the store writer idle, "
              f"{b.decode_step_writer_busy * 1e3:.1f} ms with {b.writer_backlog_bytes / 2**30:.2f} GiB queued for it")
    bal = b.balance(a.lengths[0])
    con.print(f"T_recompute {bal['recompute_ms_per_token']:.3f} ms/token, unthrottled load "
              f"{bal['load_ms_per_token_unthrottled']:.3f} ms/token ({bal['load_path_gbps']:.1f} Gbps through the "
              f"load path) -> balance B* = {bal['balance_gbps'] * 1e3:.1f} Mbps")
    if a.bandwidths is None:
        if gpu:
            a.bandwidths = [10.0, 40.0, 80.0]
        else:
            bs = bal["balance_gbps"]
            a.bandwidths = [round(bs * f, 4) for f in (0.5, 1.0, 2.0)]
    if gpu:
        links = [(g, f"{g:g} Gbps") for g in (a.trace_bandwidths or a.bandwidths)]
    else:
        bs = bal["balance_gbps"]
        links = [(round(bs / a.trace_ratio, 5), f"10 Gbps-equivalent (B*/{a.trace_ratio:g})")]
        if full:
            links.append((round(bs, 5), "balance B*"))
    n_iso = 0 if a.no_isolated else len(a.lengths) * len(a.bandwidths) * len(a.batches) * len(ORDER) * a.reps
    later = [m for m in (a.link_methods or a.trace_methods) if m != "recompute"]
    n_tr = 0 if a.no_trace else (len(a.trace_methods) + (len(links) - 1) * len(later)
                                 + len(a.extra_loads or []) * len(a.extra_load_methods)) * a.trace_reps * a.requests
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=con, disable=a.no_progress) as prog:
        t1 = prog.add_task("isolated restorations", total=n_iso)
        iso = [] if a.no_isolated else b.isolated(a.lengths, a.bandwidths, a.batches, a.reps, lambda: prog.advance(t1))
        trace = None
        if not a.no_trace:
            t2 = prog.add_task("trace replay (first tokens)", total=n_tr)
            trace = b.trace(links, lambda: prog.advance(t2), deadline)
    L = args.num_layers
    summary = summarize_isolated(iso, L)
    g = goals(iso, summary, trace, L, b.r.bytes_per_token)
    tag = (f"{a.model.replace(':', '_')}_{a.device.split(':')[0]}{'_full' if full else ''}"
           f"{'_trace' if a.no_isolated else ''}{'_' + a.codec if a.codec else ''}")
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"when": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "load_average_at_end": _loadavg(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if gpu else None, "model": a.model, "random_weights": random_w,
            "shape": {"layers": args.num_layers, "kv_heads": args.num_kv_heads, "head_dim": args.head_dim},
            "kv_dtype": "bfloat16", "compute_dtype": str(b.eng.config.torch_dtype), "chunk_tokens": a.chunk,
            "attention_backend": b.eng.runner.attention.name, "cuda_graphs": bool(a.cuda_graphs),
            "layer_graphs": b.eng.runner.layer_graphs is not None, "load_workers": a.load_workers,
            "read_ahead": LoadConfig(read_ahead=a.read_ahead).resolved_read_ahead(b.eng.runner.device), "layer_graphs_capture_s": getattr(b, "layer_graphs_s", 0.0),
            "decode_step_batch1_s": b.decode_step, "decode_step_batch1_writer_busy_s": b.decode_step_writer_busy,
            "writer_backlog_bytes_at_that_step": b.writer_backlog_bytes,
            "decode_probe_writer_busy": b.probe_trail, "decode_probe_stacks": b.probe_stacks,
            "stored_bytes_per_token_per_layer": b.r.bytes_per_token,
            "plain_bytes_per_token_per_layer": b.r.plain_bytes_per_token, "store_codec": a.codec,
            "link": "token bucket on the store load path (fetch books the link, the executor reads one batch ahead)",
            "store": ("in-process memory tier (XXH3-128 checksummed records, verified on every load)"
                      + (", records in page-locked slabs: loads DMA'd to the GPU from the record (--store pinned)"
                         if a.store == "pinned" else ", records as bytes: loads staged through a pinned buffer")),
            "executor": "batched pipelined loads, stealing on for hybrid plans (RestoreConfig.steal), "
                        + f"fetches of up to {a.merge_load_layers} consecutive layers",
            "args": vars(a), "trace_links": [{"gbps": x, "label": y} for x, y in links],
            "trace_scaling": f"each 512-token Mooncake block -> {a.block_tokens} tokens (scale {a.block_tokens / 512:g}); "
                             f"inputs capped at {a.max_input}, outputs scaled the same and capped at {a.max_output}; "
                             f"window from trace index {a.trace_start}, the first {a.requests} requests reusing >= "
                             f"{a.min_reuse_blocks} leading blocks; arrival pattern stretched so the offered rate is "
                             f"{a.load} x the recompute-only saturation throughput (closed-loop run of the same "
                             "requests); device prefix cache off (every reuse is a store restoration); "
                             "reused-before-window prefixes pre-loaded into the store; CPU links: B*/trace_ratio "
                             "('10 Gbps-equivalent') and B*",
            "wall_seconds": time.perf_counter() - t_start, "profile_at_end": _profile_state(b.r.profile),
            "profile_dump": b.r.profile.to_dict()}
    res = {"meta": meta, "goals": g, "balance": bal, "isolated": iso, "isolated_summary": summary, "trace": trace}
    jpath = out_dir / f"restore_{tag}.json"
    report.write(jpath, res, draw if (iso or trace and trace["runs"]) else None, argv)
    _print(con, summary, trace, g)
    con.print(f"wrote {jpath} ({meta['wall_seconds']:.0f}s)")
    return 0


def _profile_state(prof) -> dict:
    """What the planner believed at the end: F's knots (seconds per layer call) and the learned overheads."""
    t, y = prof.knots()
    return {"knots_tokens": [float(x) for x in t], "knots_seconds_per_layer": [float(x) for x in y],
            "F_at": {str(n): float(prof(n)) for n in (512, 2048, 8192, 16384, 32768)},
            "call_overhead_s": prof.call_overhead, "suffix_overhead_s": prof.suffix_overhead,
            "suffix_scale": prof.suffix_scale,
            "fixed_overhead_s": prof.fixed_overhead, "compute_scale": prof.compute_scale,
            "compute_scale_by_batch": {str(n): prof.compute_scale_for(n) for n in range(1, 9)},
            "bandwidth_bytes_per_s": prof.bandwidth, "observations": prof.num_observations}


def _print(con, summary: list[dict], trace: dict | None, g: dict) -> None:
    from rich.table import Table

    if not summary:
        con.print("isolated restorations: not run (--no-isolated)")
    t = Table(title="isolated restorations: gain over the best single resource (ideal = 1 + min/max)")
    for c in ("tokens", "Gbps", "batch", "T_rec s", "T_load s", "ideal", "CacheFlow", "Cake", "layer-wise",
              "of ideal", "pred err", "<=10%"):
        t.add_column(c, justify="right")
    for s in summary:
        gg = s["gains"]
        t.add_row(str(s["tokens"]), f"{s['gbps']:g}", str(s["batch"]), f"{s['t_recompute_s']:.2f}",
                  f"{s['t_load_s']:.2f}", f"{s['ideal_gain']:.2f}x", f"{gg['cacheflow']:.2f}x", f"{gg['cake']:.2f}x",
                  f"{gg['layerwise']:.2f}x", f"{s['cacheflow_fraction_of_ideal_gain']:.0%}",
                  f"{s['cacheflow_pred_error_median']:.0%}", f"{s['cacheflow_within_10pct']:.0%}")
    if summary:
        con.print(t)
    if trace is not None:
        t = Table(title=f"trace replay: TTFT over {trace['requests']} requests (s), offered "
                        f"{trace['offered_req_per_s']:.3f} req/s = {trace['offered_load']} x recompute-only saturation")
        for c in ("link", "method", "mean", "p50", "p95", "p99", "restored", "mean batch", "restore s", "stolen tok"):
            t.add_column(c, justify="right")
        for r in trace["runs"]:
            t.add_row(r["link"], LABELS[r["method"]], f"{r['mean_s']:.2f}", f"{r['p50_s']:.2f}", f"{r['p95_s']:.2f}",
                      f"{r['p99_s']:.2f}", str(r["restored_requests"]), f"{r['mean_batch']:.1f}",
                      f"{r['restore_seconds_mean']:.2f}", str(r["stolen_tokens"]))
        con.print(t)
        fmt = lambda b: ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in b.items())  # noqa: E731
        con.print(f"closed-loop recompute-only run: makespan {trace['closed_loop_makespan_s']:.2f} s (first of the two "
                  f"runs: {trace['closed_loop_makespans_s'][0]:.2f} s); step loop (s): "
                  f"{fmt(trace['closed_loop_busy_s'])}")
        con.print(f"pre-loaded {trace['preloaded_prefixes']} prefixes, {trace['preloaded_chunks_missing']} chunks "
                  "missing from the store after it")
        for r in trace["runs"]:
            con.print(f"  {r['link']} {r['method']}: wall {r['wall_s']:.2f} s; restored {r['restored_cached_tokens']} "
                      f"cached + {r['restored_suffix_tokens']} new tokens, {r['writes_dropped']} chunk writes dropped, "
                      f"{r['store_evictions']} store evictions; "
                      f"step loop (s): {fmt(r['busy_s'])}")
        for r in trace.get("load_sweep", []):
            con.print(f"  load {r['offered_load']:g} x saturation, {r['link']} {LABELS[r['method']]}: mean TTFT "
                      f"{r['mean_s']:.2f} s, p50 {r['p50_s']:.2f}, p95 {r['p95_s']:.2f}; wall {r['wall_s']:.1f} s")
        if trace["skipped"]:
            con.print(f"skipped (deadline): {trace['skipped']}")
    con.print({k: v for k, v in g.items() if k != "a_fraction_of_ideal_gain"})


if __name__ == "__main__":
    sys.exit(main())
