"""Decode GEMM time against batch rows: does a batch of 66 pay more per weight byte than one of 52?

Why: at the Llama-3.1-8B shape the engine's decode step is attention plus ~7 ms of weight-bound work, and zip's
largest batch (66) runs its projections at more rows than FlashInfer's (52). A cuBLAS heuristic that switches tile
or split at 64 rows would show up here as a step in time that the engine bench cannot tell apart from attention.

Each projection of one decoder layer (and the LM head) is timed as bf16 ``F.linear`` over enough weight copies to
stream from HBM (no L2 reuse between calls), for a sweep of row counts, with the default BLAS and with cuBLASLt.
Also the fused shapes (q|k|v, gate|up) the model could use instead. CUDA only.

    python bench/tools/gemm_rows.py --out bench/results/gemm_rows_h200.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.engine_gpu import env  # noqa: E402

H, I, V, KV = 4096, 14336, 128256, 1024  # Llama-3.1-8B: hidden, intermediate, vocab, kv heads x head dim
SHAPES = {  # name: (out_features, in_features), per decoder layer unless noted
    "q": (H, H), "k": (KV, H), "v": (KV, H), "o": (H, H), "gate": (I, H), "up": (I, H), "down": (H, I),
    "lm_head (once)": (V, H), "qkv fused": (H + 2 * KV, H), "gate_up fused": (2 * I, H),
}
PER_LAYER = ("q", "k", "v", "o", "gate", "up", "down")


def time_linear(out_f: int, in_f: int, rows: int, reps: int, stream_bytes: int) -> float:
    """Median us of one F.linear call, weights cycled so each call reads its weight from HBM."""
    w_bytes = out_f * in_f * 2
    copies = max(2, -(-stream_bytes // w_bytes))
    ws = [torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, in_f, device="cuda", dtype=torch.bfloat16)
    for w in ws:  # warm: heuristics, workspace
        F.linear(x, w)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for w in ws:
            F.linear(x, w)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / copies)
    del ws
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="32,48,52,56,60,63,64,65,66,67,68,72,80,96,128")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--stream-mib", type=int, default=512, help="weight bytes cycled per timed loop")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gemm_rows needs a CUDA device")
    rows = [int(r) for r in a.rows.split(",")]
    result: dict = {"env": env(), "date": time.strftime("%Y-%m-%d"), "dtype": "bfloat16",
                    "shapes": {k: list(v) for k, v in SHAPES.items()}, "rows": rows,
                    "how": f"median of {a.reps} loops over weight copies totalling >= {a.stream_mib} MiB (HBM-bound, "
                           "no L2 reuse), us per call", "blas": {}}
    for lib in ("default", "cublaslt"):
        if lib == "cublaslt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
        per: dict = {}
        for name, (o, i) in SHAPES.items():
            per[name] = {str(m): round(time_linear(o, i, m, a.reps, a.stream_mib << 20), 2) for m in rows}
        layer = {str(m): round(sum(per[n][str(m)] for n in PER_LAYER), 2) for m in rows}
        model_ms = {str(m): round((32 * layer[str(m)] + per["lm_head (once)"][str(m)]) / 1e3, 3) for m in rows}
        gbs = {str(m): round(sum(SHAPES[n][0] * SHAPES[n][1] * 2 for n in PER_LAYER) / layer[str(m)] / 1e3, 0)
               for m in rows}
        result["blas"][lib] = {"per_shape_us": per, "layer_us": layer, "model_ms_32_layers_plus_head": model_ms,
                               "layer_weight_read_gb_s": gbs}
        print(f"{lib}: per layer us {layer}\n  32 layers + head ms {model_ms}\n  GB/s {gbs}", flush=True)
    torch.backends.cuda.preferred_blas_library("default")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
