"""Step-loop host time to hand a finished request's chunks to the store writer, ZipFusion-encoded and plain.

Why: with ``RestoreConfig(store_codec="zip")`` the engine thread encodes each finished request's chunks on the GPU
before the copy-out (``ChunkReader.read_zip``). In the H200 trace replays of 2026-11-30 that cost the step loop
0.49-0.60 s per closed-loop run against 0.05 s for the plain copy-out (~20 ms per 8K-token request), time every
queued request waits, and it lowered the recompute-only saturation of the zip runs by 5%.

What: a dense paged cache of the 8B shape (32 layers, 8 KV heads, head dim 128, page 16, bf16; random normal
values) on CUDA, and one 8192-token request's pages (scattered) read as 512-token chunks: ``host_ms`` is the time
until the call returns (what the step loop pays), ``done_ms`` until its event completes (the side stream's copy
and encode). Rounds alternate this tree's ``read_zip`` and ``read`` with ``--compare REV``'s (child process);
``pinned_grows`` counts how often torch's pinned host cache grew over the calls (each a ``cudaHostAlloc`` on the
step loop). On a CPU the shape shrinks to 4 layers and 1024 tokens (a smoke run; the CPU path has no side stream).

    python bench/tools/zip_write_path.py --compare 3a10a12 --out bench/results/zip_write_path_h200.json
"""
from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import statistics
import sys
import time

import rev_rounds  # bench/tools/, next to this script

LAYERS, HEADS, DIM, PAGE, CHUNK, TOKENS = 32, 8, 128, 16, 512, 8192
POOL_PAGES = 1024


def _shape(cuda: bool) -> tuple[int, int]:
    return (LAYERS, TOKENS) if cuda else (4, 1024)


def measure(reps: int) -> dict[str, float]:
    """Median host and completion milliseconds of ``read_zip`` and ``read`` for one request, with the kvtide on
    sys.path."""
    from types import SimpleNamespace

    import torch

    try:
        from kvtide.engine.chunk_reader import ChunkReader
    except ImportError:  # trees before chunk_reader.py
        from kvtide.engine.restore_port import ChunkReader

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    layers, tokens = _shape(cuda)
    g = torch.Generator(device=dev).manual_seed(0)
    caches = [torch.randn(POOL_PAGES, 2, PAGE, HEADS, DIM, generator=g, device=dev).to(torch.bfloat16)
              for _ in range(layers)]
    runner = SimpleNamespace(model=SimpleNamespace(args=SimpleNamespace(num_layers=layers, num_kv_heads=HEADS,
                                                                        head_dim=DIM)),
                             page_size=PAGE, device=dev, kv_caches=caches, store=None)
    reader = ChunkReader(runner)
    perm = torch.randperm(POOL_PAGES, generator=torch.Generator().manual_seed(1))
    page_ids = [int(x) for x in perm[:tokens // PAGE]]
    per_chunk = "chunk" in inspect.signature(reader.read).parameters  # trees after 3106837 read whole chunks
    calls = {"zip": lambda: reader.read_zip(page_ids, CHUNK),
             "plain": (lambda: reader.read(page_ids, CHUNK)) if per_chunk else (lambda: reader.read(page_ids))}
    grows = _pinned_grows()
    times: dict[str, list[float]] = {f"{k}_{w}": [] for k in calls for w in ("host_ms", "done_ms")}
    for i in range(reps + 1):  # the first call of each is untimed (Triton compile, pinned allocations)
        for name, fn in calls.items():
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out, ready = fn()
            t1 = time.perf_counter()
            if ready is not None:
                ready.synchronize()
            t2 = time.perf_counter()
            del out, ready
            if i:
                times[f"{name}_host_ms"].append(1e3 * (t1 - t0))
                times[f"{name}_done_ms"].append(1e3 * (t2 - t0))
    out = {k: statistics.median(v) for k, v in times.items()}
    if grows is not None:  # how often torch's pinned cache grew over these calls (cudaHostAlloc on the step loop)
        out["pinned_grows"] = _pinned_grows() - grows
    return out


def _pinned_grows() -> int | None:
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    return stats().get("num_host_alloc", 0) if torch.cuda.is_available() and stats is not None else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10, help="requests read per round (each way)")
    rev_rounds.add_args(ap, "ChunkReader")
    a, rounds = rev_rounds.parse_and_run(ap, measure, __file__)
    if rounds is None:  # a --child round
        return 0
    res = rev_rounds.side_medians(rounds)
    for side, r in res.items():
        print(side, {k: round(v, 2) for k, v in r.items()})
        r["rounds"] = rounds[side]
    if "compare" in res:
        res["zip_host_ratio_compare_over_this"] = res["compare"]["zip_host_ms"] / res["this"]["zip_host_ms"]
        print(f"read_zip host time per request: {res['compare']['zip_host_ms']:.2f} -> "
              f"{res['this']['zip_host_ms']:.2f} ms (plain read: {res['this']['plain_host_ms']:.2f} ms)")
    import torch

    cuda = torch.cuda.is_available()
    layers, tokens = _shape(cuda)
    out = {"per_request": res, "meta": {
        **rev_rounds.meta(a.compare), "device": torch.cuda.get_device_name() if cuda else "cpu",
        "triton": _version("triton"),
        "request": f"{tokens} tokens in {tokens // CHUNK} chunks of {CHUNK}, {layers} layers x [2, {CHUNK}, {HEADS}, "
                   f"{DIM}] bfloat16 (the 8B shape), pages of {PAGE} scattered in a pool of {POOL_PAGES}; random "
                   "normal values",
        "units": "milliseconds per request: median over rounds of the median over --reps requests; host_ms until "
                 "the call returns (the step loop's cost), done_ms until its event completes"}}
    rev_rounds.write(out, a.out)
    return 0


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
