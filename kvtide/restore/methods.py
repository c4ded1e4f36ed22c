"""Restoration methods by name: CacheFlow's planner and the baselines, all returning a ``Plan``.

One table so the engine, the demo and the benchmark choose methods the same way and run every one of them
through the same executor and stores.
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvtide.restore.baselines import cake, layerwise, load_only, recompute_only
from kvtide.restore.costs import BlockCost, RestoreRequest
from kvtide.restore.planner import Plan, plan

PlanFn = Callable[[Sequence[RestoreRequest], BlockCost, float, int], Plan]

METHODS: dict[str, PlanFn] = {
    "cacheflow": plan,
    "recompute": recompute_only,
    "load": load_only,
    "cake": cake,
    "layerwise": layerwise,
}

LABELS = {
    "cacheflow": "CacheFlow (DP)",
    "recompute": "recompute-only",
    "load": "load-only",
    "cake": "Cake (token-wise)",
    "layerwise": "layer-wise",
}


def make_plan(method: str, requests: Sequence[RestoreRequest], cost: BlockCost, bandwidth: float, chunk: int) -> Plan:
    """The plan ``method`` picks for this batch (same cost model and inputs for every method)."""
    try:
        fn = METHODS[method]
    except KeyError:
        raise ValueError(f"unknown restore method {method!r}; choose from {', '.join(METHODS)}") from None
    return fn(list(requests), cost, bandwidth, chunk)
