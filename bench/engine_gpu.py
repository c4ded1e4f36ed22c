"""The engine on CUDA in bf16: (a) real-model greedy tokens against the CPU and transformers on the same GPU,
(b) a Llama-3.1-8B-shaped model (random weights) decoding 32 sequences of 8192 tokens with the FlashInfer backend.

    python bench/engine_gpu.py --part real --out bench/results/engine_gpu_real.json
    python bench/engine_gpu.py --part decode8b --out bench/results/engine_gpu_decode8b.json

Writes JSON (machine header, versions, shapes) and a PNG beside it, and prints a short table.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import report  # noqa: E402
from kvtide import CacheConfig, SamplingParams, SchedulerConfig  # noqa: E402
from kvtide.engine.llm import LLM  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three colours:",
    "Explain what a KV cache is in one sentence:",
]


def env() -> dict:
    import importlib.metadata as md

    def ver(p: str) -> str | None:
        try:
            return md.version(p)
        except md.PackageNotFoundError:
            return None

    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "flashinfer": ver("flashinfer-python"),
        "transformers": ver("transformers"),
        "triton": ver("triton"),
    }


def part_real(model: str, max_new: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_new)
    runs = {}
    for label, kw in {
        "cpu_fp32": dict(device="cpu", dtype="float32", attention_backend="torch"),
        "cuda_bf16_torch": dict(device="cuda", dtype="bfloat16", attention_backend="torch"),
        "cuda_bf16_flashinfer": dict(device="cuda", dtype="bfloat16", attention_backend="flashinfer"),
    }.items():
        llm = LLM(model, progress=False, cache=CacheConfig(kv_cache_bytes=1 << 30), **kw)
        t0 = time.perf_counter()
        outs = llm.generate(PROMPTS, params)
        runs[label] = {"tokens": [o.token_ids for o in outs], "texts": [o.text for o in outs],
                       "seconds": time.perf_counter() - t0}
        del llm
    # transformers on the same GPU, bf16, same weights (our converted directory), greedy.
    from transformers import AutoModelForCausalLM

    from kvtide.models.loader import resolve_model_dir
    from kvtide.models.tokenizer import Tokenizer

    d = resolve_model_dir(model, progress=False)
    tok = Tokenizer(d)
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16).cuda().eval()
    hf_tokens, logit_err = [], []
    ours = LLM(model, progress=False, device="cuda", dtype="bfloat16", attention_backend="torch",
               cache=CacheConfig(kv_cache_bytes=1 << 28))
    for p in PROMPTS:
        ids = tok.encode(p)
        x = torch.tensor([ids], device="cuda")
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                              pad_token_id=hf.config.eos_token_id)
            hf_tokens.append(out[0, len(ids):].tolist())
            ref = hf(x).logits[0, -1].float()
            mine = _last_logits(ours, ids)
            logit_err.append(((mine - ref).abs().max() / ref.abs().max()).item())
    runs["cuda_bf16_transformers"] = {"tokens": hf_tokens}

    def agree(a: str, b: str) -> list[int]:
        """Leading tokens on which two runs agree, per prompt."""
        n = []
        for x, y in zip(runs[a]["tokens"], runs[b]["tokens"]):
            k = 0
            while k < min(len(x), len(y)) and x[k] == y[k]:
                k += 1
            n.append(k)
        return n

    return {
        "model": model, "prompts": PROMPTS, "max_new_tokens": max_new, "runs": runs,
        "agreement_leading_tokens": {
            "flashinfer_vs_cpu": agree("cuda_bf16_flashinfer", "cpu_fp32"),
            "torch_cuda_vs_cpu": agree("cuda_bf16_torch", "cpu_fp32"),
            "flashinfer_vs_transformers_cuda": agree("cuda_bf16_flashinfer", "cuda_bf16_transformers"),
            "torch_cuda_vs_transformers_cuda": agree("cuda_bf16_torch", "cuda_bf16_transformers"),
        },
        "last_logit_rel_err_vs_transformers_cuda_bf16": logit_err,
    }


def _last_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Our model's last-position logits through the engine's paged attention, one sequence."""
    eng = llm.engine
    from kvtide.engine.sequence import Sequence

    seq = Sequence("probe", None, ids, SamplingParams(temperature=0, max_tokens=1))
    eng.block_manager.allocate(seq, len(ids))
    layout, flat, pos = eng.runner.layout([(seq, len(ids))])
    eng.runner.attention.plan(layout)
    with torch.inference_mode():
        logits = eng.model(torch.tensor(flat, device="cuda"), torch.tensor(pos, device="cuda"), eng.runner.attention,
                           logit_rows=torch.tensor([len(ids) - 1], device="cuda"))
    eng.block_manager.release(seq)
    return logits[0]


def part_decode8b(batch: int, context: int, steps: int, preset: str = "llama3-8b", device: str = "cuda",
                  backend: str = "flashinfer", compress: bool = False) -> dict:
    llm = LLM(f"random:{preset}", progress=False, device=device, dtype="bfloat16", attention_backend=backend,
              cache=CacheConfig(gpu_memory_utilization=0.92, enable_prefix_caching=False, compress=compress),
              scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=16384, max_model_len=context + steps + 16))
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    vocab = eng.model.args.vocab_size
    prompts = [torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(batch)]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, params)
    t0 = time.perf_counter()
    step_times = []
    tokens: dict[str, list[int]] = {}
    n_out = 0
    while eng.has_unfinished():
        sync()
        s0 = time.perf_counter()
        outs = eng.step()
        sync()
        dt = time.perf_counter() - s0
        n_prefill, n_decode, _ = eng.stats.last_step
        if n_prefill == 0 and n_decode == batch:
            step_times.append(dt)
        n_out += len(outs)
        for o in outs:
            if o.finished:
                tokens[o.request_id] = o.token_ids
    total = time.perf_counter() - t0
    stats = {k: v for k, v in eng.kv_stats().items() if isinstance(v, (int, float, bool))}
    num_pages, kv_bpt, preempt = eng.num_pages, eng.model.args.kv_bytes_per_token, eng.scheduler.num_preemptions
    model_desc = f"random:{preset} (RANDOM weights, bf16): {eng.model.args}"
    del llm, eng  # give the memory back before a second engine in the same process sizes its KV cache
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    step_times.sort()
    med = step_times[len(step_times) // 2]
    return {
        "model": model_desc,
        "batch": batch, "context": context, "decode_steps_timed": len(step_times), "page_size": 16,
        "attention_backend": backend + (" (BatchDecodeWithPagedKVCacheWrapper, tensor cores)" if backend == "flashinfer" else ""),
        "num_pages": num_pages, "kv_bytes_per_token": kv_bpt,
        "median_decode_step_ms": med * 1e3, "decode_tokens_per_s": batch / med,
        "mean_decode_step_ms": sum(step_times) / len(step_times) * 1e3,
        "wall_seconds_incl_prefill": total, "preemptions": preempt,
        "cuda_graphs": False, "compress": compress,
        "kv_stats": stats,
        "tokens": [tokens[k] for k in sorted(tokens, key=lambda r: int(r.split("-")[1]))],
    }


def draw(doc: dict, plt):
    """Headline figure of the part that ran: leading-token agreement per pair (real), or step time (decode8b,
    zipcheck: raw against compressed pages)."""
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    if "agreement_leading_tokens" in doc:
        agree = doc["agreement_leading_tokens"]
        per = [sum(v) / len(v) if isinstance(v, list) and v else v for v in agree.values()]
        ax.barh(list(agree), per)
        ax.set_xlabel(f"leading tokens that agree (of {doc.get('max_new_tokens')}, mean over prompts)")
        ax.set_title(f"{doc.get('model')}: greedy tokens against the CPU and transformers", fontsize=9)
    else:
        runs = {"raw": doc["raw"], "compressed": doc["compressed"]} if "raw" in doc else {"decode": doc}
        ax.bar(list(runs), [r["median_decode_step_ms"] for r in runs.values()])
        ax.set_ylabel("median decode step (ms)")
        r0 = next(iter(runs.values()))
        ax.set_title(f"{r0.get('model')}: batch {r0.get('batch')} x {r0.get('context')} tokens", fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["real", "decode8b", "zipcheck"], required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--preset", default="llama3-8b", help="random-weight shape for --part decode8b")
    ap.add_argument("--device", default="cuda", help="cpu only for a dry run of the script's logic")
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/engine_gpu.py needs a CUDA device")
    res = {"env": env()}
    if a.part == "real":
        res.update(part_real(a.model, a.max_new))
        print(json.dumps(res["agreement_leading_tokens"]), res["last_logit_rel_err_vs_transformers_cuda_bf16"])
    elif a.part == "zipcheck":
        # compress=True (decompress-then-attend through the same backend) against compress=False, same prompts.
        raw = part_decode8b(a.batch, a.context, a.steps, a.preset, a.device, a.backend, compress=False)
        zipped = part_decode8b(a.batch, a.context, a.steps, a.preset, a.device, a.backend, compress=True)
        res.update({"raw": raw, "compressed": zipped, "same_tokens": raw["tokens"] == zipped["tokens"]})
        print(f"compress on/off same greedy tokens: {res['same_tokens']}; step ms raw {raw['median_decode_step_ms']:.2f}"
              f" vs compressed {zipped['median_decode_step_ms']:.2f}; K/V ratio {zipped['kv_stats'].get('k_ratio')}"
              f" / {zipped['kv_stats'].get('v_ratio')}")
    else:
        res.update(part_decode8b(a.batch, a.context, a.steps, a.preset, a.device, a.backend))
        print(f"8B-shape decode, batch {a.batch} x {a.context}: {res['median_decode_step_ms']:.2f} ms/step, "
              f"{res['decode_tokens_per_s']:.0f} tokens/s (FlashInfer, random weights)")
    report.write(a.out, res, draw, argv, indent=2)


if __name__ == "__main__":
    main()
