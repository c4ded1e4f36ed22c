"""KVServe profiles on the GPU: encode and decode throughput of every packaged profile, its ratio, and its B*.

For each profile of the packaged tables (kvtide/transfer/data/profiles_<model>.json) the pipeline runs with every stage
on the device: transform and quantizer in torch, and the entropy stage on nvCOMP where it is installed (``zstd`` ->
``nvzstd``, ``lz4`` -> ``nvlz4``, ``ans`` -> ``nvans``; the row is named by the spec that ran). Without nvCOMP the
CPU entropy stages run (noted in the JSON). Timing: CUDA events around ``Pipeline.encode`` (KV on the GPU -> blob
bytes on the host) and ``Pipeline.decode(blob, device)`` (blob bytes -> BF16 KV on the GPU), median of ``--reps``
after ``--warmup``; throughput is BF16 KV bytes over seconds. B* (KVServe Theorem 6.1, Eq. 5) is
``s_p (1 - 1/cr_p)`` with ``1/s_p = 1/encode + 1/decode``: compression pays below that bandwidth.

KV: Llama-3.1-8B shape (32 layers, 8 KV heads, head_dim 128), 8K tokens, tiled from 16-row groups of real-model
K and V rows in ``--real-kv`` (bench/data/real_kv.safetensors, see bench/gpu.py) when present, else random normal
BF16 (stated in the JSON; its ratios then say nothing about real KV and the table keeps the profiled ratios).
MixHQ head scores at that shape are seeded random (the bit split by ``frac`` is what the timing depends on).

``--write-table DIR`` writes ``profiles_<model>_gpu.json`` per source table in table.py's format, with the measured
rates; the copies in kvtide/transfer/data are what a GPU instance's transfer policy reads (policy.packaged_table). ``--device cpu`` (small default shape) smokes the same code on a CPU.

    python bench/kvserve_gpu.py --out $OUT/kvserve_gpu.json --write-table $OUT
    python bench/kvserve_gpu.py --device cpu --tokens 128 --layers 2 --reps 1
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402
from kvtide.transfer import nvcodecs  # noqa: E402
from kvtide.transfer.controller import Profile  # noqa: E402
from kvtide.transfer.pipeline import Pipeline  # noqa: E402
from kvtide.transfer.spec import format_spec, parse_spec  # noqa: E402
from kvtide.transfer.spec import StageSpec  # noqa: E402
from kvtide.transfer.table import load_profiles, save_profiles  # noqa: E402

DATA = ROOT / "kvtide" / "transfer" / "data"
RESULTS = ROOT / "bench" / "results"
REAL_KV = ROOT / "bench" / "data" / "real_kv.safetensors"
NV = {"zstd": "nvzstd", "lz4": "nvlz4", "ans": "nvans"}
GBPS = 1e9 / 8


def source_tables() -> list[Path]:
    """The packaged CPU-profiled tables (not the ``*_gpu.json`` ones this benchmark writes)."""
    return sorted(p for p in DATA.glob("profiles_*.json") if not p.stem.endswith("_gpu"))


def device_spec(spec: str, nv: bool) -> str:
    """The spec that runs every stage on the device: the CPU entropy codec swapped for its nvCOMP stage."""
    t, q, c = parse_spec(spec)
    if nv and c.name in NV:
        c = StageSpec(NV[c.name], ())
    return Pipeline(format_spec((t, q, c))).to_spec()


def make_kv(layers: int, tokens: int, heads: int, dim: int, device: str, real: Path | None, seed: int
            ) -> tuple[torch.Tensor, str]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    if real is not None and real.exists():
        from safetensors import safe_open
        with safe_open(str(real), "pt") as f:
            k, v = f.get_tensor("k_rows"), f.get_tensor("v_rows")
        if k.shape[-1] == dim:
            rows = 16
            kg, vg = (a[: a.shape[0] // rows * rows].view(-1, rows, dim) for a in (k, v))
            n = -(-tokens // rows)
            kv = torch.empty(layers, 2, n * rows, heads, dim, dtype=torch.bfloat16)
            for i, bank in enumerate((kg, vg)):
                pick = torch.randint(0, bank.shape[0], (layers, n, heads), generator=g)
                kv[:, i] = bank[pick].permute(0, 1, 3, 2, 4).reshape(layers, n * rows, heads, dim)
            return kv[:, :, :tokens].contiguous().to(device), f"real: 16-row groups of {real.name} (K and V rows)"
    kv = (torch.randn(layers, 2, tokens, heads, dim, generator=g) * 0.5).to(torch.bfloat16).to(device)
    return kv, "random normal BF16 (sd 0.5): no real-KV capture found; ratios are not those of real KV"


def timed(fn, device: str, warmup: int, reps: int) -> tuple[list[float], object]:
    out = None
    for _ in range(warmup):
        out = fn()
    ts = []
    for _ in range(reps):
        if device.startswith("cuda"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            out = fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            out = fn()
            ts.append(time.perf_counter() - t)
    return ts, out


def measure(spec: str, kv: torch.Tensor, scores: torch.Tensor, device: str, warmup: int, reps: int) -> dict:
    p = Pipeline(spec, head_scores=scores)
    nbytes = kv.numel() * 2
    enc_t, blob = timed(lambda: p.encode(kv), device, warmup, reps)
    dec_t, out = timed(lambda: p.decode(blob, max_values=kv.numel(), device=device), device, warmup, reps)
    if p.lossless:
        assert torch.equal(out.view(torch.int16), kv.view(torch.int16)), f"{spec}: lossless decode differs"
    enc, dec = nbytes / statistics.median(enc_t), nbytes / statistics.median(dec_t)
    ratio = nbytes / len(blob)
    s = 1.0 / (1.0 / enc + 1.0 / dec)
    return {"spec": spec, "ratio": ratio, "encode_Bps": enc, "decode_Bps": dec,
            "encode_s": {"median": statistics.median(enc_t), "min": min(enc_t), "max": max(enc_t)},
            "decode_s": {"median": statistics.median(dec_t), "min": min(dec_t), "max": max(dec_t)},
            "coding_Bps": s, "B_star_Bps": s * (1 - 1 / ratio), "B_star_Gbps": s * (1 - 1 / ratio) / GBPS}


def draw(doc: dict, plt):
    rows = sorted((r for r in doc["rows"] if "error" not in r), key=lambda r: r["B_star_Gbps"])
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(rows) + 1.5))
    ax.barh(range(len(rows)), [max(r["B_star_Gbps"], 0) for r in rows])
    ax.set_yticks(range(len(rows)), [r["spec"] for r in rows], fontsize=6)
    ax.set_xlabel("B* (Gbit/s): compression pays below it")
    ax.set_title(f"kvserve profiles on {doc['device']} ({doc['kv'][:40]})", fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=None, help="default 32 on CUDA, 2 on the CPU")
    ap.add_argument("--tokens", type=int, default=None, help="default 8192 on CUDA, 256 on the CPU")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--real-kv", default=str(REAL_KV))
    ap.add_argument("--tables", nargs="*", default=None, help="profile tables (default: the packaged ones)")
    ap.add_argument("--no-nvcomp", action="store_true", help="keep the CPU entropy stages even with nvCOMP")
    ap.add_argument("--write-table", default=None, help="folder for profiles_<model>_gpu.json (default: none)")
    ap.add_argument("--out", default=str(RESULTS / "kvserve_gpu.json"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="measure no new profile after this many seconds (the rest are listed as skipped)")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    cuda = a.device.startswith("cuda")
    layers, tokens = a.layers or (32 if cuda else 2), a.tokens or (8192 if cuda else 256)
    nv = cuda and not a.no_nvcomp and nvcodecs.gpu_ready(a.device)
    note = "nvCOMP entropy stages on the GPU" if nv else (
        "nvCOMP not used (absent, --no-nvcomp or not CUDA): entropy stages zstd/lz4/ans run on the CPU")
    print(note, flush=True)
    tables = [Path(t) for t in a.tables] if a.tables else source_tables()
    kv, kv_note = make_kv(layers, tokens, a.heads, a.head_dim, a.device, Path(a.real_kv), a.seed)
    print(f"KV {list(kv.shape)} ready after {time.perf_counter() - t_start:.1f} s ({kv_note[:60]})", flush=True)
    scores = torch.rand(layers, a.heads, generator=torch.Generator().manual_seed(a.seed))
    rows: dict[str, dict] = {}
    per_table: dict[str, list[tuple[Profile, str]]] = {}
    for t in tables:
        for p in load_profiles(t):
            spec = device_spec(p.name, nv)
            per_table.setdefault(str(t), []).append((p, spec))
            if spec not in rows:
                if a.deadline_s is not None and time.perf_counter() - t_start > a.deadline_s:
                    rows[spec] = {"spec": spec, "error": "skipped: past --deadline-s"}
                    continue
                t_p = time.perf_counter()
                try:
                    rows[spec] = measure(spec, kv, scores, a.device, a.warmup, max(1, a.reps))
                    rows[spec]["bench_seconds"] = time.perf_counter() - t_p
                except Exception as e:  # one profile failing is reported; the others are still measured
                    rows[spec] = {"spec": spec, "error": f"{type(e).__name__}: {e}"[:500]}
                    print(f"{spec:58s} FAILED {rows[spec]['error']}", flush=True)
                    continue
                r = rows[spec]
                print(f"{spec:58s} ratio {r['ratio']:6.2f}  enc {r['encode_Bps'] / 1e9:8.2f} GB/s  "
                      f"dec {r['decode_Bps'] / 1e9:8.2f} GB/s  B* {r['B_star_Gbps']:8.1f} Gbps "
                      f"({r['bench_seconds']:.1f} s)", flush=True)
    real = kv_note.startswith("real")
    doc = {"bench": "kvserve_gpu", "device": torch.cuda.get_device_name() if cuda else "cpu", "kv": kv_note,
           "shape": [layers, 2, tokens, a.heads, a.head_dim], "nvcomp": nv, "note": note,
           "timing": f"CUDA events, median of {a.reps} after {a.warmup} warm-up" if cuda else "perf_counter",
           "rows": list(rows.values()),
           "tables": {t: [{"profile": p.name, "spec": s} for p, s in v] for t, v in per_table.items()}}
    if a.write_table:
        out_dir = Path(a.write_table)
        out_dir.mkdir(parents=True, exist_ok=True)
        for t, v in per_table.items():
            model = Path(t).stem.removeprefix("profiles_")
            profs = [Profile(s, rows[s]["ratio"] if real else p.ratio, rows[s]["encode_Bps"], rows[s]["decode_Bps"],
                             p.quality) for p, s in v if "error" not in rows[s]]
            save_profiles(out_dir / f"profiles_{model}_gpu.json", profs, **json.load(open(t))["info"] | {
                "throughput": f"measured on {doc['device']} by bench/kvserve_gpu.py ({note})",
                "ratio": "measured on the benchmark's KV" if real else "as profiled (the benchmark's KV was random)",
                "kv": kv_note, "shape": doc["shape"]})
    report.write(a.out, doc, draw, argv=argv)
    print(f"wrote {a.out}")
    return 1 if any("error" in r for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
