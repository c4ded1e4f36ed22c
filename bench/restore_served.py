"""CacheFlow restoration beside decoding: N requests decode while M long-prefix requests are restored at a link rate.

Four scenarios per rep, in rotating order, in one process on one engine, store and link (kvtide issue 39):

- ``decode``: the N decoders alone: their TPOT without restorations.
- ``isolated``: the M restorations alone (nothing else runs, so the restoration runs to its end at once, as it always
  did): the isolated CacheFlow TTFT.
- ``blocking``: decoders running when the M arrive, ``RestoreConfig.step_fraction=None``: the restoration runs in
  the step it starts and every decoder waits for it (the behaviour before interleaving).
- ``interleaved``: the same with ``step_fraction`` (``--step-fraction``, 0.5): the restoration runs in quanta beside the decode
  steps, its loads in the background.

Reported: decoders' TPOT p50/p99 over the steps from the restorers' arrival to their last first token, against the
``decode`` scenario's over as many steps; the restorers' TTFT (median) against ``isolated``. Medians over reps and
their spread (min, max).

CPU (default): a bundled real model, small shapes, and a link scaled the way bench/restore.py scales its "10
Gbps-equivalent" trace link: loading a token takes ``--link-ratio`` (2.56) times recomputing it, the ratio of a
Llama-3.1-8B shape on an H200 at 10 Gbps. CUDA: the link is unscaled (``--gbps``, default 10).

    python bench/restore_served.py                          # CPU, ~2 min
    python bench/restore_served.py --device cuda --model random:llama3-8b --restorers 8 --decoders 32 \\
        --prefix 8192 --gbps 10 --codec zip                 # the H200 run (RANDOM weights)
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import report  # noqa: E402
from kvtide import CacheConfig, SamplingParams, SchedulerConfig  # noqa: E402
from kvtide.config import RestoreConfig  # noqa: E402
from kvtide.engine.llm import LLM  # noqa: E402
from kvtide.store.bandwidth import BandwidthLimitedStore, gbps  # noqa: E402
from kvtide.store.memory import MemoryStore  # noqa: E402

SCENARIOS = ("decode", "isolated", "blocking", "interleaved")


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    g = np.random.default_rng(seed)
    return [int(t) for t in g.integers(100, min(vocab, 30000), n)]


def _pct(v: list[float], p: float) -> float:
    return float(np.percentile(v, p)) if v else float("nan")


class Served:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        gpu = a.device.startswith("cuda")
        self.llm = LLM(a.model, device=a.device, progress=False, cuda_graphs=bool(a.cuda_graphs),
                       cache=CacheConfig(kv_dtype="bfloat16", enable_prefix_caching=False,
                                         **({"num_pages": a.num_pages} if a.num_pages else {})),
                       scheduler=SchedulerConfig(max_num_seqs=a.decoders + a.restorers + 4,
                                                 max_num_batched_tokens=a.max_batched_tokens),
                       restore=RestoreConfig(store="memory", memory_bytes=a.store_gb << 30, chunk_tokens=a.chunk,
                                             max_batch=a.restorers, store_codec=a.codec,
                                             step_fraction=a.step_fraction))
        self.eng = self.llm.engine
        self.r = self.eng.restorer
        self.inner = self.r.store
        self.vocab = self.eng.model.args.vocab_size
        self.gpu = gpu
        self.rid = 0

    def _id(self, tag: str) -> str:
        self.rid += 1
        return f"{tag}-{self.rid}"

    def populate(self) -> None:
        """The restorers' prefixes prefilled once (untimed): their chunks go to the store; then writes stop."""
        self.prefixes = [_tokens(self.a.prefix, 1000 + i, self.vocab) for i in range(self.a.restorers)]
        for p in self.prefixes:
            self.llm.generate(p, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        self.r.writer.flush()
        self.r.cfg.write_on_finish = False
        self.r.cfg.spill = False

    def measure_recompute(self) -> float:
        """Seconds per token of a plain prefill of one prefix (no restoration)."""
        r, self.eng.restorer = self.eng.restorer, None
        try:
            ids = _tokens(self.a.prefix, 7, self.vocab)
            best = float("inf")
            for _ in range(2):
                t0 = time.perf_counter()
                self.llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
                best = min(best, time.perf_counter() - t0)
        finally:
            self.eng.restorer = r
        return best / self.a.prefix

    def set_link(self, g: float) -> None:
        self.r.use_store(BandwidthLimitedStore.at_gbps(self.inner, g), writes=self.inner)
        self.r.cfg.bandwidth_gbps = g
        self.r.cfg.write_on_finish = False

    def scenario(self, kind: str, rep: int) -> dict:
        a, eng = self.a, self.eng
        self.r.cfg.step_fraction = None if kind == "blocking" else a.step_fraction
        times: dict[str, list[float]] = {}
        decoders = []
        if kind != "isolated":
            for i in range(a.decoders):
                rid = self._id("dec")
                eng.add_request(_tokens(a.decoder_prompt, 5000 + 97 * rep + i, self.vocab),
                                SamplingParams(temperature=0.0, max_tokens=a.decode_tokens, ignore_eos=True),
                                request_id=rid)
                decoders.append(rid)
            for _ in range(a.warm_steps):  # prefilled and in steady decoding
                self._step(times)
        window = (0.0, 0.0)
        ttft = []
        if kind != "decode":
            rest = []
            for i, p in enumerate(self.prefixes):
                rid = self._id("rst")
                eng.add_request(p + _tokens(a.suffix, 9000 + 31 * rep + i, self.vocab),
                                SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), request_id=rid)
                rest.append(rid)
            t0 = time.perf_counter()
            steps = 0
            while any(r not in times for r in rest) and steps < 100_000:
                self._step(times)
                steps += 1
            window = (t0, time.perf_counter())
            ttft = [times[r][0] - t0 for r in rest]
        else:
            t0 = time.perf_counter()
            for _ in range(a.decode_steps):
                self._step(times)
            window = (t0, time.perf_counter())
        gaps = []
        for d in decoders:
            ts = times.get(d, [])
            gaps += [b - x for x, b in zip(ts, ts[1:]) if b > window[0] and x < window[1]]
        for d in decoders:
            eng.abort(d)
        while eng.has_unfinished():
            eng.step()
        rec = self.r.history[-1] if kind in ("blocking", "interleaved", "isolated") and self.r.history else None
        return {"scenario": kind, "rep": rep, "tpot_p50_s": _pct(gaps, 50), "tpot_p99_s": _pct(gaps, 99),
                "tpot_max_s": max(gaps) if gaps else None, "decode_gaps": len(gaps),
                "ttft_median_s": statistics.median(ttft) if ttft else None, "ttft_s": ttft,
                "window_s": window[1] - window[0],
                "restoration": None if rec is None or kind == "decode" else {
                    "advances": rec.advances, "paused_s": rec.paused_seconds, "total_s": rec.total_seconds,
                    "predicted_s": rec.predicted_seconds, "load_bytes": rec.load_bytes,
                    "boundaries_first_request": rec.boundaries[0] if rec.boundaries else None}}

    def _step(self, times: dict[str, list[float]]) -> None:
        outs = self.eng.step()
        now = time.perf_counter()
        for o in outs:
            times.setdefault(o.request_id, []).extend([now] * len(o.new_token_ids))


def summarize(rows: list[dict]) -> dict:
    by = {k: [r for r in rows if r["scenario"] == k] for k in SCENARIOS}

    def med(k: str, f: str) -> tuple[float, float, float]:
        v = [r[f] for r in by[k] if r[f] is not None]
        return (statistics.median(v), min(v), max(v)) if v else (float("nan"),) * 3

    out = {k: {f: med(k, f) for f in ("tpot_p50_s", "tpot_p99_s", "ttft_median_s")} for k in SCENARIOS}
    base99, iso = out["decode"]["tpot_p99_s"][0], out["isolated"]["ttft_median_s"][0]
    for k in ("blocking", "interleaved"):
        out[k]["tpot_p99_vs_decode"] = out[k]["tpot_p99_s"][0] / base99
        out[k]["ttft_vs_isolated"] = out[k]["ttft_median_s"][0] / iso
    out["goals"] = {"interleaved_tpot_p99_within_1.5x": out["interleaved"]["tpot_p99_vs_decode"] <= 1.5,
                    "interleaved_ttft_within_10pct_of_isolated": out["interleaved"]["ttft_vs_isolated"] <= 1.10}
    return out


def draw(doc: dict, plt):
    s = doc["summary"]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    ks = ["decode", "blocking", "interleaved"]
    ax[0].bar(ks, [s[k]["tpot_p99_s"][0] * 1e3 for k in ks])
    ax[0].set_ylabel("decoders' TPOT p99 (ms)")
    ks = ["isolated", "blocking", "interleaved"]
    ax[1].bar(ks, [s[k]["ttft_median_s"][0] for k in ks])
    ax[1].set_ylabel("restorers' TTFT median (s)")
    fig.suptitle(doc["meta"]["title"], fontsize=9)
    return fig


def write(a: argparse.Namespace, argv: list[str] | None, per_token: float, rows: list[dict]) -> dict:
    """The JSON and PNG of the reps so far; returns their summary."""
    gpu = a.device.startswith("cuda")
    s = summarize(rows)
    random_w = a.model.startswith("random:")
    doc = {"meta": {"title": f"{a.model} ({'RANDOM weights' if random_w else 'real weights'}) on {a.device}: "
                             f"{a.decoders} decoders, {a.restorers} restorers x {a.prefix}, {a.gbps:.3g} Gbps",
                    "machine": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(),
                    "gpu": torch.cuda.get_device_name() if gpu else None, "model": a.model, "random_weights": random_w,
                    "kv_dtype": "bfloat16", "codec": a.codec, "link_gbps": a.gbps,
                    "link": ("unscaled" if gpu or "--gbps" in (argv or sys.argv) else
                             f"scaled: load/recompute time per token = {a.link_ratio}"),
                    "recompute_s_per_token": per_token, "args": vars(a)},
           "summary": s, "rows": rows}
    tag = f"{a.model.replace(':', '_')}_{a.device.split(':')[0]}{'_' + a.codec if a.codec else ''}"
    report.write(Path(a.out_dir) / f"restore_served_{tag}.json", doc, draw, argv)
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--restorers", type=int, default=None, help="long-prefix requests restored (CPU 4, CUDA 8)")
    ap.add_argument("--decoders", type=int, default=None, help="requests decoding meanwhile (CPU 8, CUDA 32)")
    ap.add_argument("--prefix", type=int, default=None, help="restored prefix tokens (CPU 512, CUDA 8192)")
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--decoder-prompt", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=4000, help="decoders' max_tokens (aborted when done)")
    ap.add_argument("--decode-steps", type=int, default=None, help="steps measured in the decode scenario")
    ap.add_argument("--warm-steps", type=int, default=4)
    ap.add_argument("--gbps", type=float, default=None, help="link; default CUDA 10, CPU scaled (--link-ratio)")
    ap.add_argument("--link-ratio", type=float, default=2.56, help="CPU: load/recompute time per token of the link")
    ap.add_argument("--step-fraction", type=float, default=0.5)
    ap.add_argument("--codec", choices=["zip"], default=None)
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--store-gb", type=int, default=None)
    ap.add_argument("--num-pages", type=int, default=None)
    ap.add_argument("--max-batched-tokens", type=int, default=None)
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    a = ap.parse_args(argv)
    gpu = a.device.startswith("cuda")
    for k, cpu, cuda in (("restorers", 4, 8), ("decoders", 8, 32), ("prefix", 512, 8192), ("chunk", 64, 512),
                         ("store_gb", 2, 64), ("max_batched_tokens", 4096, 32768), ("decode_steps", 12, 60)):
        if getattr(a, k) is None:
            setattr(a, k, cuda if gpu else cpu)
    if a.cuda_graphs is None:
        a.cuda_graphs = gpu
    if a.threads is None and not gpu:
        a.threads = 1
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.reps < 1 or not 0 < a.step_fraction:
        ap.error("--reps must be >= 1 and --step-fraction > 0")
    b = Served(a)
    b.populate()
    per_token = b.measure_recompute()
    L = b.eng.model.args.num_layers
    if a.gbps is None:
        a.gbps = 10.0 if gpu else b.r.bytes_per_token * L / (a.link_ratio * per_token) * 8 / 1e9
    b.set_link(a.gbps)
    print(f"restore-served: {a.model} on {a.device}, {a.decoders} decoders, {a.restorers} restorers x {a.prefix} "
          f"tokens, link {a.gbps:.4g} Gbps, recompute {per_token * 1e3:.3f} ms/token, step_fraction {a.step_fraction}")
    for kind in SCENARIOS:  # one-off costs (graphs, profile's first runs) outside the timed reps
        b.scenario(kind, -1)
    rows = []
    for rep in range(a.reps):
        order = SCENARIOS[rep % 4:] + SCENARIOS[:rep % 4]
        for kind in order:
            row = b.scenario(kind, rep)
            rows.append(row)
            print(f"  rep {rep} {kind:11s} TPOT p50 {row['tpot_p50_s'] * 1e3:7.1f} ms p99 "
                  f"{row['tpot_p99_s'] * 1e3:7.1f} ms  TTFT {row['ttft_median_s'] or float('nan'):.3f} s")
        s = write(a, argv, per_token, rows)  # after every rep: a run cut short keeps its finished reps
    for k in ("blocking", "interleaved"):
        print(f"{k}: TPOT p99 {s[k]['tpot_p99_vs_decode']:.2f}x decode alone, TTFT {s[k]['ttft_vs_isolated']:.2f}x "
              "isolated")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
