"""The `kvtide demo` section for resident compression: the same requests under one KV budget, raw and compressed."""
from __future__ import annotations

import argparse
import time
from typing import Any


def compression_section(a: argparse.Namespace, con: Any, prompts: list[str], budget_pages: int = 96) -> None:
    """Run `prompts` at once on two engines with the same KV bytes: raw pages, then ZipFusion-compressed pages."""
    from rich.table import Table

    from ..config import CacheConfig, SchedulerConfig
    from ..engine.llm import LLM
    from ..engine.sampling_params import SamplingParams

    con.rule("resident compression (ZipFusion, lossless 12-bit BF16)")
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    rows, texts = [], {}
    for compress in (False, True):
        llm = LLM(a.model, device=a.device, dtype=a.dtype, attention_backend=a.attention_backend, progress=False,
                  cache=CacheConfig(num_pages=budget_pages, compress=compress, enable_prefix_caching=False),
                  scheduler=SchedulerConfig(max_num_seqs=len(prompts)))
        eng = llm.engine
        for p in prompts:
            eng.add_request(p, params)
        peak, peak_stats, t = 0, eng.kv_stats(), time.perf_counter()
        outs = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.token_ids
            if len(eng.scheduler.running) > peak:
                peak, peak_stats = len(eng.scheduler.running), eng.kv_stats()
        texts[compress] = [outs[k] for k in sorted(outs)]
        rows.append((compress, peak, eng.scheduler.num_preemptions, time.perf_counter() - t, peak_stats))
    t = Table(title=f"{len(prompts)} requests under one KV budget ({budget_pages} raw pages)")
    for col in ("KV pages", "K bytes ratio", "V bytes ratio", "pages that fit", "peak running", "preemptions", "seconds"):
        t.add_column(col, justify="right")
    for compress, peak, pre, secs, s in rows:
        t.add_row("compressed" if compress else "raw", f"{s['k_ratio']:.3f}", f"{s['v_ratio']:.3f}",
                  str(s["capacity_pages"]), str(peak), str(pre), f"{secs:.1f}")
    con.print(t)
    same = texts[False] == texts[True]
    con.print(f"greedy tokens with compression on and off: {'identical' if same else 'DIFFERENT'} "
              f"({sum(len(x) for x in texts[True])} tokens); completed pages are stored at the ratios above, "
              "the page being written stays raw")
