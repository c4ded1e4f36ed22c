"""Prefill/decode disaggregation benchmark (KVServe section 7.2, Fig. 15/16): job completion time of a request whose
KV crosses from a prefill to a decode instance, per compression method and bandwidth, and the controller under a
drifting bandwidth.

Two `kvtide serve` processes (``--role prefill`` / ``--role decode``), KV over the Mooncake Transfer Engine (TCP).
The link (``--link``): ``tc`` (default where the kernel allows it) runs the benchmark, both servers and their
traffic inside a network namespace of its own whose loopback is shaped by a tc token bucket filter, set per
bandwidth: a real, kernel-enforced limit; ``pace`` is the prefill side's own sender token bucket (``/v1/kv/link``). The benchmark is its own
proxy, so each leg is timed: JCT = prefill leg + decode leg; the decode leg's answer says how its hand-off went
(sender's encode and write seconds, the decode side's decode seconds and overall span), which gives the breakdown
prefill / compress / transfer / decompress / decode (the three middle stages overlap, layer by layer, so their sum
exceeds the hand-off's span). Methods: BF16 (none), CacheGen-like, KIVI-2bit, the best fixed profile of the table
(lowest modelled mean time over the bandwidths at >= the quality floor) and the controller (the prefill side's
policy at ``--min-quality``); all on the same instances, the same prompts (a fresh header per run so no cache
serves them), interleaved, ``--reps`` each. Quality is the profiled relative next-token accuracy of each profile
on the real models (the KVServe table and `kvtide bench kvserve-profiles`).

On the CPU (a bundled real model) bandwidths are scaled to this machine's compute rate: a nominal B Gbps becomes
the rate at which moving this model's BF16 KV takes the same multiple of its prefill time as moving a
Llama-3.1-8B's KV at B Gbps takes of its prefill on an H200 (131 KiB/token, 0.041 ms/token of prefill; the same
scaling as bench/restore.py). ``--trace``: the controller, an oracle that knows each request's bandwidth, and the
paper's two ablations (no bandwidth model: a fixed guess; no bandwidth correction: measured bandwidth, no
residual learning) over one drifting bandwidth sequence (5-100 Gbps nominal), real transfers. Each arm keeps its
own decision state: its transfers go under a policy key of its own (``kv_transfer.policy_key``), so the prefill
side's goodput meter and residuals for the controller arm see only the controller's transfers, and the bench-side
arms' meters and residuals see only their own.

    kvtide bench pd                       # CPU, SmolLM2-135M, ~10 min
    kvtide bench pd --trace-requests 0    # the bandwidth table only
"""
from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import report  # noqa: E402

from kvtide.benchmarks.procs import RESULTS_DIR, free_port, wait_ready  # noqa: E402
from kvtide.transfer.baselines import BF16, CACHEGEN, KIVI_2BIT  # noqa: E402
from kvtide.transfer.controller import Profile  # noqa: E402
from kvtide.transfer.online import OnlineConfig, OnlineController  # noqa: E402
from kvtide.transfer.pipeline import Pipeline  # noqa: E402
from kvtide.transfer.policy import measured_lossless, packaged_table, spec_of, table_profiles  # noqa: E402
from kvtide.transfer.transport.pacing import GoodputMeter  # noqa: E402

KV_8B = 32 * 2 * 8 * 128 * 2  # bytes of BF16 KV per token, Llama-3.1-8B
PREFILL_8B_H200 = 0.041e-3  # seconds of prefill per token, 8B shape on an H200 (bench/restore.py)
BANDWIDTHS = (5.0, 10.0, 25.0, 50.0, 100.0)
TEXT = ("The committee met on Tuesday to review the budget, the schedule and the staffing plan for the coming year. "
        "Each department presented its figures, and the discussion turned to the cost of the new building, the "
        "delays in procurement and the training programme for the staff who would move there. ")


def gbps_bytes(g: float) -> float:
    return g * 1e9 / 8


class Cluster:
    """A prefill and a decode `kvtide serve` process (Mooncake TCP), their logs in ``logdir``."""

    def __init__(self, a: argparse.Namespace, logdir: Path):
        self.a = a
        self.ports = [free_port(), free_port()]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.procs: list[subprocess.Popen] = []
        self.logs = [logdir / "pd_prefill.log", logdir / "pd_decode.log"]
        self.http = httpx.Client(timeout=600)

    def __enter__(self) -> "Cluster":
        a = self.a
        common = ["--model", a.model, "--device", a.device, "--log-level", "warning"]
        if a.num_pages:
            common += ["--num-pages", str(a.num_pages)]
        for extra in a.serve_arg:
            common += extra.split()
        pacing = ["--kv-pacing-gbps", "100"] if a.link == "pace" else []
        roles = [["--role", "prefill", *pacing, "--kv-profiles", str(a.profiles)],
                 ["--role", "decode", "--kv-transfer-timeout", "600", "--kv-accept-lossy"]]
        for port, url, log, role in zip(self.ports, self.urls, self.logs, roles):
            cmd = [sys.executable, "-m", "kvtide.cli", "serve", *common, "--port", str(port), "--advertise-url", url,
                   *role]
            env = {"KVTIDE_SERVER_LOG_STATS_INTERVAL_S": "0", "KVTIDE_RESTORE_MEMORY_BYTES": str(a.store_bytes),
                   "KVTIDE_RESTORE_STORE": a.store}
            self.procs.append(subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                               env={**os.environ, **env}))
        for p, u, log in zip(self.procs, self.urls, self.logs):
            wait_ready(p, u, a.start_timeout, log)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.http.close()
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()

    def set_link(self, emulated_gbps: float) -> None:
        if self.a.link == "tc":  # this namespace's loopback: every byte between the instances crosses it
            rate = int(emulated_gbps * 1e9)
            burst = max(256 << 10, rate // 8 // 1000)  # >= 1 ms of traffic and several 64 KiB loopback packets
            subprocess.run(["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", f"{rate}bit", "burst",
                            str(burst), "latency", "200ms"], check=True, capture_output=True)
            return
        r = self.http.post(self.urls[0] + "/v1/kv/link", json={"pacing_gbps": emulated_gbps})
        r.raise_for_status()

    def run(self, prompt: list[int], kv_transfer: dict[str, Any]) -> dict[str, Any]:
        """One request through both legs; its JCT and breakdown."""
        a = self.a
        t0 = time.perf_counter()
        r = self.http.post(self.urls[0] + "/v1/completions", json={
            "prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}})
        r.raise_for_status()
        t1 = time.perf_counter()
        params = r.json()["kv_transfer_params"]
        r = self.http.post(self.urls[1] + "/v1/completions", json={
            "prompt": prompt, "max_tokens": a.output_tokens, "temperature": 0, "ignore_eos": True,
            "kv_transfer_params": params, "kv_transfer": kv_transfer})
        r.raise_for_status()
        t2 = time.perf_counter()
        kv = r.json()["kv_transfer"]
        if not kv.get("used"):
            raise RuntimeError(f"the hand-off was not used: {kv}")
        s = kv["sender"]
        prefill, decode_leg = t1 - t0, t2 - t1
        return {"jct": t2 - t0, "prefill": prefill, "compress": s["encode_s"], "transfer": s["write_s"],
                "sender_total": s["total_s"], "wire_span": s.get("wire_span_s") or s["write_s"],
                "assumed_bandwidth": kv.get("bandwidth"),
                "decompress": kv["decode_seconds"], "handoff": kv["seconds"], "decode": decode_leg - kv["seconds"],
                "profile": kv["profile"], "quality": kv["quality"], "wire_bytes": kv["wire_bytes"],
                "raw_bytes": kv["raw_bytes"], "ratio": kv["raw_bytes"] / max(1, kv["wire_bytes"]),
                "tokens": len(prompt), "restore": kv.get("restore")}


def restore_note(r: dict[str, Any]) -> str:
    """Where the decode leg's restoration went (it loads the handed-off KV from the decode side's tier)."""
    x = r.get("restore")
    if not x:
        return ""
    return (f" = restore {x['total_s']:.3f} [load {x['load_s']:.3f}, recompute {x['recompute_s']:.3f}, "
            f"wait {x['wait_s']:.3f}] + the rest")


class Prompts:
    """Token-id prompts of the requested lengths; ``fresh(i, k)`` prefixes a distinct header so no cache holds it."""

    def __init__(self, tok: Any, lengths: list[int], vocab_size: int, seed: int = 0):
        self.rng = random.Random(seed)
        self.vocab = vocab_size
        base = tok.encode(TEXT * 400) if tok is not None else []
        self.bodies = []
        for n in lengths:
            if len(base) >= n:
                start = self.rng.randrange(0, len(base) - n + 1)
                self.bodies.append(base[start:start + n])
            else:  # a random-weight model: any token ids
                self.bodies.append([self.rng.randrange(min(100, vocab_size // 2), vocab_size) for _ in range(n)])
        self.count = 0

    def fresh(self, i: int) -> list[int]:
        self.count += 1
        head = [(1000 + self.count) % self.vocab, (2000 + self.count // self.vocab) % self.vocab]
        body = self.bodies[i % len(self.bodies)]
        return head + body[len(head):]


def model_args(model: str) -> tuple[Any, Any]:
    """The model's shape (ModelArgs) and tokenizer (None for random weights), without loading its weights."""
    import json

    from kvtide.models.llama import ModelArgs
    from kvtide.models.loader import RANDOM_PRESETS, resolve_model_dir
    from kvtide.models.tokenizer import Tokenizer

    if model.startswith("random:"):
        return RANDOM_PRESETS[model.split(":", 1)[1]](), None
    d = resolve_model_dir(model, progress=False)
    return ModelArgs.from_hf_config(json.loads((d / "config.json").read_text())), Tokenizer(d)


def best_fixed(profiles: list[Profile], min_quality: float, bandwidths: list[float], volume: float) -> Profile:
    """The one profile (quality >= ``min_quality``) of least modelled mean time over ``bandwidths`` (bytes/s)."""
    ok = [p for p in profiles if p.quality >= min_quality and not Pipeline(spec_of(p)).lossless]
    return min(ok, key=lambda p: statistics.fmean(p.time(b, volume) for b in bandwidths))


def method_specs(a: argparse.Namespace, profiles: list[Profile], emulated: list[float], volume: float
                 ) -> dict[str, dict[str, Any]]:
    best = best_fixed(profiles, a.min_quality, [gbps_bytes(g) for g in emulated], volume)
    return {
        "bf16": {"profile": BF16},
        # on a GPU its rANS stage is nvCOMP's ANS (the CPU coder would time the host, not the method)
        "cachegen": {"profile": CACHEGEN.replace("|ans", "|nvans") if a.device.startswith("cuda") else CACHEGEN,
                     "min_quality": 0.0},
        "kivi-2bit": {"profile": KIVI_2BIT, "min_quality": 0.0},
        "best-fixed": {"profile": spec_of(best), "min_quality": 0.0},
        "controller": {"min_quality": a.min_quality},
    }


def scale_factor(a: argparse.Namespace, cluster: Cluster, prompts: Prompts, kv_per_token: int) -> dict[str, float]:
    """Emulated / nominal bandwidth: 1 on CUDA; on the CPU from this machine's measured prefill time per token."""
    if a.device.startswith("cuda"):
        return {"factor": 1.0}
    times = []
    for _ in range(3):
        p = prompts.fresh(0)
        t0 = time.perf_counter()
        cluster.http.post(cluster.urls[0] + "/v1/completions",
                          json={"prompt": p, "max_tokens": 1, "temperature": 0}).raise_for_status()
        times.append((time.perf_counter() - t0) / len(p))
    per_token = statistics.median(times)
    return {"factor": (kv_per_token / KV_8B) * (PREFILL_8B_H200 / per_token), "prefill_s_per_token": per_token}


def bandwidth_table(a: argparse.Namespace, cluster: Cluster, prompts: Prompts, methods: dict, factor: float) -> list:
    rows = []
    names = list(methods)
    for g in a.bandwidths:
        cluster.set_link(g * factor)
        cluster.run(prompts.fresh(0), {"profile": BF16})  # the goodput meter learns the new rate (not scored)
        for rep in range(a.reps):
            for i, name in enumerate(names[rep % len(names):] + names[:rep % len(names)]):
                for k in range(len(prompts.bodies)):
                    r = cluster.run(prompts.fresh(k), methods[name])
                    rows.append({"gbps": g, "emulated_gbps": g * factor, "method": name, "rep": rep, **r})
                    print(f"{g:6.1f} Gbps  {name:11s} rep {rep} len {r['tokens']:5d}: JCT {r['jct']:.3f} s "
                          f"(prefill {r['prefill']:.3f}, hand-off {r['handoff']:.3f}, decode {r['decode']:.3f}"
                          f"{restore_note(r)}) {r['profile']} x{r['ratio']:.2f}", flush=True)
    return rows


def summarise(rows: list[dict], bandwidths: list[float], min_quality: float = 0.97) -> dict:
    out: dict[str, Any] = {"per_bandwidth": {}}
    for g in bandwidths:
        by = {}
        for m in sorted({r["method"] for r in rows}):
            js = [r["jct"] for r in rows if r["gbps"] == g and r["method"] == m]
            if js:
                by[m] = {"median_jct": statistics.median(js), "min": min(js), "max": max(js), "n": len(js),
                         **{k: statistics.median(r[k] for r in rows if r["gbps"] == g and r["method"] == m)
                            for k in ("prefill", "compress", "transfer", "decompress", "decode", "handoff", "ratio")},
                         "quality": min((r["quality"] for r in rows if r["gbps"] == g and r["method"] == m
                                         and r["quality"] is not None), default=None)}
        best = min(v["median_jct"] for v in by.values())
        best_h = min(v["handoff"] for v in by.values())
        # the methods a request with this quality floor may use: a known quality at or above it
        eligible = [v["median_jct"] for v in by.values() if v["quality"] is not None and v["quality"] >= min_quality]
        ctl, bf = by.get("controller"), by.get("bf16")
        out["per_bandwidth"][str(g)] = {
            "methods": by, "best_median_jct": best,
            "controller_over_best": ctl["median_jct"] / best if ctl else None,
            "controller_over_best_at_quality": ctl["median_jct"] / min(eligible) if ctl and eligible else None,
            "bf16_over_controller": bf["median_jct"] / ctl["median_jct"] if ctl and bf else None,
            # the hand-off span alone (what the profile choice changes; prefill and decode legs add the same work)
            "handoff_controller_over_best": ctl["handoff"] / best_h if ctl else None,
            "handoff_bf16_over_controller": bf["handoff"] / ctl["handoff"] if ctl and bf else None,
        }
    pb = out["per_bandwidth"]
    lo, hi = str(min(bandwidths)), str(max(bandwidths))
    out["goals"] = {
        "controller_within_3pct_of_best_everywhere": all((v["controller_over_best"] or 9) <= 1.03 for v in pb.values()),
        "controller_worst_over_best": max((v["controller_over_best"] or 0) for v in pb.values()),
        "controller_worst_over_best_at_quality": max((v["controller_over_best_at_quality"] or 0) for v in pb.values()),
        "controller_over_bf16_at_highest": 1.0 / pb[hi]["bf16_over_controller"] if pb[hi]["bf16_over_controller"] else None,
        "speedup_over_bf16_at_lowest": pb[lo]["bf16_over_controller"],
    }
    return out


def drift(n: int, lo: float, hi: float, seed: int) -> list[float]:
    """Nominal Gbps per request: a log-space random walk between ``lo`` and ``hi`` with occasional jumps."""
    rng = random.Random(seed)
    x, out = (math.log(lo) + math.log(hi)) / 2, []
    for _ in range(n):
        if rng.random() < 0.05:
            x = rng.uniform(math.log(lo), math.log(hi))
        x = min(math.log(hi), max(math.log(lo), x + rng.gauss(0, 0.25)))
        out.append(math.exp(x))
    return out


def trace(a: argparse.Namespace, cluster: Cluster, prompts: Prompts, profiles: list[Profile], factor: float,
          volume: float) -> dict:
    """The controller (the server's), an oracle and two ablations (bench-side controllers over the same profiles,
    naming their choice) over one bandwidth sequence; each arm replays the same sequence.

    Every arm's decision state is its own: its requests carry ``policy_key`` = its name, so the prefill side's
    meter and residuals under the controller's key see only the controller's transfers; the bench-side arms learn
    residuals and (no-bandwidth-correction) goodput from their own transfers only, with the server's estimator
    (`GoodputMeter.observe_transfer`: link-paced transfers' wire bytes over their write span) and its residual target (the sender's span)."""
    seq = drift(a.trace_requests, 5.0, 100.0, a.seed)
    guess = gbps_bytes(math.sqrt(5.0 * 100.0) * factor)  # the no-bandwidth-model arm's fixed guess, always
    arms: dict[str, Any] = {"controller": None,
                            "oracle": OnlineController(profiles, OnlineConfig(epsilon=0.0)),
                            "no-bandwidth-model": OnlineController(profiles, OnlineConfig()),
                            "no-bandwidth-correction": OnlineController(profiles, OnlineConfig())}
    out: dict[str, Any] = {"nominal_gbps": seq, "guess_nominal_gbps": math.sqrt(5.0 * 100.0), "arms": {}}
    decide_us: list[float] = []
    names = list(arms)
    state = {n: {"jcts": [], "profiles": [], "assumed_gbps": [], "meter": GoodputMeter(), "seconds": 0.0}
             for n in names}
    # the two arms that measure their bandwidth start from one unscored transfer of their own at the first rate
    cluster.set_link(seq[0] * factor)
    for name in ("controller", "no-bandwidth-correction"):
        r = cluster.run(prompts.fresh(0), {"profile": BF16, "policy_key": name})
        state[name]["meter"].observe_transfer(r["wire_bytes"], r["transfer"], r["wire_span"])
    # Arms interleaved per request, in an order rotated each request: drift of the machine falls on every arm alike.
    for i, g in enumerate(seq):
        bw = gbps_bytes(g * factor)
        cluster.set_link(g * factor)
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            ctl, s = arms[name], state[name]
            t_arm = time.perf_counter()
            kv: dict[str, Any] = {"min_quality": a.min_quality, "policy_key": name}
            d = None
            if ctl is not None:
                if name == "oracle":
                    assumed = bw
                elif name == "no-bandwidth-model":
                    assumed = guess
                else:
                    assumed = s["meter"].rate or guess
                t0 = time.perf_counter()
                d = ctl.decide(assumed, volume, None, a.min_quality)
                decide_us.append((time.perf_counter() - t0) * 1e6)
                kv = {"profile": spec_of(d.profile), "min_quality": 0.0, "policy_key": name}
            r = cluster.run(prompts.fresh(i), kv)
            if d is None:
                assumed = r["assumed_bandwidth"]  # what the server's decision under this key assumed
            elif name != "no-bandwidth-correction":
                ctl.observe(d, r["sender_total"])
            if r["wire_span"] > 0 and r["wire_bytes"] > 0:
                s["meter"].observe_transfer(r["wire_bytes"], r["transfer"], r["wire_span"])
            s["jcts"].append(r["jct"])
            s["profiles"].append(r["profile"])
            s["assumed_gbps"].append(assumed * 8 / 1e9 / factor if assumed else None)
            s["seconds"] += time.perf_counter() - t_arm
    for name in names:
        s = state[name]
        out["arms"][name] = {"mean_jct": statistics.fmean(s["jcts"]), "jcts": s["jcts"], "profiles": s["profiles"],
                             "assumed_nominal_gbps": s["assumed_gbps"], "seconds": s["seconds"]}
        print(f"trace {name:24s}: mean JCT {out['arms'][name]['mean_jct']:.3f} s over {len(s['jcts'])} requests "
              f"({s['seconds']:.0f} s)", flush=True)
    o = out["arms"]["oracle"]["mean_jct"]
    out["controller_over_oracle"] = out["arms"]["controller"]["mean_jct"] / o
    out["decide_us_p99"] = sorted(decide_us)[int(0.99 * (len(decide_us) - 1))] if decide_us else None
    return out


def decision_time(profiles: list[Profile], n: int = 20000) -> dict:
    """p50/p99 of one controller decision (bench-side, the same code the server runs)."""
    ctl = OnlineController(profiles, OnlineConfig())
    rng = random.Random(0)
    ts = []
    for _ in range(n):
        bw = gbps_bytes(rng.uniform(0.05, 100))
        t0 = time.perf_counter()
        d = ctl.decide(bw, 5e7, None, 0.97)
        ts.append(time.perf_counter() - t0)
        ctl.observe(d, d.predicted_time * rng.uniform(0.8, 1.2))
    ts.sort()
    return {"p50_us": ts[n // 2] * 1e6, "p99_us": ts[int(0.99 * n)] * 1e6, "n": n}


def draw(doc: dict, plt):
    pb = doc["summary"]["per_bandwidth"]
    gs = [float(g) for g in pb]
    methods = list(next(iter(pb.values()))["methods"])
    has_trace = bool(doc.get("trace"))
    fig, axes = plt.subplots(1, 3 if has_trace else 2, figsize=(17 if has_trace else 12, 4.5))
    ax = axes[0]
    parts = ["prefill", "compress", "transfer", "decompress", "decode"]
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"]
    w = 0.8 / len(methods)
    for j, m in enumerate(methods):
        bottom = [0.0] * len(gs)
        for part, c in zip(parts, colors):
            vals = [pb[str(g) if str(g) in pb else g]["methods"][m][part] for g in pb]
            xs = [i + (j - len(methods) / 2 + 0.5) * w for i in range(len(gs))]
            ax.bar(xs, vals, w * 0.95, bottom=bottom, color=c, label=part if j == 0 else None,
                   edgecolor="black", linewidth=0.3)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(gs)), [f"{g:g}" for g in gs])
    ax.set_xlabel("nominal bandwidth (Gbps); bars: " + ", ".join(methods))
    ax.set_ylabel("seconds (median; compress/transfer/decompress overlap)")
    ax.set_title("JCT breakdown per method")
    ax.legend(fontsize=7)
    ax = axes[1]
    for m in methods:
        ax.plot(gs, [v["methods"][m]["median_jct"] for v in pb.values()], marker="o", label=m)
    ax.set_xscale("log")
    ax.set_xlabel("nominal bandwidth (Gbps)")
    ax.set_ylabel("median JCT (s)")
    ax.set_title(f"JCT vs bandwidth ({doc['model']}, {doc['device']})")
    ax.legend(fontsize=7)
    if has_trace:
        ax = axes[2]
        t = doc["trace"]
        names = list(t["arms"])
        ax.bar(names, [t["arms"][n]["mean_jct"] for n in names], color=["#4c72b0", "#999999", "#dd8452", "#c44e52"])
        ax.set_ylabel("mean JCT (s)")
        ax.set_title(f"drifting bandwidth, {len(t['nominal_gbps'])} requests")
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    return fig


NETNS_ENV = "KVTIDE_PD_NETNS"  # set inside the namespace the benchmark made for itself


def run_in_netns(argv: list[str]) -> int:
    """Re-run this benchmark inside a new network namespace (its loopback up), then delete the namespace."""
    import subprocess as sp

    ns = f"kvtide-pd-{os.getpid()}"
    sp.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    try:
        sp.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True, capture_output=True)
        env_cmd = ["env", f"{NETNS_ENV}={ns}", f"PYTHONPATH={ROOT}"]
        return sp.call(["ip", "netns", "exec", ns, *env_cmd, sys.executable, str(Path(__file__).resolve()), *argv])
    finally:
        sp.run(["ip", "netns", "del", ns], capture_output=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtide bench pd", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-pages", type=int, default=None, help="KV pages per instance (default: the engine's)")
    ap.add_argument("--serve-arg", action="append", default=[], help="more `kvtide serve` flags (repeatable)")
    ap.add_argument("--prompt-tokens", default="1024", help="prompt lengths (comma list)")
    ap.add_argument("--output-tokens", type=int, default=8, help="tokens the decode leg generates (short, as in the paper)")
    ap.add_argument("--bandwidths", default=",".join(f"{g:g}" for g in BANDWIDTHS), help="nominal Gbps (comma list)")
    ap.add_argument("--reps", type=int, default=3, help="requests per (method, bandwidth, length)")
    ap.add_argument("--min-quality", type=float, default=0.97)
    ap.add_argument("--profiles", type=Path, default=None,
                    help="KVServe table (default: on CUDA the packaged GPU-measured one, else bench/results/kvserve_table_<model>_prose.json)")
    ap.add_argument("--trace-requests", type=int, default=30, help="requests of the drifting-bandwidth run (0: off)")
    ap.add_argument("--store-bytes", type=int, default=4 << 30, help="each instance's in-memory KV tier")
    ap.add_argument("--store", choices=("memory", "pinned"), default=None,
                    help="that tier's kind (default: pinned on CUDA, whose loads then run as DMA; memory on the CPU)")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--link", choices=("auto", "tc", "pace"), default="auto",
                    help="tc: a shaped loopback in a namespace of its own; pace: the sender's token bucket; "
                         "auto: tc where network namespaces work, else pace")
    a = ap.parse_args(argv)
    if a.store is None:
        a.store = "pinned" if a.device.startswith("cuda") else "memory"
    if a.link != "pace" and not os.environ.get(NETNS_ENV):
        from kvtide.benchmarks.netns import netns_available

        ok, why = netns_available()
        if ok:
            args, rest = list(sys.argv[1:] if argv is None else argv), []
            while args:
                x = args.pop(0)
                if x == "--link":
                    args.pop(0)
                elif not x.startswith("--link="):
                    rest.append(x)
            return run_in_netns(rest + ["--link", "tc"])
        if a.link == "tc":
            raise SystemExit(f"--link tc needs network namespaces here: {why}")
        print(f"no network namespaces here ({why}): the sender's token bucket paces the link", flush=True)
        a.link = "pace"
    a.bandwidths = [float(x) for x in a.bandwidths.split(",")]
    lengths = [int(x) for x in a.prompt_tokens.split(",")]
    table_model = a.model if not a.model.startswith("random:") else "smollm2-135m"
    gpu_table = packaged_table(table_model, a.device) if a.device.startswith("cuda") else None
    a.profiles = a.profiles or gpu_table or RESULTS_DIR / f"kvserve_table_{table_model}_prose.json"
    out = a.out or RESULTS_DIR / f"pd_{a.model.replace(':', '-')}_{'cuda' if a.device.startswith('cuda') else 'cpu'}.json"
    args, tok = model_args(a.model)
    kv_per_token = args.num_layers * 2 * args.num_kv_heads * args.head_dim * 2
    volume = float(kv_per_token * statistics.fmean(lengths))
    profiles = table_profiles(str(a.profiles), a.device) + measured_lossless((256, args.num_kv_heads, args.head_dim))
    prompts = Prompts(tok, lengths, args.vocab_size, a.seed)
    import tempfile

    logdir = Path(tempfile.mkdtemp(prefix="kvtide-pd-"))  # the two servers' logs (not results)
    print(f"server logs in {logdir}", flush=True)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped benchmark still stops its two servers
    t0 = time.perf_counter()
    with Cluster(a, logdir) as cluster:
        sc = scale_factor(a, cluster, prompts, kv_per_token)
        factor = sc["factor"]
        emulated = [g * factor for g in a.bandwidths]
        methods = method_specs(a, profiles, emulated, volume)
        print(f"bandwidth scale {factor:.4g} (nominal -> emulated Gbps); methods {methods}", flush=True)
        rows = bandwidth_table(a, cluster, prompts, methods, factor)
        tr = trace(a, cluster, prompts, profiles, factor, volume) if a.trace_requests else None
    doc = {"suite": "pd", "model": a.model, "device": a.device, "random_weights": a.model.startswith("random:"),
           "prompt_tokens": lengths, "output_tokens": a.output_tokens, "reps": a.reps, "min_quality": a.min_quality,
           "profiles_table": str(a.profiles), "methods": methods, "scale": sc,
           "scaling": ("none: real rates" if factor == 1.0 else
                       "nominal Gbps scaled so BF16 transfer / prefill time matches an 8B on an H200 "
                       f"({KV_8B} B/token, {PREFILL_8B_H200 * 1e3:.3f} ms/token)"),
           "link": a.link,
           "transport": ("Mooncake Transfer Engine, TCP on loopback; " +
                         ("the loopback of a network namespace of its own shaped by tc tbf per bandwidth"
                          if a.link == "tc" else "sender-side token bucket per bandwidth")),
           "codecs_run_on": ("the GPU for lossy and nvCOMP pipelines (each layer goes from the host KV tier to the "
                             "GPU, is coded there, and its coded bytes cross through host memory); the host CPU for "
                             "BF16 and host-codec lossless ones" if a.device.startswith("cuda") else "the host CPU"),
           "rows": rows, "summary": summarise(rows, a.bandwidths, a.min_quality), "trace": tr,
           "decision_time": decision_time(profiles), "seconds": time.perf_counter() - t0}
    report.write(out, doc, draw, argv)
    g = doc["summary"]["goals"]
    print(f"controller / best method, worst bandwidth: {g['controller_worst_over_best']:.3f}; "
          f"BF16 / controller at the lowest: {g['speedup_over_bf16_at_lowest']:.2f}x; "
          f"controller / BF16 at the highest: {g['controller_over_bf16_at_highest']:.3f}; wrote {out}")
    if tr:
        print(f"trace: controller / oracle {tr['controller_over_oracle']:.3f}; decisions p99 "
              f"{doc['decision_time']['p99_us']:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
