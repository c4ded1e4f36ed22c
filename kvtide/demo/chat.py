"""The chat part of `kvtide demo`: a scripted multi-turn chat on the bundled model, prefix reuse and continuous
batching with numbers; then the capability sections (``compression``, ``restoration``, ``handoff``).
"""
from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

SCRIPT = [
    "What are three tips for staying healthy?",
    "Which of those is the easiest to start today?",
    "How much water should I drink each day?",
    "Thanks! Can you summarise your advice in one sentence?",
    "What is a good breakfast for a busy morning?",
    "Great, thank you for the help.",
]

USERS = [
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me a short recipe for pancakes.",
    "What is the capital of Japan, and why is it famous?",
    "Write a Python function that reverses a string.",
    "Name three planets and one fact about each.",
    "What does a KV cache store in a transformer?",
    "Suggest a name for a grey cat.",
]


def run_demo(a: argparse.Namespace) -> int:
    from ..engine.llm import LLM
    from ..engine.sampling_params import SamplingParams

    con = Console()
    con.rule("[bold]kvtide demo")
    t0 = time.perf_counter()
    llm = LLM(a.model, device=a.device, dtype=a.dtype, attention_backend=a.attention_backend)
    eng = llm.engine
    args = eng.model.args
    con.print(f"model [bold]{a.model}[/]: {args.num_layers} layers, {args.num_heads} heads / {args.num_kv_heads} KV heads, "
              f"head_dim {args.head_dim}; device {eng.runner.device}, compute {eng.config.torch_dtype}, "
              f"KV {eng.config.cache.kv_dtype}, attention backend '{eng.runner.attention.name}' "
              f"(loaded in {time.perf_counter() - t0:.1f}s)")
    page = eng.block_manager.page_size
    con.print(f"paged KV: {eng.num_pages} pages x {page} tokens, "
              f"{eng.runner.page_bytes(args, page, eng.config.cache.torch_kv_dtype) / page / 1024:.1f} KiB per token")

    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    bm = eng.block_manager
    turns = Table(title="multi-turn chat: each turn reuses the previous turns' KV pages (prefix cache)")
    for col in ("turn", "prompt tok", "reused tok", "TTFT ms", "TTFT w/o reuse ms", "decode tok/s", "cached pages"):
        turns.add_column(col, justify="right")
    messages: list[dict] = []
    for i, user in enumerate(SCRIPT[: a.turns]):
        messages.append({"role": "user", "content": user})
        prompt = llm.chat_prompt(messages)
        out = llm.generate(prompt, params)[0]
        cold = _ttft_without_reuse(llm, prompt)
        decode_s = out.latency - out.ttft
        n = len(out.token_ids)
        messages.append({"role": "assistant", "content": out.text})
        reply = out.text.strip().replace("\n", " ")
        con.print(f"[bold cyan]user {i + 1}>[/] {user}\n[bold green]assistant>[/] {reply[:160]}{'…' if len(reply) > 160 else ''}")
        turns.add_row(str(i + 1), str(len(out.prompt_token_ids)), str(out.num_cached_tokens),
                      f"{out.ttft * 1e3:.0f}", f"{cold * 1e3:.0f}",
                      f"{(n - 1) / decode_s:.1f}" if decode_s > 0 and n > 1 else "-", str(len(bm.hash_to_page)))
    con.print(turns)

    con.rule("continuous batching")
    batch_params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    prompts = [llm.chat_prompt([{"role": "user", "content": u}]) for u in USERS]
    t = time.perf_counter()
    llm.generate(prompts[0], batch_params)
    single = a.max_tokens / (time.perf_counter() - t)
    s0 = eng.stats.decode_tokens
    t = time.perf_counter()
    outs = llm.generate(prompts, batch_params)
    dt = time.perf_counter() - t
    batched = sum(len(o.token_ids) for o in outs) / dt
    tb = Table(title=f"{len(USERS)} users at once vs one at a time ({a.max_tokens} tokens each)")
    for col in ("run", "generated tok/s", "mean TTFT ms", "preemptions"):
        tb.add_column(col)
    tb.add_row("1 request", f"{single:.1f}", "-", "-")
    tb.add_row(f"{len(USERS)} requests, continuous batching", f"{batched:.1f}",
               f"{sum(o.ttft for o in outs) / len(outs) * 1e3:.0f}", str(eng.scheduler.num_preemptions))
    con.print(tb)
    st = bm.stats
    hit = st["prefix_hit_tokens"] / max(1, st["prefix_query_tokens"])
    con.print(f"prefix cache: {st['prefix_hit_tokens']} of {st['prefix_query_tokens']} prompt tokens served from cached "
              f"pages ({hit:.0%}); {eng.stats.decode_tokens - s0} decode tokens in the batch run; speed-up from batching "
              f"{batched / single:.1f}x")
    from .compression import compression_section
    from .handoff import handoff_section
    from .restoration import restoration_section

    compression_section(a, con, prompts, budget_pages=24)
    restoration_section(a, con)
    handoff_section(a, con)
    return 0


def _ttft_without_reuse(llm, prompt: str) -> float:
    """TTFT of the same prompt with the prefix cache switched off for one request: what reuse saved."""
    from ..engine.sampling_params import SamplingParams

    bm = llm.engine.block_manager
    bm.enable_prefix_caching = False
    try:
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1))[0]
    finally:
        bm.enable_prefix_caching = True
    return out.ttft or 0.0
