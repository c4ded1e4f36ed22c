"""Restorations with one store fetch per layer against fetches shared by up to N consecutive layers.

A CacheFlow staircase loads a little in every layer; every fetch has a fixed cost (round trip, wake-up,
verify hand-off, on CUDA a staging buffer and one host-to-device copy), which on fast links is as long as the
bytes themselves (H200, 8192-token prefix, batch 1: ~2.4 ms a fetch). This bench restores the same prefix with
each method and each ``RestoreConfig.merge_load_layers`` setting, interleaved in one process, and reports median
TTFT, restore seconds and fetch counts per (method, setting), with their ratios.

    python bench/tools/restore_fetches.py                                   # CPU, SmolLM2, ~3 min
    python bench/tools/restore_fetches.py --device cuda --model random:llama3-8b --tokens 8192 --gbps 40 80
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvtide import CacheConfig, SamplingParams  # noqa: E402
from kvtide.config import RestoreConfig  # noqa: E402
from kvtide.engine.llm import LLM  # noqa: E402
from kvtide.restore.methods import LABELS  # noqa: E402
from kvtide.store.bandwidth import BandwidthLimitedStore  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=512, help="prefix tokens restored")
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=None, help="default: 32 on CPU, 512 on CUDA")
    ap.add_argument("--gbps", type=float, nargs="+", default=None,
                    help="links; default CPU: 4x and 8x the balance point measured first (fast links)")
    ap.add_argument("--settings", type=int, nargs="+", default=[1, 4], help="merge_load_layers values")
    ap.add_argument("--methods", nargs="+", default=["cacheflow", "cake", "layerwise"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.reps < 1 or a.tokens < 1 or any(s < 1 for s in a.settings):
        ap.error("--reps, --tokens and every --settings value must be >= 1")
    gpu = a.device.startswith("cuda")
    torch.set_num_threads(a.threads)
    chunk = a.chunk or (512 if gpu else 32)
    llm = LLM(a.model, device=a.device, progress=False, attention_backend=a.attention,
              cache=CacheConfig(kv_dtype="bfloat16", enable_prefix_caching=False),
              restore=RestoreConfig(store="memory", memory_bytes=(64 if gpu else 4) << 30, chunk_tokens=chunk))
    eng, r = llm.engine, llm.engine.restorer
    inner = r.store
    vocab = eng.model.args.vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, vocab - 100, (a.tokens,), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for n in (a.tokens, a.tokens):  # profile F(t) from ordinary prefills; the last one stores the prefix's chunks
        llm.generate(torch.randint(100, vocab - 100, (n,), generator=g).tolist(), params)
    llm.generate(prefix, params)
    r.writer.flush()

    def restore(method: str, setting: int, gbps: float | None) -> dict:
        r.use_store(inner if gbps is None else BandwidthLimitedStore.at_gbps(inner, gbps), writes=inner)
        r.cfg.method, r.cfg.merge_load_layers = method, setting
        r.profile.reset_bandwidth()
        tail = torch.randint(100, vocab - 100, (a.suffix,), generator=g).tolist()
        llm.generate(prefix + tail, params)  # the link's rate is learned by a first restoration, as it would be
        tail = torch.randint(100, vocab - 100, (a.suffix,), generator=g).tolist()
        out = llm.generate(prefix + tail, params)[0]
        rec = r.history[-1]
        assert out.num_cached_tokens >= a.tokens // chunk * chunk - chunk, "the prefix was not restored"
        return {"ttft_s": out.ttft, "restore_s": rec.total_seconds, "load_batches": rec.load_batches,
                "load_s": rec.load_seconds, "predicted_s": rec.predicted_seconds, "boundaries": rec.boundaries[0]}

    links = a.gbps
    if links is None:  # fast links relative to this machine's recompute speed
        t_rec = restore("recompute", 1, None)["restore_s"]
        bal = r.bytes_per_token * eng.model.args.num_layers * a.tokens * 8 / 1e9 / t_rec  # load = recompute here
        links = [round(4 * bal, 3), round(8 * bal, 3)]
    rows = []
    for gb in links:
        for m in a.methods:
            for s in a.settings:
                restore(m, s, gb)  # untimed warm-up of this combination
        for rep in range(a.reps):
            for m in a.methods:
                for s in a.settings:
                    rows.append({"gbps": gb, "method": m, "merge_load_layers": s, "rep": rep, **restore(m, s, gb)})
    summary = []
    for gb in links:
        for m in a.methods:
            med = {s: {k: statistics.median(x[k] for x in rows if x["gbps"] == gb and x["method"] == m
                                            and x["merge_load_layers"] == s)
                       for k in ("ttft_s", "restore_s", "load_batches", "load_s")} for s in a.settings}
            base = med[a.settings[0]]
            summary.append({"gbps": gb, "method": m, "median": {str(s): v for s, v in med.items()},
                            "ttft_ratio_vs_first_setting": {str(s): base["ttft_s"] / v["ttft_s"]
                                                            for s, v in med.items()}})
    meta = {"date": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if gpu else None, "model": a.model,
            "random_weights": a.model.startswith("random:"), "prefix_tokens": a.tokens, "suffix_tokens": a.suffix,
            "chunk_tokens": chunk, "links_gbps": links, "reps": a.reps, "torch_threads": a.threads,
            "stored_bytes_per_token_per_layer": r.bytes_per_token,
            "note": "medians over reps; every (method, setting) restored the same prefix in one process, interleaved"}
    for s in summary:
        cells = ", ".join(f"{k} layers: {v['ttft_s'] * 1e3:.1f} ms TTFT / {v['load_batches']:.0f} fetches"
                          for k, v in s["median"].items())
        print(f"{s['gbps']:g} Gbps {LABELS[s['method']]}: {cells}")
    if a.out:
        a.out.write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
