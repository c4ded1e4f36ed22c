"""Does BO matter on a KVServe space of >= 1,000 pipelines? Evaluations-to-optimum of BO, random and exhaustive
search on a 150-point stratified subset of the wide space (kvtide/transfer/search_space.py), and BO on the whole.

One bundled real model and one workload class, quick quality windows (quality.py). The subset (seeded, every
(transform, quantizer) pair alike) is evaluated exhaustively through a JSON cache under /tmp (ratio and quality
are deterministic, so reruns only evaluate what is missing); BO and random search are then replayed over that
table for several seeds (search_study.py). BO on the full space evaluates for real (through the same cache) and
reports its evaluations and best ratio at the threshold; random search with the same budget beside it.

    python bench/tools/kvserve_search.py --out bench/results/kvserve_search_cpu.json

``--replay FILE`` loads no model: the subset's table comes from FILE (an earlier result of this script, which stores
every evaluated configuration of the subset), the full-space runs are not repeated (FILE's are carried over as
``full_space_previous``), and ``--resample N`` adds N seeded sub-subsets of the table (``--resample-size`` points
each, other optima) as a check that a search setting is not fitted to the one subset.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402
from kvtide.transfer.evaluate import EvalRecord, EvaluateConfig, PipelineEvaluator  # noqa: E402
from kvtide.transfer.head_scores import load_head_scores  # noqa: E402
from kvtide.transfer.profiler import Profiler, ProfilerConfig, SearchSpace  # noqa: E402
from kvtide.transfer.quality import QualityConfig, evaluator  # noqa: E402
from kvtide.transfer.search_space import stratified_subset, wide_space  # noqa: E402
from kvtide.transfer.search_study import optimum, replay, summary  # noqa: E402

log = logging.getLogger("kvtide.bench.kvserve_search")


class CachedEvaluator:
    """``PipelineEvaluator`` behind a JSON file of records keyed by spec; refuses a file made for other inputs."""

    def __init__(self, pe: PipelineEvaluator, path: Path, key: dict) -> None:
        self.pe, self.path, self.key = pe, path, key
        self.records: dict[str, EvalRecord] = {}
        self.fresh = 0
        if path.exists():
            doc = json.loads(path.read_text())
            if doc.get("key") != key:
                raise ValueError(f"{path}: cache is for {doc.get('key')}, not {key} (remove it or pass --cache)")
            self.records = {s: EvalRecord(**r) for s, r in doc["records"].items()}

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": self.key, "records": {s: r.as_dict() for s, r in self.records.items()}}))
        os.replace(tmp, self.path)

    def record(self, spec: str) -> EvalRecord:
        if spec not in self.records:
            self.records[spec] = self.pe.record(spec)
            self.fresh += 1
            self._save()
            r = self.records[spec]
            log.info("%4d  q=%.3f cr=%.2f  %.1fs  %s", len(self.records), r.quality, r.ratio, r.seconds, spec)
        return self.records[spec]

    def row(self, spec: str) -> dict:
        return self.record(spec).as_dict()

    def __call__(self, spec: str) -> tuple[float, float, float, float]:
        r = self.record(spec)
        return r.ratio, r.encode_throughput, r.decode_throughput, r.quality


class ReplayEvaluator:
    """Answers from the ``table`` of an earlier result (spec -> record as stored, whatever fields its version of
    EvalRecord had); a spec outside it is an error, so a replay never evaluates anything."""

    def __init__(self, table: dict[str, dict]) -> None:
        self.rows = table
        self.fresh = 0

    def row(self, spec: str) -> dict:
        if spec not in self.rows:
            raise SystemExit(f"replay: {spec} is not in the replayed table (a subset of other size or seed?)")
        return self.rows[spec]

    def __call__(self, spec: str) -> tuple[float, float, float, float]:
        r = self.row(spec)
        return r["ratio"], r["encode_throughput"], r["decode_throughput"], r["quality"]


def resampled(args: argparse.Namespace, sub: SearchSpace, table: dict) -> list[dict]:
    """BO (default settings) and random search on ``args.resample`` seeded random sub-subsets of the subset."""
    out = []
    configs = sub.configs()
    k = min(args.resample_size, len(configs))
    for r in range(args.resample):
        pts = random.Random(1000 + r).sample(configs, k)
        space = sub.subset(pts)
        t = {space.render(c): table[space.render(c)] for c in pts}
        opt = optimum(t, args.threshold)
        if opt is None:
            out.append({"resample_seed": 1000 + r, "size": k, "optimum": None})
            continue
        bo = [replay(space, t, bo_config(args, {}, s)) for s in range(args.seeds)]
        rnd = [replay(space, t, ProfilerConfig(args.threshold, mode="random", max_evals=k, seed=s))
               for s in range(args.random_seeds)]
        out.append({"resample_seed": 1000 + r, "size": k, "optimum_ratio": opt[0], "optimum_specs": sorted(opt[1]),
                    "bo": summary(bo), "random": summary(rnd), "bo_runs": [x.as_dict() for x in bo]})
        log.info("resample %d: optimum %.3f; BO %s; random %s", r, opt[0], out[-1]["bo"], out[-1]["random"])
    return out


BO_KEYS = {"n_init": int, "lambda0": float, "decay": float, "prune_eps": float, "infeasible_margin": float,
           "patience": int, "max_evals": int}


def variant(text: str) -> tuple[str, dict]:
    """``name:key=value,...`` (keys of ProfilerConfig in BO_KEYS) -> (name, overrides)."""
    name, _, rest = text.partition(":")
    out = {}
    for part in filter(None, rest.split(",")):
        k, _, v = part.partition("=")
        if k not in BO_KEYS:
            raise argparse.ArgumentTypeError(f"variant {name!r}: unknown key {k!r}; known: {sorted(BO_KEYS)}")
        out[k] = BO_KEYS[k](v)
    return name, out


def environment(args: argparse.Namespace) -> dict:
    import botorch
    return {"machine": platform.machine(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average_at_start": list(os.getloadavg()), "python": platform.python_version(),
            "torch": torch.__version__, "botorch": botorch.__version__, "weights": "real (bundled GGUF, fp32 compute)",
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "note": "shared 2-core CPU; throughputs indicative only (not used by the search)"}


def variants_of(args: argparse.Namespace) -> list[tuple[str, dict]]:
    return [("default", {})] + list(args.bo_variant)


def bo_config(args: argparse.Namespace, over: dict, seed: int) -> ProfilerConfig:
    kw = {"max_evals": args.max_evals, "n_init": args.n_init} | over
    return ProfilerConfig(args.threshold, mode="bo", seed=seed, **kw)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workload", default="prose")
    ap.add_argument("--threshold", type=float, default=0.97)
    ap.add_argument("--subset", type=int, default=150)
    ap.add_argument("--subset-seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=10, help="BO replay seeds on the subset")
    ap.add_argument("--random-seeds", type=int, default=200, help="random-search replay seeds on the subset")
    ap.add_argument("--max-evals", type=int, default=80, help="BO budget (replay and full space)")
    ap.add_argument("--n-init", type=int, default=6)
    ap.add_argument("--full-seeds", type=int, default=2, help="BO runs on the full space (real evaluations)")
    ap.add_argument("--full-random-seeds", type=int, default=1, help="random runs on the full space, BO's budget")
    ap.add_argument("--bo-variant", type=variant, action="append", default=[],
                    help="extra BO settings replayed on the subset, name:key=value,... (repeatable)")
    ap.add_argument("--full-variant", default="default", help="which BO variant runs on the full space")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", type=Path)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/kvserve_search_cpu.json")
    ap.add_argument("--replay", type=Path, help="earlier result JSON to replay the subset from (no model runs)")
    ap.add_argument("--resample", type=int, default=0, help="seeded sub-subsets of the table to replay as well")
    ap.add_argument("--resample-size", type=int, default=100)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    qcfg = QualityConfig()
    prev = json.loads(args.replay.read_text()) if args.replay else None
    if prev is not None:
        for k in ("model", "workload", "threshold"):
            if prev.get(k) != getattr(args, k):
                raise SystemExit(f"--replay {args.replay}: {k} is {prev.get(k)!r}, not {getattr(args, k)!r}")
        old_q = prev.get("quality_config", {})  # written before QualityConfig grew fields: compare those it has
        if any(qcfg.__dict__.get(k) != v for k, v in old_q.items()):
            raise SystemExit(f"--replay {args.replay}: quality_config {old_q} differs from {qcfg.__dict__}")
        ev = ReplayEvaluator(prev["table"])
    else:
        cache = args.cache or Path(f"/tmp/kvserve_search_{args.model}_{args.workload}.json")
        key = {"model": args.model, "workload": args.workload, "quality": qcfg.__dict__, "evaluate": "EvaluateConfig()"}
        pe = PipelineEvaluator(evaluator(args.model, args.workload, qcfg), load_head_scores(args.model),
                               EvaluateConfig())
        ev = CachedEvaluator(pe, cache, key)
    full = wide_space()
    sub = stratified_subset(full, args.subset, seed=args.subset_seed)
    specs = [sub.render(c) for c in sub.configs()]
    t_sub = time.perf_counter()
    table = {s: ev(s) for s in specs}  # the exhaustive search over the subset
    t_sub = time.perf_counter() - t_sub
    opt = optimum(table, args.threshold)
    doc: dict = {"bench": "kvserve_search", "model": args.model, "workload": args.workload,
                 "threshold": args.threshold, "env": environment(args),
                 "quality_config": prev["quality_config"] if prev is not None else qcfg.__dict__,
                 "full_space_size": len(full.configs()), "subset_size": len(specs),
                 "subset_seconds": round(t_sub, 1), "subset_fresh_evaluations": ev.fresh,
                 "subset_feasible": sum(r[3] >= args.threshold for r in table.values())}
    if prev is not None:
        doc["replayed_from"] = {"path": str(args.replay), "kvtide_git": prev.get("header", {}).get("kvtide_git")}
    if opt is None:
        doc["subset"] = {"optimum": None}
    else:
        variants, outcomes = {}, {}
        for name, over in variants_of(args):
            outcomes[name] = [replay(sub, table, bo_config(args, over, s)) for s in range(args.seeds)]
            variants[name] = {"settings": over, **summary(outcomes[name])}
            log.info("subset BO %s: %s", name, variants[name])
        bo = outcomes["default"]
        rnd = [replay(sub, table, ProfilerConfig(args.threshold, mode="random", max_evals=len(specs), seed=s))
               for s in range(args.random_seeds)]
        b, r = summary(bo), summary(rnd)
        doc["subset"] = {
            "optimum_ratio": opt[0], "optimum_specs": sorted(opt[1]),
            "exhaustive_evaluations": len(specs), "bo": b, "random": r,
            "random_expected_evaluations_to_optimum": (len(specs) + 1) / (len(opt[1]) + 1),
            "exhaustive_over_bo_median": (len(specs) / b["median_evaluations_to_optimum"]
                                          if b["median_evaluations_to_optimum"] else None),
            "bo_variants": variants, "random_runs": [x.as_dict() for x in rnd],
            "bo_variant_runs": {k: [x.as_dict() for x in v] for k, v in outcomes.items()}}
        log.info("subset optimum %.3f (%d specs); BO %s; random %s", opt[0], len(opt[1]), b, r)
    if args.resample:
        doc["resampled"] = resampled(args, sub, table)
    runs = []
    if prev is not None:  # the full space needs model runs: carry the earlier file's runs, labelled as such
        args.full_seeds = args.full_random_seeds = 0
        doc["full_space_previous"] = {"kvtide_git": prev.get("header", {}).get("kvtide_git"),
                                      **prev.get("full_space_previous", prev.get("full_space", {}))}
    for mode, seeds in (("bo", args.full_seeds), ("random", args.full_random_seeds)):
        for s in range(seeds):
            before, t1 = ev.fresh, time.perf_counter()
            over = dict(variants_of(args))[args.full_variant] if mode == "bo" else {}
            cfg = bo_config(args, over, s)
            if mode == "random":
                cfg = ProfilerConfig(args.threshold, mode="random", max_evals=args.max_evals, seed=s)
            res = Profiler(full, ev, cfg).run()
            runs.append({"mode": mode, "seed": s, "variant": args.full_variant if mode == "bo" else None, "evaluations": res.evaluations, "stopped": res.stopped,
                         "fresh_evaluations": ev.fresh - before, "seconds": round(time.perf_counter() - t1, 1),
                         "best_ratio": res.best.ratio if res.best else None,
                         "best_spec": res.best.spec if res.best else None,
                         "best_quality": res.best.quality if res.best else None})
            log.info("full space %s seed %d: %s", mode, s, runs[-1])
    if prev is None:
        evaluated = {s: r for s, r in ev.records.items() if s in set(full.render(c) for c in full.configs())}
        best_seen = optimum({s: (r.ratio, 0.0, 0.0, r.quality) for s, r in evaluated.items()}, args.threshold)
        doc["full_space"] = {"runs": runs, "distinct_configurations_evaluated": len(evaluated),
                             "best_ratio_among_all_evaluated": best_seen[0] if best_seen else None,
                             "best_specs_among_all_evaluated": sorted(best_seen[1]) if best_seen else None}
    doc["table"] = {s: ev.row(s) for s in specs}
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    report.write(args.out, doc, argv=argv, png=False)
    print(json.dumps({k: doc[k] for k in ("subset_size", "full_space_size")} |
                     {"subset": {k: v for k, v in doc["subset"].items() if not k.endswith("_runs")},
                      "resampled": [{k: v for k, v in r.items() if not k.endswith("_runs")}
                                    for r in doc.get("resampled", [])],
                      "full_space": doc.get("full_space", doc.get("full_space_previous"))}, indent=1))


if __name__ == "__main__":
    main()
