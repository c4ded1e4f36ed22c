"""The wide KVServe search space (issue 40): where a profiler's search strategy matters.

Dimensions: transform (none, CacheGen delta, QuaRot Hadamard on K and V or on K only, SmoothQuant-like affine,
per-channel power-of-two key scaling), quantizer family (per-token uniform, KIVI, front-to-back layer bands,
MixHQ per-head and MixLQ per-layer allocation from measured head scores), base bit width, group size, residual
outlier key channels kept in BF16, and codec. The default is 6 x 5 x 4 x 2 x 3 x 3 = 2160 pipelines, of which
720 differ in decoded values (codecs are exact: ``lossless``). Bits and outlier channels raise quality and lower
the ratio, larger groups the reverse (``monotone``); the profiler's order pruning relies on both.
``stratified_subset`` draws a seeded subset with every (transform, quantizer) pair equally represented, small
enough to enumerate as ground truth.
"""
from __future__ import annotations

import random
from collections import defaultdict
from typing import Any, Sequence

from .profiler import Dimension, SearchSpace

TRANSFORMS = ("none", "delta", "hadamard", "hadamard:on=k", "affine", "kscale")
QUANTS = ("uniform", "kivi", "layer", "mixhq", "mixlq")


def quantizer_spec(family: str, bits: int, group: int, outliers: int) -> str:
    """The quantizer stage of one configuration: ``bits`` is the family's base width (bands and head/layer
    classes derive theirs from it), ``outliers`` the number of BF16 key channels per (layer, head)."""
    b, g = bits, group
    body = {"uniform": f"k={b},v={b}", "kivi": f"k={b},v={b}",
            "layer": f"b={min(8, b + 2)}/{b}/{max(1, b - 1)}",
            "mixhq": f"hi={min(8, 2 * b)},lo={max(1, b // 2)}",
            "mixlq": f"hi={min(8, 2 * b)},lo={max(1, b // 2)},frac=0.5"}
    if family not in body:
        raise ValueError(f"quantizer family must be one of {sorted(body)}, got {family!r}")
    return f"{family}:{body[family]},g={g}" + (f",o={outliers}" if outliers else "")


def render(c: dict[str, Any]) -> str:
    return f"{c['transform']}|{quantizer_spec(c['quant'], c['bits'], c['group'], c['outliers'])}|{c['codec']}"


def wide_space(transforms: Sequence[str] = TRANSFORMS, quants: Sequence[str] = QUANTS,
               bits: Sequence[int] = (2, 3, 4, 6), groups: Sequence[int] = (32, 64),
               outliers: Sequence[int] = (0, 2, 4), codecs: Sequence[str] = ("pack", "zstd", "ans")) -> SearchSpace:
    """Product of the dimensions above (default 2160 configurations); narrower lists give smaller spaces."""
    return SearchSpace([Dimension("transform", tuple(transforms)), Dimension("quant", tuple(quants)),
                        Dimension("bits", tuple(bits), numeric=True, monotone=1),
                        Dimension("group", tuple(groups), numeric=True, monotone=-1),
                        Dimension("outliers", tuple(outliers), numeric=True, monotone=1),
                        Dimension("codec", tuple(codecs), lossless=True)], render)


def stratified_subset(space: SearchSpace, n: int, by: Sequence[str] = ("transform", "quant"),
                      seed: int = 0) -> SearchSpace:
    """``n`` configurations of ``space`` drawn without replacement, the strata (distinct values of ``by``)
    sharing them as evenly as possible (the remainder goes to randomly chosen strata); seeded."""
    configs = space.configs()
    if not 1 <= n <= len(configs):
        raise ValueError(f"subset size must be in [1, {len(configs)}], got {n}")
    names = {d.name for d in space.dims}
    if not set(by) <= names:
        raise ValueError(f"stratify by {list(by)}: unknown dimensions {sorted(set(by) - names)}")
    rng = random.Random(seed)
    strata: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for c in configs:
        strata[tuple(c[k] for k in by)].append(c)
    keys = sorted(strata, key=repr)
    for k in keys:
        rng.shuffle(strata[k])
    take = {k: 0 for k in keys}
    left = n
    while left:  # round-robin in a shuffled order, skipping exhausted strata
        order = [k for k in keys if take[k] < len(strata[k])]
        rng.shuffle(order)
        for k in order[:left]:
            take[k] += 1
        left -= min(left, len(order))
    return space.subset([c for k in keys for c in strata[k][: take[k]]])
