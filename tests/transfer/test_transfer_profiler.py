import json
import math

import numpy as np
import pytest

from kvtide.transfer.profiler import (Dimension, Profiler, ProfilerConfig, SearchSpace, _OrderPruning, measure,
                                      pipeline_space)
from kvtide.transfer.table import load_profiles


def synthetic():
    """Smooth, mostly monotone CR/quality landscape like real pipelines: fewer bits -> higher CR, lower quality."""
    space = SearchSpace([Dimension("transform", ("none", "delta", "hadamard")),
                         Dimension("bits", (2, 3, 4, 5, 6, 8), numeric=True, monotone=1),
                         Dimension("group", (16, 32, 64, 128), numeric=True, monotone=-1),
                         Dimension("codec", ("pack", "zstd", "ans"), lossless=True)],
                        lambda c: f"{c['transform']}|uniform:k={c['bits']},v={c['bits']},g={c['group']}|{c['codec']}")
    tq = {"none": 0.0, "delta": -0.004, "hadamard": 0.012}
    cg = {"pack": 1.0, "zstd": 1.12, "ans": 1.2}
    calls = []

    def evaluate(spec):
        calls.append(spec)
        t, q, c = spec.split("|")
        bits = int(q.split("k=")[1].split(",")[0])
        g = int(q.split("g=")[1].split(",")[0]) if "g=" in q else 32
        ratio = 16 / (bits + 32 / g) * cg[c.split(":")[0]]
        quality = 1 - 0.6 * 2.0 ** (-1.6 * bits) * (g / 32) ** 0.5 + tq[t] - 0.0005 * (bits == 8)
        return ratio, 1e9 / (1 + 0.1 * bits), 2e9 * cg[c.split(":")[0]] ** -2, quality

    return space, evaluate, calls


def test_bo_finds_exhaustive_optimum_with_fewer_evaluations(tmp_path):
    space, ev, calls = synthetic()
    thr = 0.97
    ex = Profiler(space, ev, ProfilerConfig(thr, mode="exhaustive")).run()
    assert ex.evaluations == len(space.configs()) == 216
    n_ex = len(calls)
    calls.clear()
    bo = Profiler(space, ev, ProfilerConfig(thr, mode="bo", max_evals=70, seed=1)).run()
    assert bo.best is not None and bo.best.ratio == pytest.approx(ex.best.ratio)
    assert bo.evaluations < n_ex / 3, bo.evaluations


def test_random_mode_and_budget():
    space, ev, calls = synthetic()
    r = Profiler(space, ev, ProfilerConfig(0.97, mode="random", max_evals=17)).run()
    assert r.evaluations == 17 == len(set(calls))


def test_resume_and_table(tmp_path):
    space, ev, calls = synthetic()
    state = tmp_path / "state.json"
    p1 = Profiler(space, ev, ProfilerConfig(0.97, mode="random", max_evals=10), state_path=state)
    p1.run()
    assert len(json.loads(state.read_text())["points"]) == 10
    calls.clear()
    p2 = Profiler(space, ev, ProfilerConfig(0.97, mode="exhaustive"), state_path=state)
    res = p2.run()
    assert len(calls) == 216 - 10 and res.evaluations == 206
    front = p2.write_table(tmp_path / "table.json", workload="prose")
    loaded = load_profiles(tmp_path / "table.json")
    assert [p.name for p in loaded] == [p.name for p in front] and loaded
    assert all(p.quality >= 0.97 for p in loaded)
    assert max(p.ratio for p in loaded) == pytest.approx(res.best.ratio)
    with pytest.raises(ValueError):
        Profiler(space, ev, ProfilerConfig(0.9), state_path=state)  # other threshold: not the same run


def test_pipeline_space_renders_valid_specs():
    import torch

    from kvtide.transfer.pipeline import Pipeline
    space = pipeline_space()
    specs = [space.render(c) for c in space.configs()]
    assert len(specs) == 640
    for s in specs:
        Pipeline(s)
    kv = (torch.randn(2, 2, 64, 2, 64)).bfloat16()
    ratio, enc, dec = measure("hadamard|kivi:k=2,v=2|ans", kv, repeats=1)
    assert ratio > 1.5 and enc > 0 and dec > 0 and math.isfinite(enc)


def test_config_validation():
    with pytest.raises(ValueError):
        ProfilerConfig(0.9, mode="grid")
    with pytest.raises(ValueError):
        Dimension("x", ())
    with pytest.raises(ValueError, match="monotone needs a numeric"):
        Dimension("codec", ("a", "b"), monotone=1)
    with pytest.raises(ValueError, match="monotone must be"):
        Dimension("bits", (2, 4), numeric=True, monotone=2)
    with pytest.raises(ValueError, match="lossless"):
        Dimension("bits", (2, 4), numeric=True, monotone=1, lossless=True)


def test_order_pruning_only_discards_points_that_cannot_beat_the_evaluated_one():
    """On a space whose declared orders hold, every point pruned after evaluating c is infeasible (c infeasible)
    or no higher in ratio than c (c feasible): the optimum survives unless c ties it."""
    space, ev, _ = synthetic()
    configs = space.configs()
    rows = [ev(space.render(c)) for c in configs]
    thr = 0.97
    order = _OrderPruning(space, configs)
    pruned_any = {True: 0, False: 0}
    for c, (ratio, _, _, q) in enumerate(rows):
        alive = np.ones(len(configs), bool)
        order.prune(c, q >= thr, alive)
        gone = np.flatnonzero(~alive)
        assert c in gone
        for j in gone:
            if q >= thr:
                assert rows[j][0] <= ratio, (configs[c], configs[j])
            else:
                assert rows[j][3] < thr, (configs[c], configs[j])
        pruned_any[bool(q >= thr)] += len(gone) > 1
    assert pruned_any[True] and pruned_any[False]  # both directions fire on this space


def test_order_pruning_without_declared_orders_keeps_other_configurations():
    space = SearchSpace([Dimension("bits", (2, 3, 4), numeric=True), Dimension("codec", ("pack", "ans"))],
                        lambda c: f"none|uniform:k={c['bits']},v={c['bits']}|{c['codec']}")
    alive = np.ones(6, bool)
    _OrderPruning(space, space.configs()).prune(2, False, alive)
    assert alive.sum() == 5 and not alive[2]


def test_bo_warm_start_evaluates_given_specs_first():
    space, ev, calls = synthetic()
    seeds = ["hadamard|uniform:k=3,v=3,g=64|ans", "none|uniform:k=2,v=2,g=16|pack", "affine|uniform:k=2,v=2,g=16|pack"]  # last: not in space
    Profiler(space, ev, ProfilerConfig(0.97, mode="bo", max_evals=8, n_init=4), warm_start=seeds).run()
    assert calls[:2] == seeds[:2] and len(calls) == 8
