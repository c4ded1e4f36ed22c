"""KVServe offline half on the real bundled models: Pareto sets, best ratio at >= 97% relative accuracy
against the published baselines, and BO against exhaustive and random search.

Per (model, workload class): the reference run, the baselines (CacheGen-like, KIVI-2bit, DuoAttention-like
press, BF16, ZipFusion) and a profiler run over a pipeline space (BO; exhaustive on the one pair named by
--exhaustive). On the exhaustive table, BO and random search are replayed from the table (evaluations are
deterministic, so a replay equals re-evaluating) to count the evaluations each needs to reach the optimum.
Writes bench/results/kvserve_profiles.json (+ .png) and one profile table per pair,
bench/results/kvserve_table_<model>_<workload>.json, which bench/kvserve_controller.py reads.

Default (--quick): 512-token prefixes, 4 x 64 scored tokens per workload, a 72-configuration space; --full
uses 1024-token prefixes, 8 x 128 tokens and the 640-configuration space. CPU only; real weights.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import report  # noqa: E402
from kvtide.transfer.baselines import BASELINES, DUO_PRESS
from kvtide.transfer.controller import Profile, pareto_front
from kvtide.transfer.evaluate import EvaluateConfig, PipelineEvaluator
from kvtide.transfer.head_scores import load_head_scores
from kvtide.transfer.profiler import Profiler, ProfilerConfig, pipeline_space
from kvtide.transfer.quality import QualityConfig, evaluator
from kvtide.transfer.table import save_profiles

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")
WORKLOADS = ("prose", "code")
LOSSY_BASELINES = ("cachegen", "kivi-2bit", "duo-press")


def small_space():
    return pipeline_space(transforms=("none", "hadamard"), bits=(2, 3, 4), groups=(32,),
                          codecs=("pack", "zstd", "ans"))


def environment(args: argparse.Namespace) -> dict:
    import botorch
    import numpy
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": platform.machine(),
            "cpu": platform.processor() or platform.uname().machine, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "load_average_at_start": list(os.getloadavg()),
            "python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
            "botorch": botorch.__version__, "os": platform.platform(), "weights": "real (bundled GGUF, fp32 compute)",
            "kv_dtype": "bfloat16", "args": vars(args),
            "note": "CPU shared with other jobs: throughputs are numpy/torch on this CPU, indicative only"}


def model_shape(name: str, prefix: int) -> dict:
    from kvtide.transfer.quality import bundled_model
    a = bundled_model(name)[0].args
    return {"layers": a.num_layers, "heads": a.num_heads, "kv_heads": a.num_kv_heads, "head_dim": a.head_dim,
            "request_kv_shape": [a.num_layers, 2, prefix, a.num_kv_heads, a.head_dim],
            "request_kv_bytes": a.kv_bytes_per_token * prefix}


def replay_study(space, records: dict, thr: float, bo_seeds: int, random_seeds: int) -> dict:
    """Evaluations BO and random search need to reach the exhaustive optimum, replayed from the table."""
    feas = [r for r in records.values() if r.quality >= thr]
    if not feas:
        return {"optimum": None}
    opt = max(r.ratio for r in feas)
    optimal = {r.spec for r in feas if r.ratio == opt}
    n = len(space.configs())

    def ev(spec: str):
        r = records[spec]
        return r.ratio, r.encode_throughput, r.decode_throughput, r.quality

    def run(mode: str, seed: int, max_evals: int) -> dict:
        found: list[int] = []

        def on_eval(k, p):
            if p.spec in optimal and not found:
                found.append(k)
        t0 = time.perf_counter()
        res = Profiler(space, ev, ProfilerConfig(thr, mode=mode, max_evals=max_evals, seed=seed), on_eval=on_eval).run()
        return {"seed": seed, "found_at": found[0] if found else None, "evaluations": res.evaluations,
                "stopped": res.stopped, "best_ratio": res.best.ratio if res.best else None,
                "search_overhead_s": round(time.perf_counter() - t0, 2)}

    bo = [run("bo", s, 80) for s in range(bo_seeds)]
    rnd = [run("random", s, n) for s in range(random_seeds)]
    bo_found = [r["found_at"] for r in bo if r["found_at"]]
    return {"space_size": n, "optimum": sorted(optimal), "optimum_ratio": opt, "exhaustive_evaluations": n,
            "bo": bo, "random": rnd,
            "bo_found_fraction": len(bo_found) / len(bo),
            "bo_mean_evaluations_to_optimum": sum(bo_found) / len(bo_found) if bo_found else None,
            "bo_mean_evaluations_used": sum(r["evaluations"] for r in bo) / len(bo),
            "random_mean_evaluations_to_optimum": sum(r["found_at"] for r in rnd) / len(rnd),
            "random_expected_evaluations_to_optimum": (n + 1) / (len(optimal) + 1)}


def run_pair(model: str, wl: str, args, space, exhaustive: bool) -> dict:
    t0 = time.perf_counter()
    qcfg = QualityConfig(args.prefix, args.continuation, args.samples)
    head = load_head_scores(model)
    qev = evaluator(model, wl, qcfg)
    t_ref = time.perf_counter() - t0
    pe = PipelineEvaluator(qev, head, EvaluateConfig(repeats=args.repeats))
    base = {name: pe.record(spec).as_dict() for name, spec in BASELINES.items()}
    # Head-score check: the press keeping the *lowest*-scored heads instead must do worse.
    inv = qev.evaluate(DUO_PRESS, -head)
    label = f"{model} {wl} ({'exhaustive' if exhaustive else 'bo'})"
    cfg = ProfilerConfig(args.threshold, mode="exhaustive" if exhaustive else "bo", max_evals=args.max_evals,
                         n_init=args.n_init, seed=args.seed)
    # BO starts from the published baselines that lie in the space (a practitioner would); the replay
    # study below does not, so that BO, random and exhaustive search start from nothing alike.
    prof = Profiler(space, pe, cfg, progress=label if not args.no_progress else False,
                    warm_start=list(BASELINES.values()))
    res = prof.run()
    search = {r.spec: r for r in pe.records.values() if r.spec not in BASELINES.values()}
    out = {"model": model, "workload": wl, "shape": model_shape(model, args.prefix),
           "reference_accuracy": qev.reference_accuracy, "scored_tokens": args.samples * args.continuation,
           "reference_seconds": round(t_ref, 1), "baselines": base,
           "press_with_inverted_head_scores": inv.as_dict(),
           "search": {"mode": cfg.mode, "evaluations": res.evaluations, "quality_runs": pe.quality_runs,
                      "stopped": res.stopped, "space_size": len(space.configs())},
           "evaluated": [r.as_dict() for r in pe.records.values()]}
    best = res.best
    out["best"] = search[best.spec].as_dict() if best else None
    vs = {}
    for name in LOSSY_BASELINES + ("bf16",):
        b = base[name]
        vs[name] = {"ratio": b["ratio"], "quality": b["quality"], "meets_threshold": b["quality"] >= args.threshold,
                    "kvserve_gain": (best.ratio / b["ratio"]) if best else None}
    out["vs_baselines"] = vs
    pool = [Profile(r.spec, r.ratio, r.encode_throughput, r.decode_throughput, r.quality)
            for r in pe.records.values() if r.quality >= args.table_floor and r.spec != BASELINES["bf16"]]
    front = pareto_front(pool)
    out["pareto"] = [p.name for p in front]
    table = RESULTS / f"kvserve_table_{model}_{wl}.json"
    save_profiles(table, front, workload=wl, model=model, quality_floor=args.table_floor,
                  quality="relative next-token accuracy (kvtide.transfer.quality)",
                  throughput="measured on this CPU (numpy/torch pipelines)", prefix_tokens=args.prefix,
                  written=time.strftime("%Y-%m-%dT%H:%M:%S"))
    out["table"] = str(table.relative_to(RESULTS.parent.parent))
    if exhaustive:
        out["replay"] = replay_study(space, search, args.threshold, args.bo_seeds, args.random_seeds)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def draw(doc: dict, plt):
    """Headline figure (the PNG beside the JSON)."""
    runs = doc["runs"]
    fig, axes = plt.subplots(1, len(runs) + 1, figsize=(4.2 * (len(runs) + 1), 4))
    thr = doc["threshold"]
    for ax, run in zip(axes, runs):
        ev = run["evaluated"]
        ax.scatter([r["ratio"] for r in ev], [r["quality"] for r in ev], s=10, c="0.7", label="evaluated")
        par = set(run["pareto"])
        pp = [r for r in ev if r["spec"] in par]
        ax.scatter([r["ratio"] for r in pp], [r["quality"] for r in pp], s=18, c="C0", label="Pareto (q,cr,s)")
        for i, name in enumerate(LOSSY_BASELINES):
            b = run["baselines"][name]
            ax.scatter([b["ratio"]], [b["quality"]], marker="x", s=50, c=f"C{i + 1}", label=name)
        if run["best"]:
            ax.scatter([run["best"]["ratio"]], [run["best"]["quality"]], marker="*", s=120, c="C5", label="best >= thr")
        ax.axhline(thr, ls="--", c="k", lw=0.8)
        ax.set_ylim(max(0.5, min(r["quality"] for r in ev) - 0.02), 1.05)
        ax.set_title(f"{run['model']} / {run['workload']}", fontsize=9)
        ax.set_xlabel("compression ratio")
        ax.set_ylabel("relative accuracy")
    axes[0].legend(fontsize=6)
    ax = axes[-1]
    rep = next((r["replay"] for r in runs if "replay" in r and r["replay"].get("optimum")), None)
    if rep:
        vals = [("BO", [r["found_at"] or rep["space_size"] for r in rep["bo"]]),
                ("random", [r["found_at"] for r in rep["random"]]), ("exhaustive", [rep["space_size"]])]
        ax.boxplot([v for _, v in vals], tick_labels=[k for k, _ in vals])
        ax.set_ylabel("evaluations to reach the exhaustive optimum")
        ax.set_title(f"search cost, space of {rep['space_size']}", fontsize=9)
    fig.suptitle(f"kvserve profiles ({doc['env']['date'][:10]}, CPU, real weights, threshold {thr})", fontsize=9)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="1024-token prefixes, 8x128 tokens, 640-config space")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    ap.add_argument("--prefix", type=int)
    ap.add_argument("--continuation", type=int)
    ap.add_argument("--samples", type=int)
    ap.add_argument("--space", choices=("small", "full"))
    ap.add_argument("--exhaustive", default="smollm2-135m:prose", help="model:workload enumerated fully ('' for none)")
    ap.add_argument("--threshold", type=float, default=0.97)
    ap.add_argument("--table-floor", type=float, default=0.90, help="lowest quality kept in the profile tables")
    ap.add_argument("--max-evals", type=int)
    ap.add_argument("--n-init", type=int, default=6)
    ap.add_argument("--bo-seeds", type=int, default=5)
    ap.add_argument("--random-seeds", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is faster on a shared 2-core CPU)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "kvserve_profiles.json"))
    args = ap.parse_args(argv)
    full = args.full
    args.prefix = args.prefix or (1024 if full else 512)
    args.continuation = args.continuation or (128 if full else 64)
    args.samples = args.samples or (8 if full else 4)
    args.space = args.space or ("full" if full else "small")
    args.max_evals = args.max_evals or (80 if full else 20)
    torch.set_num_threads(args.threads)
    space = pipeline_space() if args.space == "full" else small_space()
    RESULTS.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    doc = {"bench": "kvserve_profiles", "threshold": args.threshold, "env": environment(args),
           "quality_definition": "relative accuracy = teacher-forced next-token accuracy with the profile's "
                                 "decoded prefix KV / with uncompressed BF16 KV (kvtide/transfer/quality.py)",
           "space": space.signature(), "runs": []}
    for model in args.models:
        for wl in args.workloads:
            run = run_pair(model, wl, args, space, exhaustive=f"{model}:{wl}" == args.exhaustive)
            doc["runs"].append(run)
            b = run["best"]
            print(f"{model} {wl}: best >= {args.threshold}: " + (f"{b['ratio']:.2f}x q={b['quality']:.3f} {b['spec']}" if b else "none")
                  + "  | " + "  ".join(f"{k} {v['ratio']:.2f}x q={v['quality']:.3f}" for k, v in run["vs_baselines"].items())
                  + f"  ({run['seconds']} s)", flush=True)
            if "replay" in run and run["replay"].get("optimum"):
                r = run["replay"]
                print(f"  replay on {r['space_size']} configs: BO found the optimum in {r['bo_found_fraction']:.0%} of "
                      f"seeds, mean {r['bo_mean_evaluations_to_optimum']} evals (used {r['bo_mean_evaluations_used']:.1f}); "
                      f"random mean {r['random_mean_evaluations_to_optimum']:.1f}; exhaustive {r['space_size']}", flush=True)
    ok = [r for r in doc["runs"] if r["best"]]
    doc["summary"] = {
        "mean_best_ratio_at_threshold": sum(r["best"]["ratio"] for r in ok) / len(ok) if ok else None,
        **{f"mean_{n}_ratio": sum(r["baselines"][n]["ratio"] for r in doc["runs"]) / len(doc["runs"]) for n in LOSSY_BASELINES},
        **{f"{n}_meets_threshold": sum(r["vs_baselines"][n]["meets_threshold"] for r in doc["runs"]) for n in LOSSY_BASELINES},
        "pairs": len(doc["runs"]), "seconds": round(time.perf_counter() - t0, 1)}
    out = Path(args.out)
    report.write(out, doc, draw, argv,
                 default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
    print(json.dumps(doc["summary"], indent=1))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
