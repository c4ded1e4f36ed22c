"""Offline profiler (KVServe section 5.2): search the pipeline space for high-ratio configurations that keep
quality, and write the 3D Pareto set (quality, ratio, throughput) as a profile table.

Model-agnostic: it calls ``evaluate(spec) -> (ratio, encode_throughput, decode_throughput, quality)``.
Modes: ``bo`` (constrained GP Bayesian optimisation, Algorithm 1), ``exhaustive``, ``random``.
BO: configurations embedded one-hot (categorical) + min-max (numeric); two GPs (quality; log ratio);
acquisition: constrained expected improvement  a(c) = P(q(c) >= thr) * EI(log CR(c) over the best feasible log CR)
(P(q >= thr) alone until a feasible point is known), so exploration comes from both GPs' uncertainty;
order pruning after every evaluation, exact where dimensions declare an order (``Dimension.monotone``: more bits
never lower quality nor raise CR) or exactness (``Dimension.lossless``: a codec leaves quality alone): an infeasible
point removes every configuration it dominates in quality, a feasible one every same-codec configuration that
dominates it in quality (so has no higher CR); bi-directional pruning on the predicted CR once exploiting, i.e.
once lambda0 exp(-decay t) < 0.1 (feasible at CR -> drop predicted CR < CR(1-eps); far infeasible at CR -> drop
predicted CR > CR(1+eps) among configurations with the same categorical choices: the CR/quality trade-off is
monotone along one pipeline's ordered parameters, not across pipelines, where the paper's global rule would
discard e.g. a rotated variant that is feasible at a higher CR); early stop after ``patience`` evaluations
without a better feasible CR. The paper's acquisition (CR/CR_max * P(q >= thr) plus a decaying sigma_q bonus)
needed more evaluations on the replayed KV tables (bench/tools/kvserve_search.py), so cEI replaced it.
Resumable: every evaluation is appended to ``state_path`` (JSON) and replayed on restart.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from scipy.special import ndtr

from ..extras import require
from .controller import Profile, pareto_front
from .table import save_profiles

Evaluate = Callable[[str], tuple[float, float, float, float]]


@dataclass(frozen=True)
class Dimension:
    """One axis of a search space. ``monotone`` (numeric only): +1 when a larger value never lowers quality and
    never raises the ratio (bit width, kept outlier channels), -1 for the reverse (group size), 0 for no known
    order. ``lossless``: the dimension picks an exact stage (a codec), so quality does not depend on it. Both
    let the profiler skip configurations that provably cannot beat an evaluated one."""

    name: str
    values: tuple
    numeric: bool = False
    monotone: int = 0
    lossless: bool = False

    def __post_init__(self) -> None:
        if not self.values or len(set(self.values)) != len(self.values):
            raise ValueError(f"dimension {self.name}: values must be non-empty and distinct")
        if self.numeric and not all(isinstance(v, (int, float)) for v in self.values):
            raise ValueError(f"dimension {self.name}: numeric values must be numbers")
        if self.monotone not in (-1, 0, 1):
            raise ValueError(f"dimension {self.name}: monotone must be -1, 0 or 1, got {self.monotone!r}")
        if self.monotone and not self.numeric:
            raise ValueError(f"dimension {self.name}: monotone needs a numeric dimension")
        if self.monotone and self.lossless:
            raise ValueError(f"dimension {self.name}: a lossless dimension cannot order quality (monotone)")


class SearchSpace:
    """Cartesian product of dimensions, or a chosen subset of it (``points``); ``render`` turns a configuration
    into a pipeline spec. A subset keeps the product's embedding (same one-hot and min-max ranges)."""

    def __init__(self, dims: Sequence[Dimension], render: Callable[[dict[str, Any]], str],
                 points: Sequence[dict[str, Any]] | None = None) -> None:
        if len({d.name for d in dims}) != len(dims):
            raise ValueError("dimension names must be distinct")
        self.dims = list(dims)
        self.render = render
        self.points: list[dict[str, Any]] | None = None
        if points is not None:
            names = [d.name for d in self.dims]
            seen = set()
            for c in points:
                if sorted(c) != sorted(names) or any(c[d.name] not in d.values for d in self.dims):
                    raise ValueError(f"point {c} is not a configuration of dimensions {names}")
                key = tuple(c[n] for n in names)
                if key in seen:
                    raise ValueError(f"point {c} is listed twice")
                seen.add(key)
            if not points:
                raise ValueError("a subset needs at least one point")
            self.points = [dict(c) for c in points]

    def configs(self) -> list[dict[str, Any]]:
        if self.points is not None:
            return [dict(c) for c in self.points]
        return [dict(zip([d.name for d in self.dims], vs)) for vs in itertools.product(*(d.values for d in self.dims))]

    def subset(self, points: Sequence[dict[str, Any]]) -> "SearchSpace":
        """The same dimensions and rendering restricted to ``points`` (configurations of this space)."""
        return SearchSpace(self.dims, self.render, points)

    def embed(self, configs: Sequence[dict[str, Any]]) -> np.ndarray:
        cols = []
        for d in self.dims:
            v = [c[d.name] for c in configs]
            if d.numeric:
                lo, hi = min(d.values), max(d.values)
                cols.append(((np.asarray(v, float) - lo) / (hi - lo if hi > lo else 1.0))[:, None])
            else:
                cols.append(np.asarray([[float(x == y) for y in d.values] for x in v]))
        return np.concatenate(cols, 1)

    def signature(self) -> list:
        sig = [[d.name, list(d.values), d.numeric] for d in self.dims]
        return sig if self.points is None else sig + [["points", [self.render(c) for c in self.points]]]


def pipeline_space(transforms: Sequence[str] = ("none", "delta", "hadamard", "affine"),
                   quants: Sequence[str] = ("uniform", "kivi", "layer", "mixhq"),
                   bits: Sequence[int] = (2, 3, 4, 6, 8), groups: Sequence[int] = (32, 64),
                   codecs: Sequence[str] = ("pack", "zstd", "lz4:l=3", "ans")) -> SearchSpace:
    """Space over the pipeline grammar; the default is 4 transforms x 4 quantizers x 5 widths x 2 groups x
    4 codecs (640). Narrower value lists give spaces small enough to enumerate."""
    def render(c: dict[str, Any]) -> str:
        b, g = c["bits"], c["group"]
        q = {"uniform": f"uniform:k={b},v={b},g={g}", "kivi": f"kivi:k={b},v={b},g={g}",
             "layer": f"layer:b={min(8, b + 2)}/{b}/{max(1, b - 1)},g={g}",
             "mixhq": f"mixhq:hi={min(8, 2 * b)},lo={max(1, b // 2)},g={g}"}[c["quant"]]
        return f"{c['transform']}|{q}|{c['codec']}"
    return SearchSpace([Dimension("transform", tuple(transforms)),
                        Dimension("quant", tuple(quants)),
                        Dimension("bits", tuple(bits), numeric=True, monotone=1),
                        Dimension("group", tuple(groups), numeric=True, monotone=-1),
                        Dimension("codec", tuple(codecs), lossless=True)], render)


@dataclass
class Point:
    spec: str
    ratio: float
    encode_throughput: float
    decode_throughput: float
    quality: float

    def profile(self) -> Profile:
        return Profile(self.spec, self.ratio, self.encode_throughput, self.decode_throughput, self.quality)


@dataclass
class ProfilerConfig:
    quality_threshold: float
    mode: str = "bo"
    max_evals: int = 80
    n_init: int = 6
    lambda0: float = 1.0  # lambda0 exp(-decay t) < 0.1 marks exploitation, when predicted-CR pruning starts
    decay: float = 0.1
    prune_eps: float = 0.05
    infeasible_margin: float = 0.02
    patience: int = 30
    refit_every: int = 8  # evaluations between GP hyperparameter fits, the profiler's own main cost
    fit_iters: int = 30
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("bo", "exhaustive", "random"):
            raise ValueError(f"mode must be bo, exhaustive or random, got {self.mode!r}")
        if min(self.max_evals, self.n_init, self.patience, self.refit_every, self.fit_iters) < 1:
            raise ValueError("max_evals, n_init, patience, refit_every and fit_iters must be >= 1")
        if self.lambda0 < 0 or self.decay < 0 or self.prune_eps < 0 or self.infeasible_margin < 0:
            raise ValueError("lambda0, decay, prune_eps and infeasible_margin must be >= 0")


@dataclass
class ProfilerResult:
    points: list[Point]
    best: Point | None  # highest ratio with quality >= threshold
    evaluations: int  # callback calls in this run (resumed points excluded)
    stopped: str = ""
    pareto: list[Profile] = field(default_factory=list)


class Profiler:
    def __init__(self, space: SearchSpace, evaluate: Evaluate, config: ProfilerConfig,
                 state_path: str | Path | None = None, on_eval: Callable[[int, Point], None] | None = None,
                 progress: bool | str = False, warm_start: Sequence[str] = ()) -> None:
        self.space, self.evaluate, self.cfg = space, evaluate, config
        self.state_path = Path(state_path) if state_path else None
        self.on_eval = on_eval
        self.progress = progress  # True or a label: a rich progress bar over the evaluations of ``run``
        self._tick: Callable[[Point], None] | None = None
        self.warm_start = list(warm_start)  # specs (e.g. published baselines) BO evaluates before its random design
        self.configs = space.configs()
        self.specs = [space.render(c) for c in self.configs]
        self.points: dict[int, Point] = {}
        self.calls = 0
        self._load()

    # --- state ---------------------------------------------------------------------------------------------
    def _load(self) -> None:
        if not self.state_path or not self.state_path.exists():
            return
        doc = json.loads(self.state_path.read_text())
        if doc.get("space") != self.space.signature() or doc.get("threshold") != self.cfg.quality_threshold:
            raise ValueError(f"{self.state_path}: state is for a different space or quality threshold")
        index = {s: i for i, s in enumerate(self.specs)}
        for d in doc["points"]:
            self.points[index[d["spec"]]] = Point(**d)

    def _save(self) -> None:
        if not self.state_path:
            return
        doc = {"space": self.space.signature(), "threshold": self.cfg.quality_threshold,
               "points": [asdict(p) for p in self.points.values()]}
        tmp = self.state_path.with_suffix(self.state_path.suffix + ".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.state_path)

    def _eval(self, i: int) -> Point:
        if i not in self.points:
            r, e, d, q = self.evaluate(self.specs[i])
            self.points[i] = Point(self.specs[i], float(r), float(e), float(d), float(q))
            self.calls += 1
            self._save()
            if self.on_eval:
                self.on_eval(self.calls, self.points[i])
            if self._tick:
                self._tick(self.points[i])
        return self.points[i]

    def _best(self) -> Point | None:
        ok = [p for p in self.points.values() if p.quality >= self.cfg.quality_threshold]
        return max(ok, key=lambda p: p.ratio) if ok else None

    # --- search --------------------------------------------------------------------------------------------
    def run(self) -> ProfilerResult:
        if not self.progress:
            return self._run()
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        n = len(self.configs)
        total = n if self.cfg.mode == "exhaustive" else min(n, self.cfg.max_evals)
        label = self.progress if isinstance(self.progress, str) else f"profiler ({self.cfg.mode})"
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[last]}"), transient=False) as bar:
            task = bar.add_task(label, total=max(0, total - len(self.points)), last="")

            def tick(p: Point) -> None:
                best = self._best()
                bar.update(task, advance=1, last=f"q={p.quality:.3f} cr={p.ratio:.2f}  best cr="
                           f"{best.ratio if best else float('nan'):.2f}  {p.spec}")
            self._tick = tick
            try:
                return self._run()
            finally:
                self._tick = None

    def _run(self) -> ProfilerResult:
        n = len(self.configs)
        rng = random.Random(self.cfg.seed)
        if self.cfg.mode == "exhaustive":
            for i in range(n):
                self._eval(i)
            stopped = "exhausted"
        elif self.cfg.mode == "random":
            order = list(range(n))
            rng.shuffle(order)
            for i in order[: self.cfg.max_evals]:
                self._eval(i)
            stopped = "budget"
        else:
            stopped = self._bo(rng)
        return self.result(stopped)

    def result(self, stopped: str = "") -> ProfilerResult:
        feas = [p.profile() for p in self.points.values() if p.quality >= self.cfg.quality_threshold]
        return ProfilerResult(list(self.points.values()), self._best(), self.calls, stopped, pareto_front(feas))

    def _bo(self, rng: random.Random) -> str:
        require("botorch", "transfer", "the Bayesian profiler")
        from botorch.fit import fit_gpytorch_mll
        from botorch.models import SingleTaskGP
        from botorch.models.transforms import Standardize
        from gpytorch.mlls import ExactMarginalLogLikelihood

        cfg, n = self.cfg, len(self.configs)
        X = torch.tensor(self.space.embed(self.configs), dtype=torch.double)
        cat = np.concatenate([self.space.embed(self.configs)[:, i: i + 1] for i in self._cat_columns()], 1)
        order = _OrderPruning(self.space, self.configs)
        alive = np.ones(n, bool)
        for i, p in self.points.items():  # resumed points: evaluated, and they prune as fresh ones do
            alive[i] = False
            order.prune(i, p.quality >= cfg.quality_threshold, alive)
        canon = {_canonical(s): i for i, s in enumerate(self.specs)}
        warm = [canon[c] for c in map(_canonical, self.warm_start) if c in canon and alive[canon[c]]]
        init = warm + [i for i in rng.sample(range(n), n) if alive[i] and i not in warm][
            : max(0, cfg.n_init - len(self.points) - len(warm))]
        for i in init:
            pt = self._eval(i)
            alive[i] = False
            order.prune(i, pt.quality >= cfg.quality_threshold, alive)
        hyper: dict[str, dict] = {}
        best, fails, t = self._best(), 0, 0
        while len(self.points) < cfg.max_evals:
            if not alive.any():
                return "exhausted"
            t += 1
            idx = list(self.points)
            Xe = X[idx]
            yq = torch.tensor([[self.points[i].quality] for i in idx], dtype=torch.double)
            yc = torch.tensor([[math.log(max(self.points[i].ratio, 1e-9))] for i in idx], dtype=torch.double)
            post = {}
            for key, y in (("q", yq), ("c", yc)):
                gp = SingleTaskGP(Xe, y, outcome_transform=Standardize(m=1))
                if key in hyper and t % cfg.refit_every:
                    gp.covar_module.load_state_dict(hyper[key]["covar"])
                    gp.likelihood.load_state_dict(hyper[key]["lik"])
                    gp.mean_module.load_state_dict(hyper[key]["mean"])
                else:
                    try:
                        fit_gpytorch_mll(ExactMarginalLogLikelihood(gp.likelihood, gp), max_attempts=1,
                                         warning_handler=lambda w: True,
                                         optimizer_kwargs={"options": {"maxiter": cfg.fit_iters, "maxfun": 2 * cfg.fit_iters}})
                    except Exception:  # noqa: BLE001 - a failed fit keeps default hyperparameters
                        pass
                    hyper[key] = {"covar": gp.covar_module.state_dict(), "lik": gp.likelihood.state_dict(),
                                  "mean": gp.mean_module.state_dict()}
                gp.eval()
                with torch.no_grad():
                    p = gp.posterior(X)
                    post[key] = (p.mean.squeeze(-1).numpy(), p.variance.clamp_min(1e-12).sqrt().squeeze(-1).numpy())
            mq, sq = post["q"]
            mc, sc = post["c"]
            cr = np.exp(mc)
            pfeas = ndtr((mq - cfg.quality_threshold) / sq)
            lam = cfg.lambda0 * math.exp(-cfg.decay * t)
            if best is None:
                a = pfeas[alive]
            else:  # constrained EI on the log ratio
                z = (mc - math.log(best.ratio)) / sc
                a = (pfeas * sc * (z * ndtr(z) + np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)))[alive]
            c = int(np.flatnonzero(alive)[int(np.argmax(a))])
            pt = self._eval(c)
            alive[c] = False
            order.prune(c, pt.quality >= cfg.quality_threshold, alive)
            if lam < 0.1:  # exploiting: bi-directional pruning on the predicted ratio
                if pt.quality >= cfg.quality_threshold:
                    alive &= ~(cr < pt.ratio * (1 - cfg.prune_eps))
                elif pt.quality < cfg.quality_threshold - cfg.infeasible_margin:
                    family = (cat == cat[c]).all(1)
                    alive &= ~(family & (cr > pt.ratio * (1 + cfg.prune_eps)))
            nb = self._best()
            if nb is not None and (best is None or nb.ratio > best.ratio):
                best, fails = nb, 0
            else:
                fails += 1
                if fails >= cfg.patience:
                    return "early-stop"
        return "budget"

    def _cat_columns(self) -> list[int]:
        cols, j = [], 0
        for d in self.space.dims:
            w = 1 if d.numeric else len(d.values)
            if not d.numeric:
                cols += range(j, j + w)
            j += w
        return cols or [0]

    def write_table(self, path: str | Path, workload: str = "", **info: Any) -> list[Profile]:
        """Write the Pareto set of the feasible evaluated points as a profile table; return it."""
        res = self.result()
        save_profiles(path, res.pareto, workload=workload, quality_threshold=self.cfg.quality_threshold,
                      evaluated=len(self.points), written=time.strftime("%Y-%m-%dT%H:%M:%S"), **info)
        return res.pareto


class _OrderPruning:
    """Exact pruning from the space's declared orders: with q monotone along every ``monotone`` dimension (and
    blind to ``lossless`` ones) and the ratio anti-monotone along them for a fixed codec, an infeasible point
    proves every configuration below it in quality order infeasible, and a feasible one proves every same-codec
    configuration above it no better in ratio. Configurations must agree on every other dimension."""

    def __init__(self, space: SearchSpace, configs: Sequence[dict[str, Any]]) -> None:
        mono = [d for d in space.dims if d.monotone]
        same = [d.name for d in space.dims if not d.monotone and not d.lossless]
        lossless = [d.name for d in space.dims if d.lossless]
        self.order = np.asarray([[c[d.name] * d.monotone for d in mono] for c in configs], float).reshape(
            len(configs), len(mono))
        self.same = _ids([tuple(c[k] for k in same) for c in configs])
        self.codec = _ids([tuple(c[k] for k in lossless) for c in configs])

    def prune(self, c: int, feasible: bool, alive: np.ndarray) -> None:
        """Clear in ``alive`` the configurations that evaluated point ``c`` rules out."""
        like = self.same == self.same[c]
        if feasible:
            alive &= ~(like & (self.codec == self.codec[c]) & (self.order >= self.order[c]).all(1))
        else:
            alive &= ~(like & (self.order <= self.order[c]).all(1))


def _ids(keys: list[tuple]) -> np.ndarray:
    index: dict[tuple, int] = {}
    return np.asarray([index.setdefault(k, len(index)) for k in keys])


def _canonical(spec: str) -> str:
    from .pipeline import Pipeline
    return Pipeline(spec).to_spec()


def measure(spec: str, kv: torch.Tensor, head_scores: torch.Tensor | None = None,
            repeats: int = 3) -> tuple[float, float, float]:
    """(ratio, encode bytes/s, decode bytes/s) of a pipeline on one request's KV; best of ``repeats``."""
    from .pipeline import Pipeline
    p = Pipeline(spec, head_scores)
    raw = kv.numel() * kv.element_size()
    enc = dec = math.inf
    blob = b""
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        blob = p.encode(kv)
        t1 = time.perf_counter()
        p.decode(blob)
        t2 = time.perf_counter()
        enc, dec = min(enc, t1 - t0), min(dec, t2 - t1)
    return raw / len(blob), raw / max(enc, 1e-9), raw / max(dec, 1e-9)
