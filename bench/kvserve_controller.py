"""KVServe online half: controller choices under a bandwidth trace swinging between 5 and 100 Gbps.

For each profile table written by bench/kvserve_profiles.py (real models, real text, measured ratios and
quality), a seeded trace of requests (log-space random walk + step changes, clipped to [5, 100] Gbps) is
replayed. Policies: the oracle (knows the true bandwidth and the true, drifted throughputs), ``select``
(analytical, offline throughputs, measured bandwidth), the ``OnlineController`` (envelope + epsilon-greedy
on EWMA residuals, fed simulated observed times with noise and drift), and every static profile incl. BF16.
Reported latency is the true expected KV time (coding + wire, no model time) of each choice.

Throughput scenarios: ``cpu-measured`` uses the tables' throughputs as measured by this CPU's numpy
pipelines (tens of MB/s: compression cannot pay off at >= 5 Gbps, the controller must see that);
``gpu-measured`` takes each profile's encode and decode rates as bench/kvserve_gpu.py measured them on the H200
(``--gpu-rates``; every stage on the GPU, the entropy stage its nvCOMP one), ratio and quality as profiled;
profiles that run was not given are left out (counted in the JSON). Drift: offline-to-online mismatch per
profile (log-normal, fixed) and a contention episode in the middle third that halves every coding throughput.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import report  # noqa: E402
from kvtide.transfer.controller import BF16, Profile, select
from kvtide.transfer.online import OnlineConfig, OnlineController
from kvtide.transfer.table import load_profiles

RESULTS = Path(__file__).resolve().parent / "results"
GBPS = 1e9 / 8  # bytes/s in one Gbit/s


@dataclass(frozen=True)
class TraceConfig:
    requests: int = 600
    lo_gbps: float = 5.0
    hi_gbps: float = 100.0
    walk_sigma: float = 0.08  # per-request log-bandwidth step
    step_prob: float = 0.02  # chance of a step change (re-route, competing flow) per request
    measure_noise: float = 0.05  # relative error of the bandwidth estimate the controller sees
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1 or not 0 < self.lo_gbps < self.hi_gbps or self.walk_sigma < 0:
            raise ValueError(f"bad trace config {self}")
        if not 0 <= self.step_prob <= 1 or self.measure_noise < 0:
            raise ValueError(f"bad trace config {self}")


def bandwidth_trace(cfg: TraceConfig) -> list[float]:
    """Gbps per request: log-space random walk with occasional jumps to a uniformly drawn log-level."""
    rng = random.Random(cfg.seed)
    lo, hi = math.log(cfg.lo_gbps), math.log(cfg.hi_gbps)
    x, out = (lo + hi) / 2, []
    for _ in range(cfg.requests):
        if rng.random() < cfg.step_prob:
            x = rng.uniform(lo, hi)
        x = min(hi, max(lo, x + rng.gauss(0, cfg.walk_sigma)))
        out.append(math.exp(x))
    return out


def gpu_measured(profiles: list[Profile], rows: dict[str, dict]) -> tuple[list[Profile], list[str]]:
    """The profiles with the GPU's measured coding rates (by device spec), and the specs the GPU run lacks.
    BF16 (no coding) is kept as it is."""
    from bench.kvserve_gpu import device_spec

    out, missing = [], []
    for p in profiles:
        if math.isinf(p.throughput):
            out.append(p)
            continue
        spec = device_spec(p.name, nv=True)
        r = rows.get(spec)
        if r is None:
            missing.append(p.name)
            continue
        out.append(Profile(spec, p.ratio, r["encode_Bps"], r["decode_Bps"], p.quality))
    return out, missing


def true_time(p: Profile, bw: float, volume: float, mult: float) -> float:
    """Expected KV time when coding runs ``mult`` times the profiled throughput (BF16 has no coding)."""
    coding = 0.0 if math.isinf(p.throughput) else volume / (p.throughput * mult)
    return coding + volume / (p.ratio * bw)


def simulate(profiles: list[Profile], gbps: list[float], volume: float, min_quality: float,
             cfg: TraceConfig, drift_sigma: float, contention: float, obs_noise: float,
             epsilons: tuple[float, ...] = (0.1, 0.02)) -> dict:
    rng = random.Random(cfg.seed + 1)
    feas = [p for p in profiles if p.quality >= min_quality]
    mismatch = {p.name: math.exp(rng.gauss(0, drift_sigma)) for p in feas}
    mismatch[BF16.name] = 1.0
    n = len(gbps)

    def mult(p: Profile, t: int) -> float:
        return mismatch.get(p.name, 1.0) * (contention if n // 3 <= t < 2 * n // 3 else 1.0)

    onl = {("online" if i == 0 else f"online_eps{e:g}"): OnlineController(feas, OnlineConfig(epsilon=e, seed=cfg.seed))
           for i, e in enumerate(epsilons)}
    statics = {p.name: [] for p in feas + [BF16]}
    res = {k: [] for k in ("oracle", "select", *onl)}
    choice = {k: [] for k in res}
    decide_s = []
    for t, g in enumerate(gbps):
        bw = g * GBPS
        seen = bw * max(0.05, 1 + rng.gauss(0, cfg.measure_noise))
        truth = {p.name: true_time(p, bw, volume, mult(p, t)) for p in feas + [BF16]}
        for k, v in truth.items():
            statics[k].append(v)
        best = min(truth, key=truth.get)
        res["oracle"].append(truth[best])
        choice["oracle"].append(best)
        s = select(feas, seen, volume, None, min_quality)
        res["select"].append(truth[s.name])
        choice["select"].append(s.name)
        noise = math.exp(rng.gauss(0, obs_noise))
        for k, ctl in onl.items():
            t0 = time.perf_counter()
            d = ctl.decide(seen, volume, None, min_quality)
            decide_s.append(time.perf_counter() - t0)
            res[k].append(truth[d.profile.name])
            choice[k].append(d.profile.name)
            ctl.observe(d, truth[d.profile.name] * noise)
    decide_s.sort()
    return {"latency": res, "static": statics, "choice": choice, "decide_ms_max": 1e3 * decide_s[-1],
            "decide_ms_p99": 1e3 * decide_s[int(0.99 * (len(decide_s) - 1))],
            "decide_ms_mean": 1e3 * statistics.fmean(decide_s), "feasible_profiles": [p.name for p in feas]}


def summarise(sim: dict, gbps: list[float], high_gbps: float) -> dict:
    lat, st = sim["latency"], sim["static"]
    bf = st[BF16.name]
    hi = [i for i, g in enumerate(gbps) if g >= high_gbps]
    mean = {k: statistics.fmean(v) for k, v in lat.items()}
    smean = {k: statistics.fmean(v) for k, v in st.items()}
    best_static = min(smean, key=smean.get)
    out = {"mean_latency_s": mean, "static_mean_latency_s": smean, "best_static": best_static,
           "vs_oracle": {k: v / mean["oracle"] for k, v in mean.items()},
           "best_static_vs_oracle": smean[best_static] / mean["oracle"],
           "bf16_vs_oracle": smean[BF16.name] / mean["oracle"],
           "high_bandwidth": {"threshold_gbps": high_gbps, "requests": len(hi)}}
    for k in lat:
        if hi and k != "oracle":
            r = [lat[k][i] / bf[i] for i in hi]
            out["high_bandwidth"][k] = {"mean_vs_bf16": statistics.fmean(r), "max_vs_bf16": max(r),
                                        "requests_worse_than_bf16_by_2pct": sum(x > 1.02 for x in r),
                                        "ok_mean_within_2pct": statistics.fmean(r) <= 1.02}
    out["distinct_choices"] = {k: len(set(v)) for k, v in sim["choice"].items()}
    return out


def draw(doc: dict, plt):
    """Headline figure (the PNG beside the JSON)."""
    key = doc["plot_key"]
    run = doc["runs"][key]
    g = doc["trace_gbps"]
    fig, ax = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    ax[0].plot(g, c="k", lw=0.8)
    ax[0].set_ylabel("bandwidth (Gbps)")
    ax[0].set_yscale("log")
    lat = run["sim"]["latency"]
    for k in ("oracle", "select", "online"):
        ax[1].plot([1e3 * x for x in lat[k]], lw=0.8, label=k)
    ax[1].plot([1e3 * x for x in run["sim"]["static"]["bf16"]], lw=0.8, ls="--", label="bf16")
    bs = run["summary"]["best_static"]
    ax[1].plot([1e3 * x for x in run["sim"]["static"][bs]], lw=0.8, ls=":", label=f"best static: {bs[:40]}")
    ax[1].set_ylabel("KV latency (ms)")
    ax[1].set_yscale("log")
    ax[1].legend(fontsize=7)
    names = sorted(set(run["sim"]["choice"]["oracle"]) | set(run["sim"]["choice"]["online"]))
    idx = {n: i for i, n in enumerate(names)}
    ax[2].scatter(range(len(g)), [idx[n] for n in run["sim"]["choice"]["online"]], s=3, label="online")
    ax[2].scatter(range(len(g)), [idx[n] + 0.2 for n in run["sim"]["choice"]["oracle"]], s=3, label="oracle")
    ax[2].set_yticks(range(len(names)), [n[:48] for n in names], fontsize=6)
    ax[2].set_xlabel("request")
    ax[2].legend(fontsize=7)
    ax[0].set_title(f"kvserve controller: {key} ({doc['env']['date'][:10]}; contention in middle third)", fontsize=9)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", default=str(RESULTS / "kvserve_profiles.json"))
    ap.add_argument("--context", type=int, default=8192, help="tokens of KV per request")
    ap.add_argument("--min-quality", type=float, default=0.97)
    ap.add_argument("--gpu-rates", default=str(RESULTS / "kvserve_gpu_h200.json"),
                    help="bench/kvserve_gpu.py JSON: the gpu-measured scenario's coding rates")
    ap.add_argument("--drift-sigma", type=float, default=0.3)
    ap.add_argument("--contention", type=float, default=0.5)
    ap.add_argument("--obs-noise", type=float, default=0.05)
    ap.add_argument("--high-gbps", type=float, default=80.0)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "kvserve_controller.json"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    prof_doc = json.loads(Path(args.profiles).read_text())
    tcfg = TraceConfig(requests=args.requests, seed=args.seed)
    gbps = bandwidth_trace(tcfg)
    doc = {"bench": "kvserve_controller", "env": {"date": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
           "os": platform.platform(), "profiles_from": args.profiles, "profiles_date": prof_doc["env"]["date"],
           "weights": "real (bundled) for the profile tables; latencies are model predictions, no network used"},
           "args": vars(args), "trace": vars(tcfg), "trace_gbps": gbps, "runs": {}}
    gpu_path = Path(args.gpu_rates)
    gpu_doc = json.loads(gpu_path.read_text()) if gpu_path.exists() else None
    gpu_rows = {r["spec"]: r for r in gpu_doc["rows"] if "error" not in r} if gpu_doc else {}
    if gpu_doc:
        doc["env"]["gpu_rates_from"] = {"file": args.gpu_rates, "device": gpu_doc.get("device"),
                                        "kv": gpu_doc.get("kv"), "nvcomp": gpu_doc.get("nvcomp")}
    for run in prof_doc["runs"]:
        table = Path(RESULTS.parent.parent / run["table"])
        profiles = load_profiles(table)
        per_token = run["shape"]["request_kv_bytes"] / run["shape"]["request_kv_shape"][2]
        volume = per_token * args.context
        scenarios = [("cpu-measured", profiles, [])]
        if gpu_rows:
            scenarios.append(("gpu-measured", *gpu_measured(profiles, gpu_rows)))
        for scen, ps, missing in scenarios:
            finite = sorted(p.throughput for p in ps if math.isfinite(p.throughput))
            sim = simulate(ps, gbps, volume, args.min_quality, tcfg, args.drift_sigma, args.contention, args.obs_noise)
            key = f"{run['model']}/{run['workload']}/{scen}"
            doc["runs"][key] = {"table": run["table"], "volume_bytes": volume, "profiles": len(ps),
                                "profiles_without_gpu_rates": missing,
                                "median_profile_throughput_GBps": statistics.median(finite) / 1e9 if finite else None,
                                "summary": summarise(sim, gbps, args.high_gbps), "sim": sim}
            s = doc["runs"][key]["summary"]
            hb = s["high_bandwidth"]
            print(f"{key}: vs oracle select {s['vs_oracle']['select']:.3f} online {s['vs_oracle']['online']:.3f} "
                  f"best static {s['best_static_vs_oracle']:.3f} ({s['best_static'][:40]}) bf16 {s['bf16_vs_oracle']:.3f}"
                  f" | >= {args.high_gbps:g} Gbps vs bf16: select {hb.get('select', {}).get('mean_vs_bf16', float('nan')):.3f}"
                  f" online {hb.get('online', {}).get('mean_vs_bf16', float('nan')):.3f}"
                  f" | online eps 0.02 vs oracle {s['vs_oracle'].get('online_eps0.02', float('nan')):.3f}"
                  f" | decide p99 {sim['decide_ms_p99']:.3f} ms", flush=True)
    gpu = [k for k in doc["runs"] if k.endswith("gpu-measured")]
    doc["plot_key"] = gpu[0] if gpu else next(iter(doc["runs"]))
    doc["summary"] = {k: {"select_vs_oracle": v["summary"]["vs_oracle"]["select"],
                          "online_vs_oracle": v["summary"]["vs_oracle"]["online"],
                          "online_eps0.02_vs_oracle": v["summary"]["vs_oracle"].get("online_eps0.02"),
                          "decide_ms_p99": v["sim"]["decide_ms_p99"],
                          "best_static_vs_oracle": v["summary"]["best_static_vs_oracle"],
                          "bf16_vs_oracle": v["summary"]["bf16_vs_oracle"],
                          "high_bw_online_mean_vs_bf16": v["summary"]["high_bandwidth"].get("online", {}).get("mean_vs_bf16"),
                          "high_bw_select_mean_vs_bf16": v["summary"]["high_bandwidth"].get("select", {}).get("mean_vs_bf16")}
                      for k, v in doc["runs"].items()}
    doc["seconds"] = round(time.perf_counter() - t0, 2)
    out = Path(args.out)
    report.write(out, doc, draw, argv)
    print(f"wrote {out} and {out.with_suffix('.png')} ({doc['seconds']} s)")


if __name__ == "__main__":
    main()
