"""The prefill->decode hand-off section of `kvtide demo` (KVServe): two local instances, the controller in the path.

A prefill and a decode instance of the bundled model run in this process (their HTTP apps on 127.0.0.1, the KV
over the in-process transport paced to an emulated link). One long prompt is sent as a prefill leg and then as a
decode leg, three ways: BF16 as is, the controller with lossless KV asked for, and the controller at 97% relative
quality; the section prints the profile chosen, the bytes moved, the job completion time against BF16 and whether
the reply is the single-instance one.
"""
from __future__ import annotations

import argparse
import time
from typing import Any

# the emulated link: this many bytes/s per byte of the model's KV per token, so that moving a prompt's BF16 KV takes
# several times its prefill on a small CPU (as on a slow network between GPU hosts)
LINK_BYTES_PER_S = 3e6


def handoff_section(a: argparse.Namespace, con: Any) -> None:
    from ..extras import MissingExtra, require_extra

    con.rule("prefill -> decode hand-off (KVServe)")
    try:
        require_extra("serve", "the hand-off section")
        require_extra("transfer", "the hand-off section")
    except MissingExtra as e:
        con.print(f"[yellow]skipped: {e}[/]")
        return
    _run(a, con)


def _run(a: argparse.Namespace, con: Any) -> None:
    from pydoc_data.topics import topics

    import httpx
    from rich.table import Table

    from ..benchmarks.procs import free_port
    from ..server.config import role_restore_defaults
    from ..config import RestoreConfig
    from ..engine.llm import LLM
    from ..engine.sampling_params import SamplingParams
    from ..server.app import build_app
    from ..server.config import ServerConfig
    from ..transfer.baselines import BF16
    from ..transfer.transport import InProcTransport, PacedTransport
    from ..server.threaded import app_thread

    engines = {role: LLM(a.model, device=a.device, dtype=a.dtype, progress=False,
                         restore=RestoreConfig(**role_restore_defaults(role, 16))) for role in ("prefill", "decode")}
    ports = {role: free_port() for role in engines}
    urls = {role: f"http://127.0.0.1:{p}" for role, p in ports.items()}
    link = PacedTransport(InProcTransport(), LINK_BYTES_PER_S)
    apps = {role: build_app(llm, ServerConfig(port=ports[role], role=role, kv_transport="inproc",
                                              advertise_url=urls[role], log_stats_interval_s=0,
                                              kv_accept_lossy=True),
                            transport=link if role == "prefill" else InProcTransport())
            for role, llm in engines.items()}
    tok = engines["decode"].tokenizer
    doc = topics["assert"][:1800] + "\n" + topics["pass"][:800]
    prompt = tok.encode(f"Reference:\n{doc}\nQuestion: what does the assert statement do?\nAnswer:")
    prompts = [prompt] + [[prompt[0], 1000 + i, *prompt[1:]] for i in (1, 2)]  # a new prompt per run: no cache
    greedy = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    replies = [o.text for o in engines["prefill"].generate(prompts, greedy)]  # one instance's replies (same engine)
    kv_per_token = engines["decode"].engine.model.args
    kv_bytes = 2 * kv_per_token.num_layers * kv_per_token.num_kv_heads * kv_per_token.head_dim * 2 * len(prompt)
    runs = [("BF16", {"profile": BF16}), ("lossless", {"min_quality": 1.0}), ("q>=0.97", {"min_quality": 0.97})]
    rows = []
    with app_thread(apps["prefill"], ports["prefill"]), app_thread(apps["decode"], ports["decode"]), \
            httpx.Client(timeout=300) as http:
        warm = [5, *prompt[:160]]  # one short hand-off first: the apps' first requests pay one-off costs
        leg = http.post(urls["prefill"] + "/v1/completions", json={
            "prompt": warm, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        http.post(urls["decode"] + "/v1/completions", json={
            "prompt": warm, "max_tokens": 2, "kv_transfer_params": leg.json()["kv_transfer_params"]})
        for (label, kv), ids, want in zip(runs, prompts, replies):
            ids = [ids[0], 7, *ids[1:]]  # the prefill instance holds the replies' prompts: one more new token
            t0 = time.perf_counter()
            leg = http.post(urls["prefill"] + "/v1/completions", json={
                "prompt": ids, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}})
            leg.raise_for_status()
            t1 = time.perf_counter()
            r = http.post(urls["decode"] + "/v1/completions", json={
                "prompt": ids, "max_tokens": a.max_tokens, "temperature": 0,
                "kv_transfer_params": leg.json()["kv_transfer_params"], "kv_transfer": kv})
            r.raise_for_status()
            body = r.json()
            rows.append((label, body["kv_transfer"], t1 - t0, time.perf_counter() - t0,
                         body["choices"][0]["text"] == want))
    con.print(f"prompt: {len(prompt)} tokens, {kv_bytes / 1e6:.1f} MB of BF16 KV; the link is paced to "
              f"{LINK_BYTES_PER_S * 8 / 1e6:.0f} Mbps (a slow network, scaled to this machine's compute); the "
              f"prefill instance's controller chooses each request's profile from the model's KVServe table and "
              f"the lossless pipelines, at the goodput it measured on earlier hand-offs")
    t = Table(title="one request, prefill on one instance, decode on another (the controller chose 2 and 3)")
    for col in ("run", "quality", "MB moved", "hand-off s", "JCT s", "vs BF16", "same reply"):
        t.add_column(col, justify="left" if col == "run" else "right", no_wrap=True)
    base = rows[0][3]
    for label, kv, _, jct, same in rows:
        used = kv.get("used")
        t.add_row(label, f"{kv['quality']:.3f}" if used and kv.get("quality") is not None else "-",
                  f"{kv['wire_bytes'] / 1e6:.2f}" if used else "-", f"{kv['seconds']:.2f}" if used else "-",
                  f"{jct:.2f}", f"{base / jct:.2f}x", "yes" if same else "no (lossy KV)")
    con.print(t)
    for label, kv, *_ in rows:
        con.print(f"  {label}: " + (f"profile {kv['profile']}" if kv.get("used") else
                                    f"recomputed ({kv.get('reason')}: {kv.get('message')})"))
    dec = engines["decode"].engine.restorer.stats
    con.print(f"decode instance: {dec.restored_tokens} prompt tokens restored from hand-offs, {dec.recomputed_tokens} "
              f"recomputed; JCT = prefill leg + decode leg (hand-off, then {a.max_tokens} tokens)")

