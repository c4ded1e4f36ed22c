"""Per-step host work of the paged backends, old construction against new, in one process (CPU timings).

* the step layout's token ids: each sequence's prompt + output copied every step (``Sequence.token_ids``, as
  ``ModelRunner.layout`` did) vs ``Sequence.tokens`` slicing only the new token (batch 65 x 8,292 tokens);
* the page table from cached int32 arrays (``PageArrays``) vs from the Python lists through numpy;
* growth of 65 decoding sequences by a page each: the pool allocation per sequence (capacity check + 32 layers each,
  as the scheduler did) vs once for all (``BlockManager.allocate_all``);
* placement of a 65-page compression in a roomy pool: chunk by chunk for every group (the old ``_place``) vs one
  allocation per class first (the new one); both with today's ``ChunkPool`` (which sorts open chunks once per call);

* page table (FlashInfer-style indptr / indices / last page length): Python lists through torch.tensor, as the
  backends built it before, vs BatchLayout.page_table (numpy);
* the compressed pool's write: index recomputed in every layer's write vs ZipPagedKV.write_rows planned once;
* the chunk pool's bookkeeping when a step compresses 65 filled pages (every 16th decode step at batch 65): their
  raw slots freed one offset at a time (the old ChunkPool.free) vs grouped by chunk (numpy), in all 32 layers, each
  followed by the same re-allocation.
Shape: Llama-3.1-8B KV (32 layers, 8 KV heads, d 128, page 16), batch 48 decoding at 8,192 + 200 tokens.
Medians of interleaved repetitions. On a GPU these are host costs per decode step as well.

    python bench/tools/host_overhead.py
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kvtide.cache.zip_pages import ZipGeometry, ZipPagedKV  # noqa: E402
from kvtide.engine.attention import BatchLayout, PageArrays  # noqa: E402
from kvtide.engine.sampling_params import SamplingParams  # noqa: E402
from kvtide.engine.sequence import Sequence  # noqa: E402

B, P, L, H, D, KV = 48, 16, 32, 8, 128, 8192 + 200
FILLED = 65  # pages one compressing step frees, one per sequence


def free_one_by_one(pool, offsets) -> None:
    """ChunkPool.free as it was before 2026-11-29 (one Python iteration per slot), the baseline."""
    cb = pool.geo.chunk_bytes
    for off in np.asarray(offsets, dtype=np.int64).ravel().tolist():
        c = off // cb
        layer, k = int(pool.owner[c]), int(pool.klass[c])
        pool.slot_free[c].append((off - c * cb) // pool.geo.slot_bytes(k))
        pool.used[c] -= 1
        pool.open[layer][k].add(c)
        if k == 0:
            pool.raw_free_slots[layer] += 1
        if pool.used[c] == 0:
            pool._return_chunk(c)


def place_segmented(self, layer: int, cls: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
    """ZipPagedKV._place as it was before 2026-11-30 (raw chunk by raw chunk for every group), the baseline."""
    todo = np.nonzero(cls > 0)[0]
    if not len(todo):
        return
    chunk = old[todo] // self.alloc.geo.chunk_bytes
    todo = todo[np.argsort(chunk, kind="stable")]
    cuts = np.nonzero(np.diff(np.sort(chunk)))[0] + 1
    for seg in np.split(todo, cuts):
        for k in np.unique(cls[seg]).tolist():
            sel = seg[cls[seg] == k]
            offs = self.alloc.alloc(layer, k, len(sel))
            new[sel[: len(offs)]] = offs
            self.alloc.free(old[sel[: len(offs)]])


class _PoolOnly:
    """What ZipPagedKV._place touches, over a bookkeeping-only pool at the H200 run's geometry (no tensors)."""

    def __init__(self) -> None:
        from kvtide.cache.pool import ChunkPool, PoolGeometry

        self.alloc = ChunkPool(PoolGeometry(L, 2 * H, 4, 512, 1_044_480, 55_143, 1))  # 53.6 GiB, as on the H200
        self.counters = {"groups_in_place": 0, "in_place_waste_bytes": 0}
        self.geo = ZipGeometry(L, H, D, P)

    _alloc_into = ZipPagedKV._alloc_into  # the helpers _place calls
    _in_place = ZipPagedKV._in_place
    _room_for = getattr(ZipPagedKV, "_room_for", None)
    evictor = None


def plain_table(layout: BatchLayout):
    used = [-(-kv // P) for kv in layout.kv_lens]
    indices = [pid for table, n in zip(layout.block_tables, used) for pid in table[:n]]
    indptr = [0]
    for n in used:
        indptr.append(indptr[-1] + n)
    last = [kv - (n - 1) * P for kv, n in zip(layout.kv_lens, used)]
    i32 = torch.int32
    return torch.tensor(indptr, dtype=i32), torch.tensor(indices, dtype=i32), torch.tensor(last, dtype=i32)


def median_ms(fn, reps: int, inner: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t) / inner * 1e3)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "host_overhead_cpu.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    npg = -(-KV // P)
    layout = BatchLayout([1] * B, [KV] * B, [list(range(i * npg, (i + 1) * npg)) for i in range(B)],
                         torch.zeros(B, dtype=torch.long), P)
    assert all(torch.equal(x, y) for x, y in zip(plain_table(layout), layout.page_table()))
    store = ZipPagedKV(ZipGeometry(num_layers=L, num_kv_heads=H, head_dim=D, page_size=P),
                       budget_bytes=(B + 8) * ZipGeometry(L, H, D, P).raw_page_bytes)
    pids = list(range(B))
    store.alloc_pages(pids)
    slots = torch.tensor([p * P + 3 for p in pids])
    k, v = torch.randn(B, H, D).bfloat16(), torch.randn(B, H, D).bfloat16()

    def write(planned: bool) -> None:
        rows = store.write_rows(slots) if planned else None
        for layer in range(L):
            store.write(layer, k, v, slots, rows)

    pool = ZipPagedKV(ZipGeometry(L, H, D, P), budget_bytes=(FILLED + 16) * ZipGeometry(L, H, D, P).raw_page_bytes).alloc
    groups = FILLED * H * 2

    def alloc_free(bulk: bool) -> None:
        for layer in range(L):
            offs = pool.alloc(layer, 0, groups)
            pool.free(offs) if bulk else free_one_by_one(pool, offs)

    # the decode step's token ids, batch FILLED x 8,292 tokens
    seqs = []
    for i in range(FILLED):
        s = Sequence(str(i), None, list(range(8192)), SamplingParams())
        s.output_token_ids = list(range(100))
        s.num_computed_tokens = s.num_tokens - 1
        seqs.append(s)

    def ids_copy() -> list[int]:
        return [t for s in seqs for t in s.token_ids[s.num_computed_tokens:s.num_computed_tokens + 1]]

    def ids_slice() -> list[int]:
        return [t for s in seqs for t in s.tokens(s.num_computed_tokens, s.num_computed_tokens + 1)]

    assert ids_copy() == ids_slice()
    arrays = PageArrays()
    cached = BatchLayout([1] * B, [KV] * B, layout.block_tables, layout.slot_mapping, P, arrays(layout.block_tables))
    assert all(torch.equal(x, y) for x, y in zip(cached.page_table(), layout.page_table()))

    def table_arrays():
        BatchLayout([1] * B, [KV] * B, layout.block_tables, layout.slot_mapping, P,
                    arrays(layout.block_tables)).page_table()

    big = _PoolOnly()
    rng = np.random.default_rng(0)
    groups_per_layer = FILLED * H * 2

    def grow(per_sequence: bool) -> None:
        taken = []
        for _ in range(FILLED if per_sequence else 1):
            big.alloc.new_pages_fit(False)
            n = H * 2 if per_sequence else groups_per_layer
            taken += [big.alloc.alloc(layer, 0, n) for layer in range(L)]
        big.alloc.free(np.concatenate(taken))

    classes = [(rng.random((groups_per_layer, 4)) < np.where(np.arange(groups_per_layer) % 2, .93, .79)[:, None]).sum(1)
               for _ in range(L)]

    def place(new_way: bool) -> None:
        raw = [big.alloc.alloc(layer, 0, groups_per_layer) for layer in range(L)]
        dest = []
        for layer in range(L):
            new = raw[layer].copy()
            (ZipPagedKV._place if new_way else place_segmented)(big, layer, classes[layer], raw[layer], new)
            dest.append(np.where(classes[layer] > 0, new, raw[layer]))  # all-raw groups kept their raw slot
        big.alloc.free(np.concatenate(dest))  # back to the same state for the next repetition

    cases = {"layout_ids_token_ids_copy": ids_copy, "layout_ids_tokens_slice": ids_slice,
             "page_table_arrays": table_arrays,
             "grow_alloc_per_sequence": lambda: grow(True), "grow_alloc_all": lambda: grow(False),
             "place_chunk_by_chunk": lambda: place(False), "place_class_first": lambda: place(True),
             "page_table_lists": lambda: plain_table(layout), "page_table_numpy": layout.page_table,
             "write_per_layer_index": lambda: write(False), "write_rows_planned": lambda: write(True),
             "pool_free_one_by_one": lambda: alloc_free(False), "pool_free_bulk": lambda: alloc_free(True)}
    for fn in cases.values():  # warm-up
        fn()
    times = {name: [] for name in cases}
    for _ in range(10):  # interleaved
        for name, fn in cases.items():
            times[name] += median_ms(fn, 1, 10)
    med = {name: statistics.median(v) for name, v in times.items()}
    res = {"when": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(), "torch": torch.__version__,
           "torch_threads": 1, "shape": dict(batch=B, kv_tokens=KV, layers=L, kv_heads=H, head_dim=D, page_size=P,
                                             pages_compressed_per_step=FILLED,
                                             layout_and_growth_batch=FILLED, prompt_tokens=8192,
                                             pool_for_growth_and_placement="55,143 chunks of 1,044,480 B (H200 run)"),
           "ms_per_step_median": med, "samples_ms": times,
           "ratios": {"page_table": med["page_table_lists"] / med["page_table_numpy"],
                      "page_table_arrays_vs_numpy": med["page_table_numpy"] / med["page_table_arrays"],
                      "layout_ids": med["layout_ids_token_ids_copy"] / med["layout_ids_tokens_slice"],
                      "grow": med["grow_alloc_per_sequence"] / med["grow_alloc_all"],
                      "place": med["place_chunk_by_chunk"] / med["place_class_first"],
                      "write": med["write_per_layer_index"] / med["write_rows_planned"],
                      "pool_free": med["pool_free_one_by_one"] / med["pool_free_bulk"]}}
    out = a.out
    out.write_text(json.dumps(res, indent=1))
    for name, ms in med.items():
        print(f"{name:24s} {ms:7.2f} ms per step")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
