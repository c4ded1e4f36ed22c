"""The `kvtide demo` section for restoration: one turn whose prefix left the device, brought back by plan.

A document-grounded chat turn runs once; its KV chunks go to the store when it finishes. The device prefix
cache is then emptied (what eviction under memory pressure does), and the next turn's prefix is restored
from the store three ways on the same engine and store: CacheFlow's plan, recompute-only, load-only. The
link is emulated at the bandwidth where loading the prefix takes as long as recomputing it on this machine
(measured F and stored bytes), which is where planning pays off.
"""
from __future__ import annotations

import argparse
import time
from typing import Any


def _forget_device_prefixes(engine: Any) -> None:
    """Drop every cached-but-unused page from the device prefix cache (as eviction would)."""
    engine.block_manager.evict_cached()


def _staircase_summary(js: list[int]) -> str:
    """'layers 0-9: recompute 192 | layers 10-29: load all' from per-layer boundaries."""
    parts, start = [], 0
    n = max(js) if js else 0
    for i in range(1, len(js) + 1):
        if i == len(js) or js[i] != js[start]:
            j = js[start]
            what = "load all" if j == 0 else f"recompute {j} (all)" if j == n else f"recompute {j}, load rest"
            parts.append(f"layers {start}-{i - 1}: {what}")
            start = i
    return " | ".join(parts)


def restoration_section(a: argparse.Namespace, con: Any) -> None:
    """Print the restoration section of the demo (builds its own engine with a memory store)."""
    from pydoc_data.topics import topics
    from rich.table import Table

    from ..config import RestoreConfig
    from ..engine.llm import LLM
    from ..engine.sampling_params import SamplingParams
    from ..store.bandwidth import BandwidthLimitedStore, TokenBucket

    con.rule("restoration (CacheFlow)")
    llm = LLM(a.model, device=a.device, dtype=a.dtype, attention_backend=a.attention_backend, progress=False,
              restore=RestoreConfig(store="memory", chunk_tokens=64))
    eng, r = llm.engine, llm.engine.restorer
    doc = topics["assert"][:1400] + "\n" + topics["pass"][:600]
    messages = [{"role": "system", "content": "Answer using this reference:\n" + doc},
                {"role": "user", "content": "What does the assert statement do?"}]
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    first = llm.chat(messages, params)
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": "And when are assertions skipped?"}]
    prompt = llm.chat_prompt(messages)
    r.writer.flush()
    n_tokens = len(llm.tokenizer.encode(prompt))
    # Link speed where loading the prefix equals recomputing it (F learned from the prefill just run).
    cached = (n_tokens - 1) // r.chunk * r.chunk
    t_rec = r.num_layers * float(r.profile(cached))
    link = cached * r.num_layers * r.bytes_per_token / max(t_rec, 1e-6)
    inner = r.store
    rows = []
    for method in ("cacheflow", "recompute", "load"):
        _forget_device_prefixes(eng)
        r.cfg.method = method
        r.store = BandwidthLimitedStore(inner, TokenBucket(link))  # a fresh, idle link per run
        r.profile.reset_bandwidth()
        r.cfg.bandwidth_gbps = link * 8 / 1e9
        t0 = time.perf_counter()
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=a.max_tokens))[0]
        rec = r.history[-1] if r.history and out.num_cached_tokens else None
        rows.append((method, out, rec, time.perf_counter() - t0))
    r.cfg.method = "cacheflow"
    con.print(f"turn 1 ({len(first.prompt_token_ids)} prompt tokens) finished; its {r.stats.chunks_written} full "
              f"{r.chunk}-token chunks went to the memory store ({r.num_layers} layer entries each, checksummed). "
              f"The device prefix cache was then emptied, as eviction would.")
    con.print(f"turn 2: {n_tokens} prompt tokens, {cached} restorable from the store; emulated link "
              f"{link * 8 / 1e6:.1f} Mbps (where loading the prefix takes as long as recomputing it here: "
              f"{t_rec:.2f}s)")
    cf = rows[0][2]
    if cf is not None:
        con.print(f"CacheFlow plan: {_staircase_summary(cf.boundaries[0])}")
        con.print(f"  predicted {cf.predicted_seconds:.2f}s (compute {cf.predicted_compute_seconds:.2f}s, load "
                  f"{cf.predicted_load_seconds:.2f}s), actual {cf.total_seconds:.2f}s "
                  f"(recompute {cf.recompute_seconds:.2f}s, load {cf.load_seconds:.2f}s in parallel); "
                  f"planning {cf.planning_seconds * 1e3:.2f} ms")
    t = Table(title="turn 2, same engine and store, prefix restored three ways")
    for col in ("method", "TTFT ms", "restored tok", "recomputed / loaded (tok x layers)", "same reply"):
        t.add_column(col, justify="right")
    ref = rows[1][1].token_ids
    for method, out, rec, _ in rows:
        rl = f"{sum(rec.boundaries[0])} / {cached * r.num_layers - sum(rec.boundaries[0])}" if rec else "-"
        t.add_row(method, f"{out.ttft * 1e3:.0f}", str(out.num_cached_tokens), rl,
                  "yes" if out.token_ids == ref else "no (bf16 rounding)")
    con.print(t)
    st = r.stats
    con.print(f"restorer: {st.requests} restored requests, {st.load_failures} failed loads, {st.fallbacks} "
              f"fallbacks to recompute; store {r.store.stats.snapshot()['hits']} verified entry reads")
    r.close()
