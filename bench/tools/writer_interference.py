"""How much the background store writer slows the engine thread, by record encoder.

The engine thread makes many short torch calls per step and releases the GIL in each; a writer thread that then
holds the GIL in long stretches (allocating, faulting in and copying a multi-megabyte record with ``b"".join``)
makes every one of those calls wait for it. This bench drains the same queue of KV chunks through a StoreWriter
into a memory store while the main thread runs "steps" of small torch ops, once with kvtide's encoder
(``encode_record``: one torch buffer, the KV copied in by torch and hashed by xxhash, both GIL-free) and once with
the joined-bytes encoder it replaced (kept here as the baseline), and reports the median step time against the
same steps with the writer idle, all in one process.

    python bench/tools/writer_interference.py                      # 8B-shape entries (2 MiB), ~1 min on 2 cores
    python bench/tools/writer_interference.py --out bench/results/writer_interference_cpu.json
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

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvtide.store import base  # noqa: E402
from kvtide.store.keys import KeySpace, chunk_keys, token_bytes  # noqa: E402
from kvtide.store.memory import MemoryStore  # noqa: E402
from kvtide.store.writer import StoreWriter  # noqa: E402


def encode_joined(key, layer, tokens, kv) -> bytes:
    """The earlier encoder, byte-identical output: parts hashed, then joined into one bytes object."""
    tok = token_bytes(tokens)
    payload = kv.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    meta = json.dumps({"key": key.hex, "layer": int(layer), "dtype": "bfloat16", "shape": list(kv.shape),
                       "num_tokens": len(tok) // 4, "byteorder": sys.byteorder}, separators=(",", ":")).encode()
    meta += b" " * (-(base.HEADER_BYTES + len(meta) + len(tok)) % base.PAYLOAD_ALIGN)
    h = xxhash.xxh3_128()
    for part in (meta, tok, payload):
        h.update(part)
    head = base._HEADER.pack(base.RECORD_MAGIC, base.RECORD_VERSION, 0, len(meta), len(tok) + payload.nbytes,
                             h.intdigest().to_bytes(16, "little"))
    return b"".join((head, meta, tok, payload))


class JoinedStore(MemoryStore):
    """A memory store whose puts encode with the joined-bytes encoder."""

    def put(self, key, layer, tokens, kv) -> int:
        blob = encode_joined(key, layer, tokens, kv)
        self._write(key.entry_name(layer), blob)
        return len(blob)


def step(x: torch.Tensor, ops: int) -> float:
    t = time.perf_counter()
    for _ in range(ops):
        x.add(1)
    return time.perf_counter() - t


def measure(store: MemoryStore, a: argparse.Namespace) -> dict:
    C = a.chunk_tokens
    ks = KeySpace("bench", C)
    toks = list(range(C * a.chunks))
    keys = chunk_keys(toks, ks)
    src = torch.randn(2, C * 8, a.kv_heads, a.head_dim).bfloat16()  # the writer gets slices, as from a page read
    x = torch.randn(64, 64)
    idle = [step(x, a.ops) for _ in range(a.steps)]
    w = StoreWriter(store)
    with w.held():  # queue everything first, then let it drain while the steps run
        for k in keys:
            i = k.index % 8
            w.submit(k, toks[k.index * C:(k.index + 1) * C], [src[:, i * C:(i + 1) * C]] * a.layers)
    t0 = time.perf_counter()
    busy = []
    while w.has_pending() and len(busy) < 100_000:
        busy.append(step(x, a.ops))
    w.flush()
    drain = time.perf_counter() - t0
    w.close()
    nbytes = a.chunks * a.layers * src[:, :C].numel() * 2
    return {"idle_step_ms_median": 1e3 * statistics.median(idle), "busy_step_ms_median": 1e3 * statistics.median(busy),
            "busy_steps": len(busy), "slowdown": statistics.median(busy) / statistics.median(idle),
            "drain_s": drain, "drain_gb_per_s": nbytes / drain / 1e9, "bytes": nbytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=100)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ops", type=int, default=1000, help="small torch calls per step")
    ap.add_argument("--steps", type=int, default=20, help="idle steps timed")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ks = KeySpace("bench", a.chunk_tokens)
    k0 = chunk_keys(list(range(a.chunk_tokens)), ks)[0]
    kv = torch.randn(2, a.chunk_tokens, a.kv_heads, a.head_dim).bfloat16()
    t0 = list(range(a.chunk_tokens))
    assert encode_joined(k0, 3, t0, kv) == bytes(base.encode_record(k0, 3, t0, kv)), "baseline writes other records"
    cap = 2 * a.chunks * a.layers * (4 << 20)
    runs = {"encode_record": [], "joined_bytes": []}
    for _ in range(a.reps):  # interleaved: both encoders see the same machine state
        runs["encode_record"].append(measure(MemoryStore(cap), a))
        runs["joined_bytes"].append(measure(JoinedStore(cap), a))
    summary = {name: {k: statistics.median(r[k] for r in rs) for k in ("idle_step_ms_median", "busy_step_ms_median",
                                                                         "slowdown", "drain_gb_per_s")}
               for name, rs in runs.items()}
    res = {"meta": {"date": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(),
                    "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                    "torch": torch.__version__, "xxhash": xxhash.VERSION, "torch_threads": a.threads,
                    "entry": f"[2, {a.chunk_tokens}, {a.kv_heads}, {a.head_dim}] bf16 (one chunk, one layer)",
                    "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}},
           "summary": summary, "runs": runs,
           "busy_slowdown_ratio_joined_over_encode_record":
               summary["joined_bytes"]["slowdown"] / summary["encode_record"]["slowdown"]}
    for name, s in summary.items():
        print(f"{name:14s} step {s['idle_step_ms_median']:.2f} ms idle, {s['busy_step_ms_median']:.2f} ms with the "
              f"writer draining ({s['slowdown']:.2f}x); writer {s['drain_gb_per_s']:.2f} GB/s")
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
