"""kvtide engine vs transformers' `generate` on the CPU: prefill and decode tokens/s at batch 1, 8 and 32.

Same model file, same machine, same process, same prompts (equal lengths, so transformers needs no padding),
greedy, a fixed number of new tokens (EOS ignored). Both timed the same way, wall clock:
  T1 = time to produce 1 token (prefill + first token), TN = time to produce N tokens;
  prefill tok/s = B*L / T1, decode tok/s = B*(N-1) / (TN - T1). Median of --repeats runs.

    python bench/engine_cpu.py --out bench/results/engine_cpu.json
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import report  # noqa: E402
from kvtide import CacheConfig, SamplingParams, SchedulerConfig  # noqa: E402
from kvtide.engine.llm import LLM  # noqa: E402


def prompts_of(tok, n: int, length: int) -> list[list[int]]:
    """n different real-text prompts of exactly `length` tokens (from Python's own pydoc topics)."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    ids = tok.encode(text)
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def time_it(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_engine(llm: LLM, prompts: list[list[int]], new: int, repeats: int) -> tuple[float, float]:
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate(prompts, one)  # warm-up
    t1 = statistics.median(time_it(lambda: llm.generate(prompts, one)) for _ in range(repeats))
    tn = statistics.median(time_it(lambda: llm.generate(prompts, many)) for _ in range(repeats))
    return t1, tn


def bench_hf(model, prompts: list[list[int]], new: int, repeats: int) -> tuple[float, float]:
    x = torch.tensor(prompts)
    mask = torch.ones_like(x)

    def gen(n: int):
        with torch.inference_mode():
            model.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=model.config.eos_token_id)

    gen(1)
    t1 = statistics.median(time_it(lambda: gen(1)) for _ in range(repeats))
    tn = statistics.median(time_it(lambda: gen(new)) for _ in range(repeats))
    return t1, tn


def draw(doc: dict, plt):
    """Headline figure: prefill and decode tokens/s per batch for each system."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    systems = list(dict.fromkeys(r["system"] for r in doc["rows"]))
    batches = sorted({r["batch"] for r in doc["rows"]})
    width = 0.8 / max(1, len(systems))
    for ax, key, label in ((axes[0], "prefill_tok_s", "prefill tok/s"), (axes[1], "decode_tok_s", "decode tok/s")):
        for i, name in enumerate(systems):
            by_b = {r["batch"]: r[key] for r in doc["rows"] if r["system"] == name}
            ax.bar([j + (i - (len(systems) - 1) / 2) * width for j in range(len(batches))],
                   [by_b.get(b, 0) for b in batches], width, label=name)
        ax.set_xticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("batch")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{doc.get('model')}: prompt {doc.get('prompt_len')} tokens, {doc.get('new_tokens')} new", fontsize=9)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/results/engine_cpu.json"))
    a = ap.parse_args(argv)

    import transformers
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoModelForCausalLM

    batches = [int(b) for b in a.batches.split(",")]
    sched = SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=max(batches) * a.prompt_len)
    engines = {
        "kvtide (bf16 KV)": LLM(a.model, progress=False, device="cpu",
                                cache=CacheConfig(enable_prefix_caching=False), scheduler=sched),
        "kvtide (fp32 KV)": LLM(a.model, progress=False, device="cpu",
                                cache=CacheConfig(enable_prefix_caching=False, kv_dtype="float32"), scheduler=sched),
    }
    tok = next(iter(engines.values())).tokenizer
    hf = AutoModelForCausalLM.from_pretrained(next(iter(engines.values())).engine.model_dir, dtype=torch.float32).eval()
    rows = []
    for b in batches:
        prompts = prompts_of(tok, b, a.prompt_len)
        runs = {"transformers generate": bench_hf(hf, prompts, a.new_tokens, a.repeats)}
        for name, llm in engines.items():
            runs[name] = bench_engine(llm, prompts, a.new_tokens, a.repeats)
        for name, (t1, tn) in runs.items():
            rows.append({"system": name, "batch": b, "prefill_tok_s": b * a.prompt_len / t1,
                         "decode_tok_s": b * (a.new_tokens - 1) / (tn - t1), "t1_s": t1, "tn_s": tn})
        print(f"batch {b} done", file=sys.stderr)
    for r in rows:
        base = next(x for x in rows if x["batch"] == r["batch"] and x["system"] == "transformers generate")
        r["prefill_vs_transformers"] = r["prefill_tok_s"] / base["prefill_tok_s"]
        r["decode_vs_transformers"] = r["decode_tok_s"] / base["decode_tok_s"]
    res = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} torch threads ({platform.processor() or 'unknown'})",
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "model": a.model + " (real weights, fp32 compute)", "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
        "repeats": a.repeats, "method": __doc__.strip().splitlines()[2:5], "rows": rows,
    }
    report.write(a.out, res, draw, argv, indent=2)
    t = Table(title=f"{a.model} on CPU: prompt {a.prompt_len} tok, {a.new_tokens} new tok, median of {a.repeats}")
    for c in ("system", "batch", "prefill tok/s", "decode tok/s", "decode vs HF"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["system"], str(r["batch"]), f"{r['prefill_tok_s']:.0f}", f"{r['decode_tok_s']:.1f}",
                  f"{r['decode_vs_transformers']:.2f}x")
    Console().print(t)


if __name__ == "__main__":
    main()
