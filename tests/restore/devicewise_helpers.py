"""Drivers and fault hooks for the device-wise restoration tests. They run inside the spawned shard processes,
so they live in an importable module (pickled by reference)."""
from __future__ import annotations

import dataclasses
from typing import Any

from kvtide.parallel.boundary import boundary_key
from kvtide.parallel.pipeline import PipelineEngine
from kvtide.store.keys import chunk_keys

FAULT_RANK = 1  # the downstream shard: the one with a boundary activation


def damage(eng: PipelineEngine, tokens: list[int], chunk: int, what: str, kind: str, layer_offset: int = 0) -> None:
    """On the downstream shard: make one stored entry missing or corrupt (one flipped payload byte).

    ``what``: "boundary" (its boundary activation of ``chunk``) or "kv" (its KV of ``chunk`` at its first layer +
    ``layer_offset``)."""
    if eng.rank != FAULT_RANK:
        return None
    C = eng.config.chunk_tokens
    key = chunk_keys(tokens[: (chunk + 1) * C], eng.keyspace)[chunk]
    lo = eng.layers.start
    k, layer = (boundary_key(key, lo), lo) if what == "boundary" else (key, lo + layer_offset)
    assert eng.tier.contains(k, layer), "the entry to damage is not in the store"
    if kind == "missing":
        eng.tier.delete(k, layer)
    else:
        name = k.entry_name(layer)
        blob = bytearray(eng.tier._read(name))  # fault injection: raw bytes of the tier
        blob[-7] ^= 0x5A
        eng.tier._write(name, bytes(blob))
    return None


def shard_stats(eng: PipelineEngine) -> dict[str, Any]:
    return {**dataclasses.asdict(eng.stats), "store": eng.tier.stats.snapshot()}


def set_link(eng: PipelineEngine, gigabits: float | None) -> None:
    eng.set_link(gigabits)


def _gen(eng: PipelineEngine, prompts: list[list[int]], n: int, **kw: Any) -> dict[str, Any]:
    outs = eng.generate(prompts, n, **kw)
    recs = [dataclasses.asdict(r) for r in eng.last_records]
    return {"tokens": [o.token_ids for o in outs], "cached": [o.cached_tokens for o in outs], "records": recs}


def scenarios(eng: PipelineEngine, convs: list[tuple[list[int], list[int]]], n: int) -> dict[str, Any]:
    """Every device-wise case on one pipeline (starting the processes is the slow part).

    ``convs``: (turn-1 prompt, turn-2 extra text) per conversation. Turn 2 = turn 1 + its output + extra.
    """
    out: dict[str, Any] = {}
    turn2 = []
    for a, extra in convs:
        o = eng.generate([a], n, restore=False, save=True)[0]
        turn2.append(a + o.token_ids + extra)
    b = turn2[0]
    out["turn2"] = turn2
    out["ref"] = _gen(eng, [b], n, restore=False, save=False)
    out["ref_batch"] = _gen(eng, turn2, n, restore=False, save=False)

    # Device-wise, every shard replaying its whole prefix from its boundary activation (recompute plan), then a
    # throttled link where CacheFlow's per-shard DP mixes recompute and loads, then Cake per shard.
    out["dw_recompute"] = _gen(eng, [b], n, method="recompute", devicewise=True, save=False)
    eng.call(set_link, 0.05)
    out["dw_cacheflow"] = _gen(eng, [b], n, method="cacheflow", devicewise=True, save=False)
    out["dw_batch"] = _gen(eng, turn2, n, method="cacheflow", devicewise=True, save=False)
    out["seq_cacheflow"] = _gen(eng, [b], n, method="cacheflow", devicewise=False, save=False)
    eng.call(set_link, None)
    out["seq_recompute"] = _gen(eng, [b], n, method="recompute", devicewise=False, save=False)
    out["dw_cake"] = _gen(eng, [b], n, method="cake", devicewise=True, save=False)
    # A slow link: the downstream shard reads its boundary rows for a while; shard 0 must not wait for that.
    eng.call(set_link, 0.02)
    out["dw_slow_boundary"] = _gen(eng, [b], n, method="recompute", devicewise=True, save=False)
    eng.call(set_link, None)

    # Faults on the downstream shard (fresh store state is not needed: a damaged entry is dropped when read).
    out["stats_before"] = eng.call(shard_stats)
    # save=True: the rows taken from upstream rewrite the damaged entry (and turn 2's new chunk is written).
    eng.call(damage, b, 1, "boundary", "missing")
    out["missing"] = _gen(eng, [b], n, method="recompute", devicewise=True, save=True)
    eng.call(damage, b, 2, "boundary", "corrupt")
    out["corrupt"] = _gen(eng, [b], n, method="recompute", devicewise=True, save=True)
    out["repaired"] = _gen(eng, [b], n, method="recompute", devicewise=True, save=False)
    # A lost KV entry: the executor re-runs from it, taking later boundary rows on demand.
    eng.call(damage, b, 3, "kv", "missing", 2)
    out["kv_missing"] = _gen(eng, [b], n, method="load", devicewise=True, save=False)
    # Double failure: that boundary activation gone too -> recompute the request through the whole pipeline.
    eng.call(damage, b, 3, "kv", "missing", 1)
    eng.call(damage, b, 3, "boundary", "missing")
    out["double"] = _gen(eng, [b], n, method="load", devicewise=True, save=False)
    out["stats_after"] = eng.call(shard_stats)
    return out


def set_observe(eng: PipelineEngine, on: bool) -> None:
    eng.set_observe(on)


def single_shard(eng: PipelineEngine, prompt: list[int], n: int) -> dict[str, Any]:
    """S = 1: device-wise and the single-device plan on the same store and a frozen profile (same inputs)."""
    eng.generate([prompt[:-20]], n, restore=False, save=True)
    eng.call(set_link, 0.05)  # loads cost something: CacheFlow mixes recompute and loads
    eng.generate([prompt], n, method="load", save=False)  # the link's rate, learned
    eng.call(set_observe, False)
    out = {"dw": _gen(eng, [prompt], n, method="cacheflow", devicewise=True, save=False),
           "seq": _gen(eng, [prompt], n, method="cacheflow", devicewise=False, save=False)}
    eng.call(set_observe, True)
    return out
