"""Where a restoration's load path spends its time, piece by piece, alone and beside a compute thread.

The executor's I/O side does, per (chunk, layer) entry: verify the record (``store.open``: XXH3 over ~2 MiB, token
and shape checks), copy its KV into a pinned staging buffer (``_place_cuda``), one host-to-device copy per batch.
Verify + stage run on ``workers`` threads. This bench times each piece on this machine's memory-tier records
(8B shape: [2, 512, 8, 128] bf16 per entry), with 1, 2 and 4 threads and with torch's intra-op threads at the
default and at 1 (a torch ``copy_`` of a 2 MiB tensor may fan out to the intra-op pool from every worker at once),
and then the whole verify + stage + copy pipeline alone and beside a thread that launches a replay-like stream of
device work from Python (what the compute thread does during a staircase), which is the "loads run slower beside a
staircase" case of ``bench/restore.py``. Last, on CUDA, the whole host path of the two host tiers side by side: the
memory tier (verify + stage + one copy) and the pinned tier (``--store pinned``: verify, then DMA from the record).
Token ids go to ``open`` as the executor passes them: ``token_array`` slices (files before 2026-11-30's sixteenth
session passed list slices, and their verify ran the older, costlier checks).

    python bench/tools/load_path.py --out bench/results/load_path_<machine>.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvtide.store.base import token_array  # noqa: E402
from kvtide.store.keys import KeySpace, chunk_keys  # noqa: E402
from kvtide.store.memory import MemoryStore  # noqa: E402

CHUNK, HEADS, DIM = 512, 8, 128


def make_store(entries: int) -> tuple[MemoryStore, list]:
    store = MemoryStore(entries * (2 * CHUNK * HEADS * DIM * 2 + 8192) + (1 << 20))
    tokens = list(range(1, entries * CHUNK + 1))
    keys = chunk_keys(tokens, KeySpace("bench:load_path", CHUNK, "bfloat16"))
    ids = token_array(tokens)  # as the executor passes them: converted once, sliced per entry
    g = torch.Generator().manual_seed(0)
    items = []
    for c, k in enumerate(keys):
        kv = torch.randn(2, CHUNK, HEADS, DIM, generator=g).to(torch.bfloat16)
        store.put(k, 0, tokens[c * CHUNK:(c + 1) * CHUNK], kv)
        items.append((k, ids[c * CHUNK:(c + 1) * CHUNK]))
    return store, items


def timed(fn, reps: int) -> float:
    """Median seconds of ``reps`` calls after one warm-up."""
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


class Pieces:
    def __init__(self, store: MemoryStore, items: list, cuda: bool):
        self.store, self.items, self.cuda = store, items, cuda
        f = store.fetch([(k, 0) for k, _ in items])
        self.blobs = f.blobs
        self.nbytes = sum(len(b) for b in self.blobs)
        self.kv = [store.open(b, k, 0, t, copy=False).tensor for b, (k, t) in zip(self.blobs, items)]
        self.payload = sum(x.numel() * x.element_size() for x in self.kv)
        self.host = torch.empty(self.payload, dtype=torch.uint8, pin_memory=cuda)
        self.offs = np.cumsum([0] + [x.numel() * x.element_size() for x in self.kv]).tolist()

    def run(self, workers: int, fn) -> None:
        if workers <= 1:
            for i in range(len(self.items)):
                fn(i)
        else:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(fn, range(len(self.items))))

    def verify(self, i: int) -> None:
        k, t = self.items[i]
        self.store.open(self.blobs[i], k, 0, t, copy=False)

    def stage_torch(self, i: int) -> None:
        self.host[self.offs[i]:self.offs[i + 1]].copy_(self.kv[i].reshape(-1).view(torch.uint8))

    def stage_numpy(self, i: int) -> None:
        np.copyto(self.host[self.offs[i]:self.offs[i + 1]].numpy(), self.kv[i].reshape(-1).view(torch.uint8).numpy())

    def verify_stage(self, i: int) -> None:
        self.verify(i)
        self.stage_torch(i)

    def h2d(self) -> None:
        self.host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()


def replay_like(stop: threading.Event, counter: list[int]) -> None:
    """A compute thread: layer-sized device work launched op by op from Python (~40 ops a layer)."""
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(10):
            y = x @ w
            y = y * 0.5 + 1.0
            y = torch.nn.functional.silu(y)
            x = (y @ w).clamp_(-1, 1)
        torch.cuda.synchronize()  # keep the queue short, as a staircase's layers pace the host
        counter[0] += 1


def pinned_tier(store: MemoryStore, items: list, reps: int, nbytes: int) -> dict:
    """The executor's whole host path per fetch, both tiers, with 1/2/4 workers, alone and beside compute:
    memory tier = verify + stage (workers) then one H2D; pinned tier = verify (workers) then one H2D per entry
    straight from its record (DMA), as ``_place_cuda(direct=True)`` does."""
    from kvtide.store.pinned import PinnedMemoryStore

    pinned = PinnedMemoryStore.filled_from(store, store.capacity_bytes)
    f = pinned.fetch([(k, 0) for k, _ in items])
    pp = Pieces(store, items, True)
    kv = [pinned.open(b, k, 0, t, copy=False).tensor for b, (k, t) in zip(f.blobs, items)]
    dev = torch.empty(pp.payload, dtype=torch.uint8, device="cuda")

    def memory_path(w: int) -> None:
        pp.run(w, pp.verify_stage)
        pp.h2d()

    def pinned_path(w: int) -> None:
        def verify(i: int) -> None:
            k, t = items[i]
            pinned.open(f.blobs[i], k, 0, t, copy=False)
        pp.run(w, verify)
        for i, x in enumerate(kv):
            dev[pp.offs[i]:pp.offs[i + 1]].copy_(x.reshape(-1).view(torch.uint8), non_blocking=True)
        torch.cuda.synchronize()

    out: dict = {"pinned": pinned.pinned}
    for beside in (False, True):
        stop, counter = threading.Event(), [0]
        th = threading.Thread(target=replay_like, args=(stop, counter), daemon=True) if beside else None
        if th is not None:
            th.start()
            time.sleep(0.2)
        for w in (1, 2, 4):
            for name, fn in (("memory_verify_stage_h2d", memory_path), ("pinned_verify_dma", pinned_path)):
                key = f"{name}_{w}_workers_{'beside_compute' if beside else 'alone'}_gbps"
                out[key] = nbytes / timed(lambda: fn(w), reps) / 1e9  # noqa: B023
                print(key, round(out[key], 2))
        if th is not None:
            stop.set()
            th.join()
    f.release()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=64, help="2 MiB entries per pass")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    store, items = make_store(a.entries)
    p = Pieces(store, items, cuda)
    gbs = lambda s: p.nbytes / s / 1e9  # noqa: E731
    default_threads = torch.get_num_threads()
    rows = []
    for threads in sorted({default_threads, 1}, reverse=True):
        torch.set_num_threads(threads)
        for w in (1, 2, 4):
            row = {"torch_threads": threads, "workers": w}
            for name, fn in (("verify", p.verify), ("stage_torch", p.stage_torch), ("stage_numpy", p.stage_numpy),
                             ("verify_stage", p.verify_stage)):
                row[name + "_gbps"] = gbs(timed(lambda: p.run(w, fn), a.reps))  # noqa: B023
            rows.append(row)
            print(json.dumps(row))
    torch.set_num_threads(default_threads)
    out = {"pieces": rows}
    if cuda:
        out["h2d_pinned_gbps"] = p.payload / timed(p.h2d, a.reps) / 1e9
        pipe = {}
        for threads in sorted({default_threads, 1}, reverse=True):
            torch.set_num_threads(threads)
            alone = gbs(timed(lambda: p.run(2, p.verify_stage), a.reps))
            stop, counter = threading.Event(), [0]
            th = threading.Thread(target=replay_like, args=(stop, counter), daemon=True)
            th.start()
            time.sleep(0.2)
            c0, t0 = counter[0], time.perf_counter()
            beside = gbs(timed(lambda: p.run(2, p.verify_stage), a.reps))
            rate = (counter[0] - c0) / (time.perf_counter() - t0)
            stop.set()
            th.join()
            pipe[f"threads_{threads}"] = {"verify_stage_2_workers_alone_gbps": alone,
                                          "verify_stage_2_workers_beside_compute_gbps": beside,
                                          "compute_thread_rounds_per_s": rate}
            print(threads, pipe[f"threads_{threads}"])
        torch.set_num_threads(default_threads)
        out["beside_compute"] = pipe
        out["pinned_tier"] = pinned_tier(store, items, a.reps, p.nbytes)
    out["meta"] = {"when": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(),
                   "cpus": os.cpu_count(), "torch": torch.__version__, "default_torch_threads": default_threads,
                   "gpu": torch.cuda.get_device_name() if cuda else None, "entries": a.entries,
                   "entry_shape": [2, CHUNK, HEADS, DIM], "dtype": "bfloat16", "record_bytes": p.nbytes,
                   "units": "GB/s of record bytes (h2d: payload bytes), medians of --reps passes"}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
