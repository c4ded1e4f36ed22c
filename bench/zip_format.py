"""ZipFusion format on real KV: compressible blocks and bytes per layer (K, V; v1, v2), the largest concurrent
batch under one KV budget with and without compression, and encode/decode throughput against a plain copy.

    python bench/zip_format.py                      # CPU, both bundled models (about 3-5 minutes)
    python bench/zip_format.py --device cuda        # GPU throughput with the Triton encoder

KV comes from the bundled models' real weights run in bf16 compute (KV stored BF16) over real text shipped
with Python: prose from ``pydoc_data.topics`` and code from stdlib sources (kvtide.transfer.corpus).
Writes bench/results/zip_format[_cuda].json and .png, and prints a short table.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import report  # noqa: E402
from kvtide import CacheConfig, SamplingParams, SchedulerConfig  # noqa: E402
from kvtide.cache import zip_blocks as zb  # noqa: E402
from kvtide.cache import zip_format as zf  # noqa: E402
from kvtide.engine.llm import LLM  # noqa: E402
from kvtide.transfer.corpus import windows  # noqa: E402

MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")
RESULTS = Path(__file__).resolve().parent / "results"


def env(device: str) -> dict:
    import importlib.metadata as md

    def ver(p: str) -> str | None:
        try:
            return md.version(p)
        except md.PackageNotFoundError:
            return None

    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(), "platform": platform.platform(),
        "device": torch.cuda.get_device_name() if device == "cuda" else f"{platform.processor() or 'cpu'} "
                                                                         f"({os.cpu_count()} cores, torch threads {torch.get_num_threads()})",
        "python": platform.python_version(), "torch": torch.__version__, "triton": ver("triton"),
        "kvtide": ver("kvtide"), "weights": "real (bundled GGUF, dequantised)",
    }


def capture_kv(name: str, device: str, tokens: int) -> tuple[dict, list[torch.Tensor]]:
    """Per layer BF16 KV [pages, 2, page, kv_heads, head_dim] of one prose and one code window, bf16 compute."""
    llm = LLM(name, progress=False, device=device, dtype="bfloat16", attention_backend="torch",
              cache=CacheConfig(num_pages=2 * tokens // 16 + 8))
    eng = llm.engine
    prompts = windows(llm.tokenizer, "prose", 1, tokens) + windows(llm.tokenizer, "code", 1, tokens)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
    pids = torch.tensor(sorted(eng.block_manager.hash_to_page.values()), device=eng.runner.device)
    kv = [c[pids].cpu() for c in eng.runner.kv_caches]
    a = eng.model.args
    shape = {"layers": a.num_layers, "q_heads": a.num_heads, "kv_heads": a.num_kv_heads, "head_dim": a.head_dim,
             "page_size": 16, "pages": int(pids.numel()), "tokens": 2 * tokens, "texts": "1 prose + 1 code window",
             "compute_dtype": "bfloat16", "kv_dtype": "bfloat16"}
    return shape, kv


def groups(kv_layer: torch.Tensor, kind: int) -> torch.Tensor:
    """[pages * kv_heads, page * head_dim] groups of K (kind 0) or V (1) in [token, dim] order."""
    x = kv_layer[:, kind].permute(0, 2, 1, 3)  # [pages, heads, page, dim]
    return x.reshape(x.shape[0] * x.shape[1], -1).contiguous()


def format_stats(kv: list[torch.Tensor], block_size: int) -> dict:
    out: dict = {}
    for version in (1, 2):
        for k, kind in enumerate("kv"):
            frac, ratio = [], []
            for layer in kv:
                e = zf.encode_groups(groups(layer, k), block_size, version)
                frac.append(e.compressed_fraction)
                ratio.append(e.data.numel() / e.raw_nbytes)
            stored = sum(r for r in ratio) / len(ratio)
            out[f"v{version}_{kind}"] = {"compressible_fraction_per_layer": frac, "bytes_ratio_per_layer": ratio,
                                         "compressible_fraction": sum(frac) / len(frac), "bytes_ratio": stored}
    return out


def throughput(kv: list[torch.Tensor], device: str, block_size: int, target_bytes: int) -> dict:
    """GB/s of raw BF16 bytes: encode (Triton on CUDA, torch on CPU), decode (torch), and a plain copy."""
    g = torch.cat([groups(layer, k) for layer in kv for k in (0, 1)])
    reps = max(1, target_bytes // (g.numel() * 2))
    x = g.repeat(reps, 1).to(device)
    nbytes = x.numel() * 2
    if device == "cuda":
        from kvtide.kernels import zip_encode
        enc = lambda: zip_encode.encode_groups(x, block_size)  # noqa: E731
    else:
        enc = lambda: zf.encode_groups(x, block_size)  # noqa: E731
    e = enc()
    assert torch.equal(zf.decode(e).view(torch.int16), x.view(torch.int16)), "round trip must be bit-exact"

    def timed(fn, n: int = 3) -> float:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / n

    t_enc, t_dec, t_copy = timed(enc), timed(lambda: zf.decode(e)), timed(lambda: x.clone())
    return {"raw_bytes": nbytes, "encode_impl": "triton" if device == "cuda" else "torch reference",
            "decode_impl": "torch reference", "encode_GBps": nbytes / t_enc / 1e9, "decode_GBps": nbytes / t_dec / 1e9,
            "copy_GBps": 2 * nbytes / t_copy / 1e9, "copy_note": "clone: read + write bytes per second"}


def batch_under_budget(name: str, pages_budget: int, prompt_tokens: int, requests: int) -> dict:
    """Largest number of running requests the engine reaches under one KV budget, compress off and on."""
    out = {}
    prompt = windows_for(name, prompt_tokens)
    for compress in (False, True):
        llm = LLM(name, progress=False, device="cpu", attention_backend="torch",
                  cache=CacheConfig(num_pages=pages_budget, compress=compress, enable_prefix_caching=False),
                  scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096))
        eng = llm.engine
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        for _ in range(requests):
            eng.add_request(prompt, params)
        peak, t, s = 0, time.perf_counter(), eng.kv_stats()
        while eng.has_unfinished():
            eng.step()
            if len(eng.scheduler.running) > peak:  # pool figures at the peak (all pages are freed at the end)
                peak, s = len(eng.scheduler.running), eng.kv_stats()
        out["compressed" if compress else "raw"] = {
            "peak_running": peak, "preemptions": eng.scheduler.num_preemptions, "seconds": time.perf_counter() - t,
            "k_ratio": s["k_ratio"], "v_ratio": s["v_ratio"], "fragmentation": s.get("fragmentation", 0.0)}
        del llm, eng
    return {"kv_budget_raw_pages": pages_budget, "prompt_tokens": prompt_tokens, "requests": requests,
            "max_new_tokens": 4, "compute_dtype": "float32 (CPU engine default; KV stored BF16)", **out}


def windows_for(name: str, n: int) -> list[int]:
    from kvtide.models.loader import resolve_model_dir
    from kvtide.models.tokenizer import Tokenizer

    return windows(Tokenizer(resolve_model_dir(name, progress=False)), "prose", 1, n)[0]


def draw(result: dict, plt):
    """Headline figure: the compressible fraction of 512-value blocks per layer, K and V, v1 and v2, per model."""
    names = list(result["models"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        f = result["models"][name]["format"]
        for key, style in (("v1_k", "C0-"), ("v2_k", "C0--"), ("v1_v", "C1-"), ("v2_v", "C1--")):
            ax.plot(f[key]["compressible_fraction_per_layer"], style, label=key.replace("_", " ").upper())
        ax.set(title=f"{name}: compressible 512-value blocks", xlabel="layer", ylabel="fraction", ylim=(0, 1.02))
        ax.legend(loc="lower right")
    e = result["env"]
    fig.suptitle(f"ZipFusion format on real KV (bf16 compute, prose + code) — {e['device']}, torch {e['torch']}, "
                 f"{e['date'][:10]}", fontsize=9)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", type=int, default=256, help="tokens per text window (one prose, one code)")
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--throughput-mb", type=int, default=0, help="raw MB per throughput run (default 16 CPU, 512 GPU)")
    ap.add_argument("--budget-pages", type=int, default=96, help="KV budget (raw pages) of the batch run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    suffix = "" if args.device == "cpu" else f"_{args.device}"
    out = Path(args.out) if args.out else RESULTS / f"zip_format{suffix}.json"
    target = (args.throughput_mb or (16 if args.device == "cpu" else 512)) << 20
    result = {"env": env(args.device), "block_size": args.block_size, "models": {}}
    for name in args.models.split(","):
        t = time.perf_counter()
        shape, kv = capture_kv(name, args.device, args.tokens)
        fmt = format_stats(kv, args.block_size)
        thr = throughput(kv, args.device, args.block_size, target)
        result["models"][name] = {"shape": shape, "format": fmt, "throughput": thr,
                                  "seconds": time.perf_counter() - t}
    # Capacity: predicted from the measured v1 ratios, verified by one engine run (smallest model, CPU).
    first = args.models.split(",")[0]
    fmt = result["models"][first]["format"]
    ratio = (fmt["v1_k"]["bytes_ratio"] + fmt["v1_v"]["bytes_ratio"]) / 2
    prompt_tokens = 8 * 16 - 4  # 8 pages with the first generated token
    run = batch_under_budget(first, args.budget_pages, prompt_tokens, requests=24)
    result["capacity"] = {"model": first, "predicted_gain": 1 / ratio, "predicted_note":
                          "1 / mean(K, V bytes ratio): pages the same bytes hold once completed pages are compressed",
                          "engine_run": run,
                          "measured_gain": run["compressed"]["peak_running"] / max(1, run["raw"]["peak_running"])}
    report.write(out, result, draw, argv)
    e = result["env"]
    print(f"# ZipFusion format — {e['device']}, torch {e['torch']}, {e['date']}, block {args.block_size}")
    print(f"{'model':22s} {'':3s} {'K frac':>7s} {'K ratio':>8s} {'V frac':>7s} {'V ratio':>8s}")
    for name, m in result["models"].items():
        for v in (1, 2):
            k, vv = m["format"][f"v{v}_k"], m["format"][f"v{v}_v"]
            print(f"{name:22s} v{v}  {k['compressible_fraction']:7.3f} {k['bytes_ratio']:8.3f} "
                  f"{vv['compressible_fraction']:7.3f} {vv['bytes_ratio']:8.3f}")
    for name, m in result["models"].items():
        t = m["throughput"]
        print(f"{name:22s} encode {t['encode_GBps']:.2f} GB/s ({t['encode_impl']}), decode {t['decode_GBps']:.2f} GB/s, "
              f"copy {t['copy_GBps']:.2f} GB/s  [{t['raw_bytes'] >> 20} MiB raw]")
    c = result["capacity"]
    print(f"batch under {run['kv_budget_raw_pages']} raw pages ({first}, {prompt_tokens}-token prompts): "
          f"raw {run['raw']['peak_running']} -> compressed {run['compressed']['peak_running']} "
          f"(x{c['measured_gain']:.2f}; predicted x{c['predicted_gain']:.2f})")
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
