"""Remote-pool restoration with a quality budget (KVServe section 7.4, Fig. 14, on kvtide's CacheFlow restorer).

A long prefix's KV lies in a remote pool behind a 5 / 10 / 15 Gbps link, each chunk stored losslessly and under the
KVServe profiles of a Pareto table (RestoreConfig.store_profiles). Four ways to bring it back, same engine, store and
executor, TTFT of one request:

* ``recompute``: prefill the whole prefix.
* ``lossless-load``: load every lossless entry (method load).
* ``cachegen``: CacheGen-like: load-only, the highest-quality entries (lossless first, then profiles by quality)
  whose predicted load meets the SLO, else fall back to recompute (the SLO is ``--slo-frac`` x the measured
  recompute TTFT of that prefix).
* ``controller``: the restorer's joint plan: CacheFlow over every profile within the request's quality budget
  (``--min-quality``, default 0.97), the one with the least predicted TTFT (kvtide/engine/restoration.py).

CPU (default, SmolLM2-135M, real weights): the links are scaled the way bench/restore.py scales them: g Gbps becomes
B* g / 25.6, B* the measured balance point (loading the prefix takes as long as recomputing it), so that at "10
Gbps" T_load / T_recompute is 2.56, the ratio of a Llama-3.1-8B shape on an H200 at 10 Gbps.
GPU: ``--device cuda --model random:llama3-8b`` (RANDOM weights) at 5 / 10 / 15 Gbps, 8K / 16K / 30K-token prefixes;
``--real-kv FILE`` (a bench/zip_attention.py --capture file) replaces the KV written to the store by a real model's,
so the profiles' ratios and decode times are those of real KV. Profile qualities are the table's (real models).

    python bench/restore_remote.py                      # CPU, ~15 min on a quiet 2-core machine
    python bench/restore_remote.py --device cuda --model random:llama3-8b [--real-kv FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
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

import report  # noqa: E402

from kvtide import CacheConfig, SamplingParams, SchedulerConfig  # noqa: E402
from kvtide.config import RestoreConfig  # noqa: E402
from kvtide.engine.llm import LLM  # noqa: E402
from kvtide.restore.costs import RestoreRequest  # noqa: E402
from kvtide.restore.methods import make_plan  # noqa: E402
from kvtide.store.bandwidth import BandwidthLimitedStore  # noqa: E402
from kvtide.store.memory import MemoryStore  # noqa: E402
from kvtide.transfer.table import load_profiles  # noqa: E402
from restore_trace import text_tokens  # noqa: E402

METHODS = ["controller", "recompute", "lossless-load", "cachegen"]
TABLE = Path(__file__).resolve().parent / "results" / "kvserve_table_smollm2-135m_prose.json"
H200_RATIO_10G = 2.56  # T_load / T_recompute of the 8B shape on the H200 at 10 Gbps (bench/restore.py)


def pick_profiles(table: Path, floor: float, count: int, codec: str | None = None) -> list[tuple[str, float]]:
    """The ``count`` highest-ratio profiles of the table with quality >= ``floor`` (spec, quality); ``codec``: their
    entropy stage replaced by this one (a lossless stage: the quality is the quantiser's, e.g. nvzstd on a GPU)."""
    ps = sorted((p for p in load_profiles(table) if p.quality >= floor), key=lambda p: -p.ratio)
    out = []
    for p in ps:
        spec = p.name if codec is None else "|".join(p.name.split("|")[:2] + [codec])
        if spec not in (s for s, _ in out):
            out.append((spec, p.quality))
    return out[:count]


class RemoteBench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.llm = LLM(a.model, device=a.device, progress=False,
                       cache=CacheConfig(kv_dtype="bfloat16", enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_num_batched_tokens=a.max_batched_tokens),
                       restore=RestoreConfig(memory_bytes=a.store_gb << 30, chunk_tokens=a.chunk, max_batch=1,
                                             store_profiles=tuple(a.profiles)))
        self.eng = self.llm.engine
        self.r = self.eng.restorer
        self.inner = self.r.store
        self.text = text_tokens(self.llm.tokenizer, self.eng.model.args.vocab_size, a.text_tokens)
        self.real_kv = _real_kv_bank(a.real_kv, self.eng.model.args.head_dim) if a.real_kv else None
        if self.real_kv is not None:
            self._substitute_real_kv()

    # ---- plumbing ------------------------------------------------------------------------------------------
    def set_link(self, gbps: float | None) -> None:
        link = self.inner if gbps is None else BandwidthLimitedStore.at_gbps(self.inner, gbps)
        self.r.use_store(link, writes=self.inner)  # loads cross the link; finished chunks are written past it
        self.r.cfg.bandwidth_gbps = gbps
        self.r.profile.reset_bandwidth()

    def populate(self, prefix: list[int]) -> None:
        """Prefill the prefix once (untimed): its chunks go to the store, lossless and under every profile."""
        self.inner = MemoryStore(self.a.store_gb << 30)
        self.r.use_store(self.inner)
        self.llm.generate(prefix, _params(1, 1.0))
        self.r.writer.flush()

    def _substitute_real_kv(self) -> None:
        """The chunks read for the writer hold a real model's KV (rows of the bank, in order) instead of the random
        model's: what is stored, compressed and loaded has real KV statistics (the model's tokens do not use it)."""
        from kvtide.engine.chunk_reader import ChunkReader

        if self.r._reader is None:
            self.r._reader = ChunkReader(self.eng.runner)
        reader, bk, bv, pos = self.r._reader, self.real_kv[0], self.real_kv[1], [0]
        read = reader.read

        def substituted(pids, C):  # noqa: ANN001, ANN202
            per_chunk, ready = read(pids, C)
            if ready is not None:
                ready.synchronize()
            for layers in per_chunk:
                for kv in layers:
                    n = kv[0].numel() // kv.shape[-1]
                    for i, bank in ((0, bk), (1, bv)):
                        lo = pos[0] % max(1, bank.shape[0] - n)
                        kv[i].copy_(bank[lo:lo + n].view(kv[i].shape))
                    pos[0] += n
            return per_chunk, None

        reader.read = substituted

    def run(self, prompt: list[int], method: str, quality: float, policy: str | None) -> dict:
        self.r.cfg.method, self.r.profile_policy = method, policy
        n0 = len(self.r.history)
        out = self.llm.generate(prompt, _params(1, quality))[0]
        recs = list(self.r.history)[n0:]
        rec = recs[0] if recs else None
        return {"ttft_s": out.ttft, "method": method, "profile": rec.profile if rec else None,
                "profile_quality": rec.profile_quality if rec else 1.0,
                "restore_s": rec.total_seconds if rec else None, "predicted_s": rec.predicted_seconds if rec else None,
                "load_bytes": rec.load_bytes if rec else 0, "decode_s": rec.decode_seconds if rec else 0.0,
                "boundaries": rec.boundaries if rec else None, "failures": rec.failures if rec else 0}

    def cachegen_choice(self, prompt: list[int], slo_s: float, quality: float) -> str | None:
        """CacheGen's pick: the highest-quality stored entries whose load-only plan meets ``slo_s`` ("lossless" or a
        profile's spec), None when none does (then it recomputes)."""
        r, C = self.r, self.r.chunk
        cached = (len(prompt) - 1) // C * C
        reqs = [RestoreRequest(cached, len(prompt) - cached)]
        bw = r.bandwidth("load")
        base = r.cost(1, cached)
        options = [("lossless", base, 1.0)]
        w = r.writer.stats
        for p in sorted(r.profiles.eligible(quality), key=lambda p: -p.quality):
            s = r.profiles.bytes_per_token(p.spec, (w.profile_bytes.get(p.spec, 0), w.profile_entries.get(p.spec, 0)),
                                           r.plain_bytes_per_token)
            options.append((p.spec, dataclasses.replace(base, kv_bytes_per_token=s,
                            decode_seconds_per_token=r.profiles.decode_seconds_per_token(p.spec)), p.quality))
        for name, cost, _ in options:
            if make_plan("load", reqs, cost, bw, C).predicted_seconds <= slo_s:
                return name
        return None

    def cell(self, prompt: list[int], quality: float, slo_s: float) -> list[dict]:
        """One repetition of every method on the prompt over the current link."""
        rows = []
        for m in METHODS:
            if m == "recompute":
                row = self.run(prompt, "recompute", 1.0, "lossless")
            elif m == "lossless-load":
                row = self.run(prompt, "load", 1.0, "lossless")
            elif m == "controller":
                row = self.run(prompt, "cacheflow", quality, None)
            else:
                pick = self.cachegen_choice(prompt, slo_s, quality)
                row = self.run(prompt, "load", quality, pick) if pick is not None else \
                    self.run(prompt, "recompute", 1.0, "lossless")
                row["cachegen_pick"] = pick or "recompute (SLO not met)"
            row["name"] = m
            rows.append(row)
        return rows


def _params(n: int, quality: float) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, kv_min_quality=quality)


def _real_kv_bank(path: str, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    from bench.zip_engine import real_kv_file

    _, k, v = real_kv_file(path, head_dim)
    return k.reshape(-1, head_dim).contiguous(), v.reshape(-1, head_dim).contiguous()


def summarize(rows: list[dict]) -> list[dict]:
    """Median (and min, max) TTFT per (link, prefix, method), with the speed-up over recompute."""
    out = []
    keys = sorted({(r["gbps"], r["tokens"]) for r in rows})
    for g, n in keys:
        cell = [r for r in rows if r["gbps"] == g and r["tokens"] == n]
        med = {m: statistics.median(r["ttft_s"] for r in cell if r["name"] == m) for m in METHODS}
        for m in METHODS:
            rs = [r for r in cell if r["name"] == m]
            t = [r["ttft_s"] for r in rs]
            out.append({"gbps": g, "tokens": n, "method": m, "ttft_median_s": med[m], "ttft_min_s": min(t),
                        "ttft_max_s": max(t), "speedup_vs_recompute": med["recompute"] / med[m],
                        "profiles": sorted({str(r["profile"]) for r in rs}),
                        "min_profile_quality": min(r["profile_quality"] for r in rs),
                        "load_bytes_median": statistics.median(r["load_bytes"] for r in rs),
                        **({"cachegen_picks": sorted({r["cachegen_pick"] for r in rs})} if m == "cachegen" else {})})
    return out


def goals(summary: list[dict], quality: float) -> dict:
    """>= 10x over recompute at the lowest link on the longest prefix at >= the quality budget; and the controller
    never slower (median) than the best of the others in any cell."""
    g0, n0 = min(r["gbps"] for r in summary), max(r["tokens"] for r in summary)
    c = next(r for r in summary if r["gbps"] == g0 and r["tokens"] == n0 and r["method"] == "controller")
    worst = []
    for g, n in sorted({(r["gbps"], r["tokens"]) for r in summary}):
        cell = {r["method"]: r for r in summary if r["gbps"] == g and r["tokens"] == n}
        best_other = min(cell[m]["ttft_median_s"] for m in METHODS if m != "controller")
        worst.append({"gbps": g, "tokens": n, "controller_over_best_other": cell["controller"]["ttft_median_s"]
                      / best_other})
    return {"speedup_at_lowest_link_longest_prefix": c["speedup_vs_recompute"],
            "quality_there": c["min_profile_quality"], "goal_10x_met": c["speedup_vs_recompute"] >= 10.0
            and c["min_profile_quality"] >= quality,
            "never_slower": all(w["controller_over_best_other"] <= 1.0 for w in worst), "per_cell": worst}


def draw(doc: dict, plt):
    """Median TTFT per method against the link, one panel per prefix length (log scale)."""
    summary = doc["summary"]
    lengths = sorted({r["tokens"] for r in summary})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.8), squeeze=False)
    for ax, n in zip(axes[0], lengths):
        rows = [r for r in summary if r["tokens"] == n]
        for m in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["gbps"], r["ttft_median_s"]) for r in rows if r["method"] == m)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=m)
        ax.set_yscale("log")
        ax.set_xlabel("link (Gbps, nominal)")
        ax.set_ylabel("TTFT median (s)")
        ax.set_title(f"{n}-token prefix", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"remote-pool restoration under a quality budget, {doc.get('meta', {}).get('model')}", fontsize=9)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", type=int, nargs="*", help="prefix tokens (CPU 512 1024 2048; GPU 8192 16384 30720)")
    ap.add_argument("--gbps", type=float, nargs="*", default=[5.0, 10.0, 15.0], help="links (CPU: equivalents)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--suffix", type=int, default=16, help="new tokens after the prefix")
    ap.add_argument("--min-quality", type=float, default=0.97, help="the requests' quality budget")
    ap.add_argument("--table", default=str(TABLE), help="profile table (bench/kvserve_profiles.py)")
    ap.add_argument("--quality-floor", type=float, default=0.97, help="profiles of the table stored: quality >= this")
    ap.add_argument("--num-profiles", type=int, default=5, help="... the highest-ratio ones")
    ap.add_argument("--codec-override", default=None,
                    help="replace the table profiles' codec stage (e.g. nvzstd, to decode on the GPU)")
    ap.add_argument("--profile", action="append", default=None, metavar="SPEC=QUALITY",
                    help="store these profiles instead of the table's")
    ap.add_argument("--slo-frac", type=float, default=0.5, help="CacheGen's SLO: this x the recompute TTFT")
    ap.add_argument("--real-kv", default=None, help="store a real model's KV (bench/zip_attention.py --capture file)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--partial", default=None, help="rewrite this JSON file with the rows after every cell")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    a = ap.parse_args(argv)
    gpu = a.device.startswith("cuda")
    # the 8B preset's context is 32,768 tokens: the longest prefix leaves room for its suffix and the probes
    a.lengths = a.lengths or ([8192, 16384, 30720] if gpu else [512, 1024, 2048])
    a.chunk = a.chunk or (512 if gpu else 128)  # a profile's container costs ~1 KiB an entry: not 32-token ones
    a.store_gb = 64 if gpu else 4
    a.max_batched_tokens = 32768 if gpu else 4096
    a.text_tokens = max(a.lengths) * 2 + 150_000
    if a.profile:
        a.profiles = [(s.rsplit("=", 1)[0], float(s.rsplit("=", 1)[1])) for s in a.profile]
    else:
        a.profiles = pick_profiles(Path(a.table), a.quality_floor, a.num_profiles, a.codec_override)
    torch.set_num_threads(a.threads or (1 if not gpu else torch.get_num_threads()))
    torch.manual_seed(0)
    b = RemoteBench(a)
    L = b.eng.model.args.num_layers
    print(f"remote-pool bench: {a.model} ({'RANDOM weights' if a.model.startswith('random:') else 'real weights'}), "
          f"{L} layers, device {a.device}, chunk {a.chunk}; profiles {a.profiles}", flush=True)
    rows, links, balance = [], {}, {}
    o = 100_000
    for n in a.lengths:  # F(t) from ordinary prefills, as a server gets it (two per length, distinct prompts)
        for _ in range(2):
            b.llm.generate(b.text[o:o + n], _params(1, 1.0))
            o += n + 100
    for n in sorted(a.lengths):
        prefix = b.text[:n]
        prompt = prefix + b.text[o:o + a.suffix]
        b.populate(prefix)
        b.set_link(None)
        for m in ("recompute", "load"):  # untimed: one-off costs
            b.run(prompt, m, 1.0, "lossless")
        t_rec = statistics.median(b.run(prompt, "recompute", 1.0, "lossless")["ttft_s"] for _ in range(2))
        nbytes = (n // a.chunk * a.chunk) * L * b.r.plain_bytes_per_token
        balance[n] = {"t_recompute_s": t_rec, "bytes": nbytes, "balance_gbps": nbytes * 8 / 1e9 / t_rec}
        slo = a.slo_frac * t_rec
        for g in a.gbps:
            link = g if gpu else balance[n]["balance_gbps"] * g / (10.0 * H200_RATIO_10G)
            links[(g, n)] = link
            b.set_link(link)
            b.run(prompt, "load", 1.0, "lossless")  # the link's rate, learnt online: alone and beside a replay
            b.run(prompt, "cacheflow", 1.0, "lossless")
            for rep in range(a.reps):
                for row in b.cell(prompt, a.min_quality, slo):
                    rows.append({**row, "gbps": g, "link_gbps": link, "tokens": n, "rep": rep, "slo_s": slo})
            s = summarize([r for r in rows if r["gbps"] == g and r["tokens"] == n])
            print(f"{n:>6} tokens, {g:g} Gbps{'' if gpu else f' (= {link * 1e3:.1f} Mbps)'}: " + ", ".join(
                f"{x['method']} {x['ttft_median_s'] * 1e3:.0f} ms ({x['speedup_vs_recompute']:.2f}x)" for x in s),
                flush=True)
            if a.partial:  # rows so far, for a run that may be stopped before its end
                Path(a.partial).write_text(json.dumps({"balance": balance, "rows": rows}))
    summary = summarize(rows)
    g = goals(summary, a.min_quality)
    print(json.dumps(g, indent=1))
    tag = f"{a.model.replace(':', '_')}_{a.device.split(':')[0]}"
    out = Path(a.out_dir) / f"restore_remote_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"when": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if gpu else None, "model": a.model,
            "random_weights": a.model.startswith("random:"), "real_kv": a.real_kv,
            "profiles": a.profiles, "profile_table": a.table, "quality": "the table's relative next-token accuracy "
            "(real models), not measured here", "min_quality": a.min_quality, "slo": f"{a.slo_frac} x recompute TTFT",
            "links": "CPU: B* x g / 25.6 (T_load / T_recompute of the 8B shape on an H200 at g Gbps); GPU: g Gbps"
            if not gpu else "token bucket at g Gbps on the store's load path", "balance": balance,
            "command": " ".join(sys.argv)}
    report.write(out, {"meta": meta, "goals": g, "summary": summary, "rows": rows}, draw, argv)
    print(f"wrote {out}")
    b.r.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
