"""Per-step host work of the paged backends, old construction against new, in one process (CPU timings).

* page table (FlashInfer-style indptr / indices / last page length): Python lists through torch.tensor, as the
  backends built it before, vs BatchLayout.page_table (numpy);
* the compressed pool's write: index recomputed in every layer's write vs ZipPagedKV.write_rows planned once;
* the chunk pool's bookkeeping when a step compresses 65 filled pages (every 16th decode step at batch 65): their
  raw slots freed one offset at a time (the old ChunkPool.free) vs grouped by chunk (numpy), in all 32 layers, each
  followed by the same re-allocation.
Shape: Llama-3.1-8B KV (32 layers, 8 KV heads, d 128, page 16), batch 48 decoding at 8,192 + 200 tokens.
Medians of interleaved repetitions. On a GPU these are host costs per decode step as well.

    python bench/host_overhead.py
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvtide.cache.zip_pages import ZipGeometry, ZipPagedKV  # noqa: E402
from kvtide.engine.attention import BatchLayout  # noqa: E402

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


def main() -> None:
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

    def place(bulk: bool) -> None:
        for layer in range(L):
            offs = pool.alloc(layer, 0, groups)
            pool.free(offs) if bulk else free_one_by_one(pool, offs)

    cases = {"page_table_lists": lambda: plain_table(layout), "page_table_numpy": layout.page_table,
             "write_per_layer_index": lambda: write(False), "write_rows_planned": lambda: write(True),
             "pool_free_one_by_one": lambda: place(False), "pool_free_bulk": lambda: place(True)}
    for fn in cases.values():  # warm-up
        fn()
    times = {name: [] for name in cases}
    for _ in range(10):  # interleaved
        for name, fn in cases.items():
            times[name] += median_ms(fn, 1, 10)
    med = {name: statistics.median(v) for name, v in times.items()}
    res = {"when": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(), "torch": torch.__version__,
           "torch_threads": 1, "shape": dict(batch=B, kv_tokens=KV, layers=L, kv_heads=H, head_dim=D, page_size=P,
                                             pages_compressed_per_step=FILLED),
           "ms_per_step_median": med, "samples_ms": times,
           "ratios": {"page_table": med["page_table_lists"] / med["page_table_numpy"],
                      "write": med["write_per_layer_index"] / med["write_rows_planned"],
                      "pool_free": med["pool_free_one_by_one"] / med["pool_free_bulk"]}}
    out = Path(__file__).resolve().parent / "results" / "host_overhead_cpu.json"
    out.write_text(json.dumps(res, indent=1))
    for name, ms in med.items():
        print(f"{name:24s} {ms:7.2f} ms per step")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
