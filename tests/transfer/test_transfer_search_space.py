"""The wide KVServe space: size, valid and canonical specs, stratified subsets, and BO over it on a synthetic
deterministic objective (brute force gives the optimum)."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kvtide.transfer.pipeline import Pipeline
from kvtide.transfer.profiler import ProfilerConfig
from kvtide.transfer.search_space import QUANTS, TRANSFORMS, quantizer_spec, stratified_subset, wide_space
from kvtide.transfer.search_study import optimum, replay, summary
from kvtide.transfer.spec import parse_spec


def test_wide_space_size_and_specs_round_trip():
    space = wide_space()
    configs = space.configs()
    assert len(configs) == 2160 >= 1000
    specs = [space.render(c) for c in configs]
    canon = set()
    for s in specs:
        p = Pipeline(s)
        c = p.to_spec()
        assert Pipeline(c).to_spec() == c  # the canonical form is a fixed point
        assert parse_spec(c) == parse_spec(Pipeline(c).to_spec())
        canon.add(c)
    assert len(canon) == len(specs)  # distinct configurations are distinct pipelines
    quality_keys = {"|".join(c.split("|")[:2]) for c in canon}
    assert len(quality_keys) == 720


def test_wide_space_points_encode_and_decode():
    """One point per (transform, quantizer) pair, with outliers, on a small real-shaped KV: decodes within bound."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 2, 80, 2, 64, generator=g) * (0.3 + 2 * torch.rand(1, 2, 1, 2, 64, generator=g))).bfloat16()
    scores = torch.rand(4, 2, generator=g)
    space = wide_space(bits=(3,), groups=(32,), outliers=(2,), codecs=("ans",))
    assert len(space.configs()) == len(TRANSFORMS) * len(QUANTS)
    for c in space.configs():
        p = Pipeline(space.render(c), scores)
        blob = p.encode(x)
        y = p.decode(blob)
        err = (y.float() - x.float()).abs().max()
        assert err <= p.error_bound(blob) + 2.0**-8 * float(x.float().abs().max()) + 1e-4, space.render(c)


def test_quantizer_spec_rejects_unknown_family():
    assert quantizer_spec("kivi", 2, 64, 4) == "kivi:k=2,v=2,g=64,o=4"
    with pytest.raises(ValueError, match="quantizer family"):
        quantizer_spec("gptq", 4, 32, 0)


def test_stratified_subset():
    space = wide_space()
    sub = stratified_subset(space, 150, seed=3)
    cs = sub.configs()
    assert len(cs) == 150 and len({sub.render(c) for c in cs}) == 150
    counts = Counter((c["transform"], c["quant"]) for c in cs)
    assert len(counts) == 30 and set(counts.values()) == {5}
    assert {sub.render(c) for c in cs} <= {space.render(c) for c in space.configs()}
    again = stratified_subset(space, 150, seed=3).configs()
    assert again == cs and stratified_subset(space, 150, seed=4).configs() != cs
    odd = Counter((c["transform"], c["quant"]) for c in stratified_subset(space, 37, seed=0).configs())
    assert sum(odd.values()) == 37 and max(odd.values()) - min(odd.values()) <= 1
    assert sub.embed(cs).shape == (150, space.embed(space.configs()[:1]).shape[1])
    with pytest.raises(ValueError, match="subset size"):
        stratified_subset(space, 5000)
    with pytest.raises(ValueError, match="not a configuration"):
        space.subset([dict(cs[0], bits=5)])
    with pytest.raises(ValueError, match="listed twice"):
        space.subset([cs[0], cs[0]])


def synthetic_table(space) -> dict:
    """Deterministic stand-in for (ratio, _, _, quality): fewer bits and more outlier-free storage raise the ratio
    and lower quality; transforms and families shift quality, codecs scale the ratio."""
    tq = dict(zip(TRANSFORMS, (0.0, -0.01, 0.015, 0.01, 0.005, 0.012)))
    fq = dict(zip(QUANTS, (-0.01, 0.0, 0.004, 0.008, 0.006)))
    fr = dict(zip(QUANTS, (1.0, 0.93, 0.97, 0.82, 0.85)))
    cr = {"pack": 1.0, "zstd": 1.08, "ans": 1.15}
    table = {}
    for c in space.configs():
        b, g, o = c["bits"], c["group"], c["outliers"]
        ratio = 16 / (b + 32 / g + 0.25 * o) * fr[c["quant"]] * cr[c["codec"]]
        q = 1 - 0.5 * 2.0 ** (-1.3 * b) * (32 / g) ** -0.3 + tq[c["transform"]] + fq[c["quant"]] + 0.006 * math.sqrt(o)
        table[space.render(c)] = (ratio, 1.0, 1.0, q)
    return table


def test_bo_finds_brute_force_optimum_of_synthetic_objective():
    space = wide_space()
    table = synthetic_table(space)
    thr = 0.97
    ratio, best = optimum(table, thr)
    brute = max(r[0] for r in table.values() if r[3] >= thr)
    assert ratio == brute and len(best) >= 1
    runs = [replay(space, table, ProfilerConfig(thr, mode="bo", max_evals=80, seed=s)) for s in range(2)]
    assert all(r.best_ratio == pytest.approx(brute) for r in runs), [r.as_dict() for r in runs]
    assert all(r.found_at is not None and r.found_at <= 80 < len(table) for r in runs)
    s = summary(runs)
    assert s["reached"] == 2 and s["median_evaluations_to_optimum"] <= 80


def test_replay_counts_random_and_exhaustive():
    space = stratified_subset(wide_space(), 40, seed=1)
    table = synthetic_table(space)
    ex = replay(space, table, ProfilerConfig(0.97, mode="exhaustive"))
    assert ex.evaluations == 40 and ex.found_at is not None
    order = [space.render(c) for c in space.configs()]
    _, best = optimum(table, 0.97)
    assert ex.found_at == 1 + min(order.index(s) for s in best)  # exhaustive walks the subset in order
    rnd = replay(space, table, ProfilerConfig(0.97, mode="random", max_evals=40, seed=5))
    assert rnd.evaluations == 40 and rnd.found_at is not None and rnd.best_ratio == ex.best_ratio
    none = replay(space, table, ProfilerConfig(1.5, mode="random", max_evals=10))
    assert none.found_at is None and none.best_ratio is None
    assert summary([none])["median_evaluations_to_optimum"] is None
