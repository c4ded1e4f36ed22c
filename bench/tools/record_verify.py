"""Host time to verify one stored KV entry (``KVStore.open``), against its checksum alone and an earlier revision.

Why: a restoration's loads are verified on worker threads beside the compute thread. XXH3 releases the GIL; the
rest of a verify (header, metadata, token-id check, the zero-copy view) holds it, and every microsecond of that is
a microsecond the compute thread's kernel launches can wait. At the 8B shape a batch-1 restoration verifies ~260
entries of [2, 512, 8, 128] BF16 (2 MiB), so the Python part is worth measuring apart from the hash.

What: entries of that shape in a ``MemoryStore``, opened as the executor of each revision opens them (this tree:
each request's ids converted once by ``token_array`` and sliced per entry; older trees: list slices), the record
each of 8 entries opened 4 times, then hashed alone 4 times, after one untimed call each (the record in cache for
both: the hash is short and the Python part shows; with records cycled through memory the two passes' cache states
differed and the difference swung 20-75 us run to run). ``held_us`` = open - hash alone: the part of a verify
outside the checksum. ``zip_*``: the same for the same KV stored in the ZipFusion format (``store_codec="zip"``),
opened with ``decode=False`` as the executor does (trees that have it). ``--compare REV`` times REV's ``kvtide`` in a
child process, rounds alternating.

    python bench/tools/record_verify.py --compare HEAD~1 --out bench/results/record_verify_cpu.json
    python bench/tools/record_verify.py --compare 00d045a --out bench/results/record_verify_zip_cpu.json  # before the trim
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import rev_rounds  # bench/tools/, next to this script

ROOT = Path(__file__).resolve().parents[2]
SHAPE = (2, 512, 8, 128)


def measure(reps: int) -> dict[str, float]:
    """Median microseconds per open and per hash of the same record, with the kvtide on sys.path; with a ``zip_``
    prefix the same for ZipFusion-format records opened as the executor opens them (``decode=False``), on trees
    that have them."""
    import torch

    kv = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = _measure(reps, kv, "")
    try:
        from kvtide.store.zip_entry import from_tensor
    except ImportError:  # trees before the ZipFusion-format store
        return out
    return {**out, **_measure(reps, from_tensor(kv), "zip_", decode=False)}


def _measure(reps: int, kv, prefix: str, **open_kw) -> dict[str, float]:
    import torch
    import xxhash

    from kvtide.store.keys import KeySpace, chunk_keys
    from kvtide.store.memory import MemoryStore

    chunk = SHAPE[1]
    space = KeySpace("bench", chunk)
    ids = [int(x) for x in torch.randint(0, 128000, (8 * chunk + 16,), generator=torch.Generator().manual_seed(0))]
    keys = chunk_keys(ids, space)
    store = MemoryStore(1 << 30)
    for c, k in enumerate(keys):
        store.put(k, 3, ids[c * chunk:(c + 1) * chunk], kv)
    try:  # this tree: converted once per request, as the executor does
        from kvtide.store.base import token_array

        conv = token_array(ids)
    except ImportError:  # older trees: the executor sliced the list
        conv = ids
    blobs = store.fetch([(k, 3) for k in keys]).blobs
    out: dict[str, list[float]] = {"open_us": [], "hash_us": []}
    for _ in range(reps):  # per entry: 4 opens, then 4 hashes of the same record, in cache for all but the first
        for c, (k, blob) in enumerate(zip(keys, blobs)):
            ids_c = conv[c * chunk:(c + 1) * chunk]
            for name, fn in (("open_us", lambda: store.open(blob, k, 3, ids_c, copy=False, **open_kw)),
                             ("hash_us", lambda: xxhash.xxh3_128_intdigest(blob))):
                fn()
                for _ in range(4):
                    t0 = time.perf_counter()
                    fn()
                    out[name].append(1e6 * (time.perf_counter() - t0))
    res = {k: statistics.median(v) for k, v in out.items()}
    res["held_us"] = res["open_us"] - res["hash_us"]
    return {prefix + k: v for k, v in res.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=100, help="passes over the 8 entries per round")
    rev_rounds.add_args(ap, "store")
    a, rounds = rev_rounds.parse_and_run(ap, measure, __file__)
    if rounds is None:  # a --child round
        return 0
    res = rev_rounds.side_medians(rounds)
    for side, r in res.items():
        print(side, {k: round(v, 1) for k, v in r.items()})
    if "compare" in res:
        res["held_ratio_compare_over_this"] = res["compare"]["held_us"] / res["this"]["held_us"]
        print(f"GIL-held part per entry: {res['compare']['held_us']:.1f} -> {res['this']['held_us']:.1f} us")
        if "zip_held_us" in res["compare"] and "zip_held_us" in res["this"]:
            print(f"zip entries: {res['compare']['zip_held_us']:.1f} -> {res['this']['zip_held_us']:.1f} us")
    out = {"per_entry": res, "meta": {
        **rev_rounds.meta(a.compare), "xxhash": __import__("xxhash").VERSION,
        "entry": f"{list(SHAPE)} bfloat16 (the 8B shape's chunk-layer record, 2 MiB), MemoryStore, copy=False; zip_*: "
                 "the same KV (randn) as a ZipFusion-format record, opened with decode=False",
        "units": "microseconds per entry, median over rounds of the median over --reps passes of 8 entries"}}
    rev_rounds.write(out, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
