"""Search-cost study: how many evaluations BO and random search need to reach the exhaustive optimum.

Given a table of evaluations of every configuration of a space (deterministic, so replaying from the table
equals re-evaluating), the optimum is the highest ratio with quality >= threshold; a search run "reaches" it at
the first evaluation of a configuration with that ratio. Exhaustive search needs the whole space to *know* it
has the optimum, so its cost is the space size.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable

from .profiler import Point, Profiler, ProfilerConfig, SearchSpace

Row = tuple[float, float, float, float]  # (ratio, encode_throughput, decode_throughput, quality)


@dataclass(frozen=True)
class RunOutcome:
    mode: str
    seed: int
    found_at: int | None  # evaluations until the first optimal configuration; None: never reached
    evaluations: int  # evaluations the run used before it stopped
    stopped: str
    best_ratio: float | None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def optimum(table: dict[str, Row], threshold: float) -> tuple[float, set[str]] | None:
    """(best ratio among feasible rows, the specs that have it), or None when no row is feasible."""
    feas = {s: r for s, r in table.items() if r[3] >= threshold}
    if not feas:
        return None
    best = max(r[0] for r in feas.values())
    return best, {s for s, r in feas.items() if r[0] == best}


def replay(space: SearchSpace, table: dict[str, Row], config: ProfilerConfig) -> RunOutcome:
    """One search run (``config.mode``, ``config.seed``) over ``space`` answered from ``table``."""
    opt = optimum(table, config.quality_threshold)
    targets = opt[1] if opt else set()
    found: list[int] = []

    def on_eval(k: int, p: Point) -> None:
        if p.spec in targets and not found:
            found.append(k)

    ev: Callable[[str], Row] = table.__getitem__
    res = Profiler(space, ev, config, on_eval=on_eval).run()
    return RunOutcome(config.mode, config.seed, found[0] if found else None, res.evaluations, res.stopped,
                      res.best.ratio if res.best else None)


def summary(runs: list[RunOutcome]) -> dict[str, Any]:
    """Median and range of evaluations-to-optimum over the runs that reached it, and how many did."""
    hit = sorted(r.found_at for r in runs if r.found_at is not None)
    used = [r.evaluations for r in runs]
    return {"runs": len(runs), "reached": len(hit),
            "median_evaluations_to_optimum": statistics.median(hit) if hit else None,
            "min_evaluations_to_optimum": hit[0] if hit else None,
            "max_evaluations_to_optimum": hit[-1] if hit else None,
            "median_evaluations_used": statistics.median(used) if used else None,
            "max_evaluations_used": max(used) if used else None}
