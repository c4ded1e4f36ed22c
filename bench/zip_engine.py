"""Engine decode throughput over the compressed cache: the fused `zip` attention backend (compress=True) against
uncompressed FlashInfer (compress=False) under ONE KV byte budget, plus decompress-then-attend at one batch.

Model: Llama-3.1-8B shape (`random:llama3-8b`, RANDOM weights, bf16). Each sequence: an 8192-token prefix,
prefilled (and, with compress=True, compressed) before timing, then one untimed decode step (CUDA graph capture,
JIT) and 255 timed ones; tokens/s = batch * steps / (sum of the step times). Steps that allocate or compress pages
are reported apart, with the host time spent in the scheduler and in compress, and the time spent waiting for sampled
tokens (the step's one wait for the device: near zero, the step is host-bound). The JSON is rewritten after every
batch ("complete": false until the end), so a run cut short by a time limit keeps what it measured. Batches 16, 32, 48 and each backend's largest batch under the budget:
the uncompressed one from its page count, zip's from the measured size of its compressed prefixes.

KV statistics: random weights give KV whose exponent statistics are not a trained model's, so while prefixes are
prefilled the K/V the random model writes are replaced by BF16 values captured from a real model (--kv-model,
default the bundled SmolLM2-135M on real text, bf16 compute), cut so that every 512-value block of the 8B layout
is one block of the real model: the pool then compresses as real KV does. The 16 pages each sequence fills while
decoding hold the random model's own KV. The JSON reports the K/V compressible fractions and ratios seen.

    python bench/zip_engine.py --out bench/results/zip_engine.json                     # CUDA, 3-5 minutes
    python bench/zip_engine.py --real-kv bench/data/real_kv.safetensors --out ...     # GPU host without the models
    python bench/zip_engine.py --smoke --out /tmp/zip_engine_smoke.json                # CPU: Triton interpreter

`kvtide bench zip-engine` runs the same; the JSON opens with the machine header and a PNG of tokens/s per batch is
written beside it.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import gzip
import json
import math
import os
import statistics
import sys
import time
from importlib import import_module
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import report  # noqa: E402
from bench.engine_gpu import env  # noqa: E402
from kvtide import LLM, CacheConfig, SamplingParams, SchedulerConfig  # noqa: E402
from kvtide.engine.attention import AttentionBackend, BatchLayout  # noqa: E402
from kvtide.engine.cuda_graphs import DecodeGraph, FullDecodeGraph  # noqa: E402
from kvtide.engine.model_runner import StepHandle  # noqa: E402
from kvtide.engine.llm_engine import LLMEngine  # noqa: E402
from kvtide.models.loader import RANDOM_PRESETS  # noqa: E402

PAGE = 16
# Kernel and graph rules a run can set (--zip-NAME on|off) and time the other way on the largest zip batch's engine
# (--other-NAME ROUNDS): (NAME, module, flag, run-name suffixes with it on / off, what it does, JSON key).
_ZC, _GRAPHS = "kvtide.kernels.zip_attention_cuda", "kvtide.engine.cuda_graphs"
KERNEL_RULES = (
    ("balanced", _ZC, "AUTO_BALANCED", ("balanced", "even"),
     "CUDA kernel: balanced runs where zip_attention_cuda's rule takes them (off: never)", "cuda_kernel_balanced_rule"),
    ("pdl-nudge", _GRAPHS, "PDL_NUDGE", ("nudge", "no_nudge"),
     "whole-step graphs (any backend): a trivial eager PDL launch before each replay", "pdl_nudge"),
)


# ---- real-model KV for the random model's prefixes -------------------------------------------------------
def real_kv_bank(model: str, device: str, tokens: int, head_dim: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """K and V groups [n, PAGE, head_dim] BF16 made of a real model's KV blocks, in block order, so each
    512-value block of a target group is one whole block of the real model (same exponent range)."""
    from bench.zip_format import capture_kv, groups  # bf16 compute over real prose + code windows

    shape, kv = capture_kv(model, device, tokens)
    bank = []
    for kind in (0, 1):
        flat = torch.cat([groups(layer, kind).reshape(-1) for layer in kv])
        n = flat.numel() // (PAGE * head_dim)
        bank.append(flat[: n * PAGE * head_dim].view(n, PAGE, head_dim))
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    info = {"model": model, "weights": "real (bundled GGUF, dequantised)", "captured": shape,
            "bank_groups_per_kind": int(bank[0].shape[0])}
    return info, bank[0], bank[1]


def real_kv_file(path: str, head_dim: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The same bank from a capture file of bench/zip_attention.py (--capture): [rows, 128] K and V streams of
    paired head_dim-64 rows, so that a machine without the bundled model (the GPU host) gets real-model KV."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        k, v = f.get_tensor("k_rows"), f.get_tensor("v_rows")
        models = json.loads(f.metadata()["models"])
    if k.shape[1] != head_dim:
        raise ValueError(f"{path} holds rows of {k.shape[1]} values, the model's head_dim is {head_dim}")
    n = k.shape[0] // PAGE
    info = {"model": f"file {path} ({', '.join(models)})", "weights": "real (bundled GGUF, dequantised)",
            "captured": models, "bank_groups_per_kind": n}
    return info, k[: n * PAGE].view(n, PAGE, head_dim), v[: n * PAGE].view(n, PAGE, head_dim)


class RealKV(AttentionBackend):
    """Wraps a backend: new tokens' K/V become bank values picked by (layer, page, head), then go on as usual."""

    def __init__(self, inner: AttentionBackend, bank_k: torch.Tensor, bank_v: torch.Tensor):
        self.inner, self.name = inner, inner.name
        self.bank_k, self.bank_v = bank_k, bank_v

    def plan(self, layout: BatchLayout) -> None:
        self.slots = layout.slot_mapping
        self.inner.plan(layout)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        page, off = self.slots // PAGE, self.slots % PAGE
        h = torch.arange(k.shape[1], device=k.device)
        key = page[:, None] * 1_000_003 + h[None, :] * 7919 + layer * 104_729  # [T, H]
        kb = self.bank_k[key % self.bank_k.shape[0], off[:, None]]
        vb = self.bank_v[(key + 1) % self.bank_v.shape[0], off[:, None]]
        return self.inner(layer, q, kb.to(k.dtype), vb.to(v.dtype))


# ---- runs -------------------------------------------------------------------------------------------------
def prompt(i: int, context: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(1000 + i)).tolist()


def page_events(eng: LLMEngine) -> tuple[int, int]:
    """(pages compressed, pages allocated): a step that changes either did page work (allocation, compression)."""
    if eng.pool is None:
        return 0, len(eng.block_manager.free)
    return eng.pool.counters["pages_compressed"], eng.pool.counters["pages_allocated"]


class HostClock:
    """Host seconds a step spends in the scheduler, page layout, attention plan, the forward's launches and the
    store's compress, and waiting for sampled tokens (``wait``: the step's one wait for the device; near zero
    means the host, not the device, sets the step time). Also CUDA events around the forward's graph replays, from
    which ``device_span`` (first kernel to last) is read once the run has synced: step time - span is time the
    device sat idle between steps (host work that async scheduling moves behind the device)."""

    current: "HostClock | None" = None  # the class-level wrappers (installed once) book into the newest clock

    def __init__(self, eng: LLMEngine) -> None:
        self.spent = {"schedule": 0.0, "layout": 0.0, "plan": 0.0, "launch": 0.0, "compress": 0.0, "wait": 0.0}
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        HostClock.current = self
        for cls in (DecodeGraph, FullDecodeGraph):  # the forward's launches and its device span
            if getattr(cls.run, "_bench_timed", False):
                continue
            run = cls.run

            def timed_run(graph, *args, _run=run, **kw):
                clock, t = HostClock.current, time.perf_counter()
                e0 = torch.cuda.Event(enable_timing=True)
                e0.record()
                try:
                    return _run(graph, *args, **kw)
                finally:
                    e1 = torch.cuda.Event(enable_timing=True)
                    e1.record()
                    if clock is not None:
                        clock.spent["launch"] += time.perf_counter() - t
                        clock.events.append((e0, e1))

            timed_run._bench_timed = True
            cls.run = timed_run
        if not getattr(StepHandle.result, "_bench_timed", False):
            result = StepHandle.result

            def timed_result(handle):
                t = time.perf_counter()
                try:
                    return result(handle)
                finally:
                    if HostClock.current is not None:
                        HostClock.current.spent["wait"] += time.perf_counter() - t

            timed_result._bench_timed = True
            StepHandle.result = timed_result
        self._wrap(eng.scheduler, "schedule", "schedule")
        self._wrap(eng.runner, "layout", "layout")
        self._wrap(eng.runner.attention, "plan", "plan")
        self._wrap(eng.runner.attention, "plan_graph", "plan")
        if eng.pool is not None:  # both halves (store.compress calls them too, so nothing counts twice)
            self._wrap(eng.pool, "compress_begin", "compress")
            self._wrap(eng.pool, "compress_finish", "compress")

    def _wrap(self, obj, name: str, bucket: str) -> None:
        fn = getattr(obj, name)
        active = self._active = getattr(self, "_active", set())

        def timed_call(*args, **kw):
            if bucket in active:  # plan_graph falling back to plan: counted once
                return fn(*args, **kw)
            active.add(bucket)
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                active.discard(bucket)
                self.spent[bucket] += time.perf_counter() - t

        setattr(obj, name, timed_call)

    def take(self) -> dict:
        """The step's buckets (seconds) and its forward's events (``span_events``, read after a sync)."""
        out, self.spent = self.spent, dict.fromkeys(self.spent, 0.0)
        out["span_events"], self.events = self.events, []
        return out


def drain(eng: LLMEngine, proxy: RealKV | None, sync, batch: int, page_steps: list[float] | None = None,
          skip_first: bool = False, host: list[tuple[bool, dict]] | None = None) -> tuple[list[float], int]:
    """Step until idle; real-model KV only in steps that carry prefill. Times of the steps where all `batch`
    sequences decode (and nothing else runs), and the number of steps. ``page_steps`` collects the times of
    those of them that also allocated or compressed pages (every 16th step when the batch runs in lockstep);
    ``skip_first`` leaves the first such step untimed (CUDA graph capture and kernel JIT happen there); ``host``
    gets (page step?, HostClock seconds) of each timed step.

    A step's time is the wall time of its ``eng.step()`` call. Synchronous engines are synced before and after
    each call; with async scheduling nothing is synced between calls (that would undo it): a call launches its
    step and then waits for the previous one's tokens, so in steady state calls are paced by the device."""
    inner = eng.runner.attention if proxy is None else proxy.inner
    clock = getattr(eng, "_bench_clock", None) or HostClock(eng)
    eng._bench_clock = clock
    times, steps = [], 0
    overlap = eng.async_scheduling
    sync()
    while eng.has_unfinished():
        ev0 = page_events(eng)
        clock.take()
        s = eng.scheduler
        prefill = bool(s.waiting) or any(q.num_computed_tokens < q.num_prompt_tokens for q in s.running)
        eng.runner.attention = proxy if (proxy is not None and prefill) else inner
        if not overlap:
            sync()
        launched = eng.stats.steps
        t0 = time.perf_counter()
        eng.step()
        if not overlap:
            sync()
        dt = time.perf_counter() - t0
        n_prefill, n_decode, _ = eng.stats.last_step
        spent = clock.take()
        if n_prefill == 0 and n_decode == batch and eng.stats.steps > launched:  # this call launched the step
            if skip_first:
                skip_first = False
            else:
                times.append(dt)
                paged = page_events(eng) != ev0
                if page_steps is not None and paged:
                    page_steps.append(dt)
                if host is not None:
                    host.append((paged, {**spent, "step": dt}))
        steps += 1
    sync()
    for _, h in host or []:  # every event has run now
        ev = h.pop("span_events", [])
        if ev:
            h["device_span"] = sum(a.elapsed_time(b) for a, b in ev) / 1e3
    eng.runner.attention = inner
    return times, steps


def warm(eng: LLMEngine, prompts: list[list[int]], proxy: RealKV | None, sync) -> float:
    """Prefill (and compress) the prefixes so that the timed run finds them cached."""
    t0 = time.perf_counter()
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    drain(eng, proxy, sync, -1)
    return time.perf_counter() - t0


def timed(eng: LLMEngine, prompts: list[list[int]], steps: int, proxy: RealKV | None, sync) -> dict:
    warm_s = warm(eng, prompts, proxy, sync)
    b = len(prompts)
    pre0, k0 = eng.scheduler.num_preemptions, dict(getattr(eng.runner.attention, "counts", {}))
    for p in prompts:  # + 2: the prefill's token, an untimed first decode step (graph capture, JIT), `steps` timed
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    page_steps: list[float] = []
    host: list[tuple[bool, dict]] = []
    gc_log: list[tuple[int, float]] = []  # (generation, seconds) of each collection during the timed run
    t_gc = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            t_gc[0] = time.perf_counter()
        else:
            gc_log.append((info["generation"], time.perf_counter() - t_gc[0]))

    gc.callbacks.append(on_gc)
    try:
        times, n = drain(eng, proxy, sync, b, page_steps, skip_first=True, host=host)
    finally:
        gc.callbacks.remove(on_gc)
    k1 = getattr(eng.runner.attention, "counts", {})
    if not times:
        return {"batch": b, "error": "no step decoded the whole batch", "preemptions": eng.scheduler.num_preemptions - pre0}
    med = sorted(times)[len(times) // 2]
    plain = list(times)
    for t in page_steps:
        plain.remove(t)
    return {
        "batch": b, "decode_steps_timed": len(times), "steps_total": n, "warm_prefill_seconds": warm_s,
        "median_step_ms": med * 1e3, "mean_step_ms": sum(times) / len(times) * 1e3,
        "untimed_first_decode_step": True,
        "page_steps": len(page_steps),
        "host_ms_mean": {kind: {part: statistics.mean(h.get(part, 0.0) for paged, h in host if paged == want) * 1e3
                                for part in ("schedule", "layout", "plan", "launch", "compress", "wait", "step",
                                             "device_span")}
                         for kind, want in (("page_steps", True), ("plain_steps", False))
                         if any(paged == want for paged, _ in host)},
        # steps over 1.3 x the median, one by one: where their host time went (the rest of "step" is the engine's
        # own bookkeeping: outputs, page commits), to tell a host stall from device work
        "slow_steps": [{"index": i, "page_step": paged, **{k: round(v * 1e3, 2) for k, v in h.items()},
                        "other": round((h["step"] - sum(h.get(k, 0.0) for k in ("schedule", "layout", "plan", "launch",
                                                                                   "compress", "wait"))) * 1e3, 2)}
                       for i, (paged, h) in enumerate(host) if h["step"] > 1.3 * med],
        "page_step_median_ms": statistics.median(page_steps) * 1e3 if page_steps else None,
        "plain_step_mean_ms": statistics.mean(plain) * 1e3 if plain else None,
        "tokens_per_s": b * len(times) / sum(times), "preemptions": eng.scheduler.num_preemptions - pre0,
        "step_ms": [round(t * 1e3, 2) for t in times],
        "gc": {"collections_by_generation": {g: sum(1 for x, _ in gc_log if x == g) for g in (0, 1, 2)},
               "ms_by_generation": {g: round(sum(t for x, t in gc_log if x == g) * 1e3, 2) for g in (0, 1, 2)},
               "longest_ms": round(max((t for _, t in gc_log), default=0.0) * 1e3, 2)},
        **({"kernel_seqs": k1["kernel_seqs"] - k0["kernel_seqs"], "fallback_seqs": k1["fallback_seqs"] - k0["fallback_seqs"]}
           if k1 else {}),
    }


def profile_decode(eng: LLMEngine, prompts: list[list[int]], steps: int, proxy: RealKV | None, sync,
                   trace: Path | None = None) -> dict:
    """torch.profiler over `steps` whole-batch decode steps (after the timed runs): where a step's time goes
    on the host (self CPU time per op) and on the device (CUDA time per kernel). ``trace``: also write the
    timeline (Chrome trace, gzipped), where a page step's host ops and device waits can be read one by one."""
    from torch.profiler import ProfilerActivity, profile, record_function

    warm(eng, prompts, proxy, sync)
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    inner = eng.runner.attention if proxy is None else proxy.inner
    done = 0
    while eng.has_unfinished() and done == 0:  # until a step decodes the whole batch
        s = eng.scheduler
        prefill = bool(s.waiting) or any(q.num_computed_tokens < q.num_prompt_tokens for q in s.running)
        eng.runner.attention = proxy if (proxy is not None and prefill) else inner
        eng.step()
        done = int(eng.stats.last_step[0] == 0 and eng.stats.last_step[1] == len(prompts))
    eng.runner.attention = inner
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    t0 = time.perf_counter()
    walls = []
    with profile(activities=acts) as prof:
        for _ in range(steps):
            t1 = time.perf_counter()
            with record_function("kvtide.bench_step"):  # step windows for bench/tools/trace_gaps.py
                eng.step()
            walls.append((time.perf_counter() - t1) * 1e3)
        sync()
    wall = time.perf_counter() - t0
    if trace is not None:
        raw = trace.with_suffix("")  # export_chrome_trace writes plain JSON; gzip it beside
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(trace, "wb") as g:
            g.write(f.read())
        raw.unlink()
        from bench.tools.trace_gaps import analyze, load

        gaps = analyze(load(trace))  # device idle gaps and what the host did then: see bench/tools/trace_gaps.py
    drain(eng, None, sync, -1)
    ev = prof.key_averages()

    def top(key: str, n: int = 20) -> list[dict]:
        rows = sorted(ev, key=lambda e: getattr(e, key, 0) or 0, reverse=True)[:n]
        return [{"name": e.key[:80], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                 "device_ms": (getattr(e, "self_device_time_total", 0) or 0) / 1e3} for e in rows]

    ranges: dict[str, float] = {}  # a range appears twice on CUDA (host and device annotation): keep the host one
    for e in ev:
        if e.key.startswith("kvtide."):
            ranges[e.key] = max(ranges.get(e.key, 0.0), e.cpu_time_total / 1e3 / steps)
    busy = sum((getattr(e, "self_device_time_total", 0) or 0) for e in ev) / 1e3 / steps
    return {"batch": len(prompts), "steps": steps, "wall_ms_per_step_profiled": wall / steps * 1e3,
            "step_wall_ms_profiled": walls,
            "device_busy_ms_per_step": busy, "host_ms_per_step_by_phase": ranges,
            "top_self_cpu": top("self_cpu_time_total"), "top_device": top("self_device_time_total"),
            **({"trace_gaps": gaps} if trace is not None else {})}


def compression_seen(eng: LLMEngine) -> dict:
    """Blocks stored compressed (desc != 0xFF) among the compressed pages held, K and V, and byte ratios."""
    from kvtide.cache.zip_pages import COMPRESSED

    st = eng.pool
    pids = torch.from_numpy((st.state == COMPRESSED).nonzero()[0]).to(st.device)
    s = eng.kv_stats()
    out = {"pages_compressed_held": int(pids.numel()), "k_ratio_stored_over_raw": s["k_ratio"],
           "v_ratio_stored_over_raw": s["v_ratio"], "fragmentation": s.get("fragmentation")}
    for i, kind in enumerate("kv"):
        hits = total = 0
        for chunk in pids.split(4096):
            d = st.group_desc_all[:, chunk, :, i]
            hits += int((d != 0xFF).sum())
            total += d.numel()
        out[f"{kind}_compressible_block_fraction"] = hits / max(1, total)
    return out


def _cuda_stage(head_dim: int) -> int | None:
    """Where the CUDA zip kernel stages the next page by default at this head_dim (None: it takes no such shape)."""
    from kvtide.kernels import zip_attention_cuda as zc

    return zc.default_stage(head_dim) if head_dim in (64, 128) else None


def run_backend(label: str, backend: str, compress: bool, a, budget: int, batches: list[int] | None,
                bank: tuple[torch.Tensor, torch.Tensor] | None, steps: int, sync, partial=None) -> dict:
    """One engine; prefixes warmed once and reused from the prefix cache; batches in increasing order.
    ``partial(result so far)`` is called after each batch (the caller writes it out)."""
    try:
        llm = LLM(a.model_name, progress=False, device=a.device, dtype=a.dtype, attention_backend=backend, seed=0,
                  cuda_graphs=a.cuda_graphs, full_cuda_graphs={"auto": None, "whole": True, "piecewise": False}[a.graphs],
                  async_scheduling={"auto": None, "on": True, "off": False}[a.async_scheduling],
                  cache=CacheConfig(kv_cache_bytes=budget, compress=compress, format_version=a.format_version,
                                    compress_spread_steps=a.compress_spread_steps),
                  scheduler=SchedulerConfig(max_num_seqs=4096, max_num_batched_tokens=a.step_tokens,
                                            max_model_len=a.context + steps + PAGE, page_lookahead=a.page_lookahead))
    except ValueError as e:  # e.g. zip refusing a pool the kernel cannot address
        gc.collect()
        if a.device == "cuda":
            torch.cuda.empty_cache()
        return {"backend": backend, "compress": compress, "error": str(e)}
    eng = llm.engine
    vocab = eng.model.args.vocab_size
    per_seq = math.ceil((a.context + steps) / PAGE)  # pages a sequence holds at its last step
    proxy = RealKV(eng.runner.attention, *bank) if bank is not None else None
    out: dict = {"backend": eng.runner.attention.name, "compress": compress, "pages_per_sequence": per_seq,
                 "raw_capacity_pages": eng.num_pages}
    if not compress:
        largest = eng.num_pages // per_seq
        out["largest_batch"] = largest
        out["largest_batch_how"] = "raw pages // pages per sequence"
    else:
        n0 = min(max(batches or [a.ref_batch]), eng.num_pages // per_seq)
        out["warm_probe_seconds"] = warm(eng, [prompt(i, a.context, vocab) for i in range(n0)], proxy, sync)
        used = eng.num_pages - eng.pool.free_pages()  # raw-page units taken by n0 compressed prefixes (+ reserve)
        prefix_pages = a.context // PAGE
        per_prefix = used / n0
        # Prefix pages at their measured size (one recomputed), decode pages counted raw: conservative.
        largest = int(eng.num_pages // (per_prefix * (prefix_pages - 1) / prefix_pages + (per_seq - prefix_pages + 1)))
        if a.zip_largest:  # start the probe elsewhere (e.g. above the conservative estimate)
            out["largest_batch_estimate"] = largest
            largest = a.zip_largest
        out.update(largest_batch=largest, probe_prefixes=n0, raw_pages_per_compressed_prefix=per_prefix,
                   largest_batch_how="raw capacity // (measured raw-page units of a compressed prefix + decode "
                                     "pages counted raw), lowered until the whole batch decodes every step",
                   compression_after_prefill=compression_seen(eng))
    runs = {}
    want = sorted({b for b in (batches or []) if b <= largest} | ({largest} if batches is not None else {a.ref_batch}))
    for b in want:
        for _ in range(4):  # the largest batch is an estimate: step down while it does not run whole
            r = timed(eng, [prompt(i, a.context, vocab) for i in range(b)], steps, proxy, sync)
            whole = r.get("preemptions", 1) == 0 and r.get("decode_steps_timed") == steps
            if whole or b != largest or b <= 1:
                break
            runs[f"{b}_not_whole"] = r
            b = largest = max(1, b - max(1, b // 50))
        r["async_scheduling"] = eng.async_scheduling
        runs[str(b)] = r
        rows = [(str(b), r)]
        if a.other_mode:  # the same batch on the same engine with async scheduling the other way
            eng.async_scheduling = not eng.async_scheduling
            key = f"{b}_{'async' if eng.async_scheduling else 'sync'}"
            runs[key] = timed(eng, [prompt(i, a.context, vocab) for i in range(b)], steps, proxy, sync)
            runs[key]["async_scheduling"] = eng.async_scheduling
            eng.async_scheduling = not eng.async_scheduling
            rows.append((key, runs[key]))
        if a.other_graph_mode and eng.runner.graphs is not None:  # the same batch with the other kind of graphs
            eng.runner.full_graphs = not eng.runner.full_graphs
            key = f"{b}_{'full' if eng.runner.full_graphs else 'piecewise'}_graphs"
            runs[key] = timed(eng, [prompt(i, a.context, vocab) for i in range(b)], steps, proxy, sync)
            runs[key]["full_cuda_graphs"] = eng.runner.full_graphs
            eng.runner.full_graphs = not eng.runner.full_graphs
            rows.append((key, runs[key]))
        for name, mod, flag, names, _, _ in KERNEL_RULES:
            rounds = getattr(a, "other_" + name.replace("-", "_"))
            if not (rounds and compress and b == largest):
                continue
            # rounds of a rule the other way, then as given: same engine, same sequences, alternated
            zc = import_module(mod)
            given = getattr(zc, flag)
            for rnd in range(1, rounds + 1):
                for toggle in (True, False):
                    setattr(zc, flag, given != toggle)
                    key = f"{b}_{names[0] if getattr(zc, flag) else names[1]}_{rnd}"
                    runs[key] = timed(eng, [prompt(i, a.context, vocab) for i in range(b)], steps, proxy, sync)
                    runs[key][flag.lower()] = getattr(zc, flag)
                    rows.append((key, runs[key]))
            setattr(zc, flag, given)
        r["full_cuda_graphs"] = eng.runner.full_graphs
        if partial is not None:
            partial({**out, "largest_batch": largest, "runs": dict(runs)})
        for key, r in rows:
            print(f"  {label:>12} batch {key:>9}: {r.get('median_step_ms', float('nan')):8.2f} ms/step "
                  f"{r.get('tokens_per_s', float('nan')):9.0f} tok/s  preemptions {r.get('preemptions')}; "
                  f"mean {r.get('mean_step_ms', float('nan')):.2f} ms, plain steps {r.get('plain_step_mean_ms') or 0:.2f}, "
                  f"{r.get('page_steps')} page steps {r.get('page_step_median_ms') or 0:.2f}; host ms "
                  f"{ {k: {p: round(x, 2) for p, x in v.items()} for k, v in r.get('host_ms_mean', {}).items()} }",
                  flush=True)
    out["largest_batch"] = largest
    out["runs"] = runs
    if a.profile_steps:
        pb = {"smallest": min(want), "largest": largest}.get(a.profile_batch) or int(a.profile_batch)
        trace = (a.profile_trace.with_name(f"{a.profile_trace.name.removesuffix('.json.gz')}_{label.strip()}.json.gz")
                 if a.profile_trace else None)
        out["profile"] = profile_decode(eng, [prompt(i, a.context, vocab) for i in range(pb)], a.profile_steps, proxy,
                                        sync, trace)
        print(f"  {label:>12} profile (batch {pb}): {out['profile']['wall_ms_per_step_profiled']:.1f} ms/step, device "
              f"busy {out['profile']['device_busy_ms_per_step']:.1f}; top kernels "
              f"{[(r['name'][:40], round(r['device_ms'] / a.profile_steps, 2)) for r in out['profile']['top_device'][:8]]}; phases "
              f"{ {k: round(v, 2) for k, v in out['profile']['host_ms_per_step_by_phase'].items()} }; top "
              f"host ops: {[(r['name'], round(r['self_cpu_ms'] / a.profile_steps, 2)) for r in out['profile']['top_self_cpu'][:6]]}",
              flush=True)
    out["kv_stats_end"] = {k: v for k, v in eng.kv_stats().items() if isinstance(v, (int, float, bool))}
    out["decode_kernel"] = getattr(getattr(eng.runner.attention, "kernel", None), "__name__", eng.runner.attention.name)
    out["value_order"] = eng.pool.geo.value_order if compress else None
    out["cuda_graph_captures"] = eng.runner.graphs.captures if eng.runner.graphs is not None else 0
    out["cuda_graph_whole_step_captures"] = eng.runner.graphs.full_captures if eng.runner.graphs is not None else 0
    if compress:
        out["compression_end"] = compression_seen(eng)
    del llm, eng, proxy
    gc.collect()
    if a.device == "cuda":
        torch.cuda.empty_cache()
    return out


def tokens_per_s(res: dict, b: int) -> float | None:
    r = res.get("runs", {}).get(str(b), {})
    return r.get("tokens_per_s")


def load_zip_options(spec: str | None, context: int) -> dict:
    """--zip-options: inline JSON, or a bench/zip_attention.py result whose tuned best to replay."""
    if not spec:
        return {}
    if spec.lstrip().startswith("{"):
        return json.loads(spec)
    rows = [r for r in json.loads(Path(spec).read_text())["results"] if "options" in r.get("zip", {})]
    if not rows:
        sys.exit(f"{spec}: no tuned zip options in this result file")
    pick = [r for r in rows if r["context"] == context and r["batch"] == 64] or rows[-1:]
    return pick[0]["zip"]["options"]


def draw(doc: dict, plt):
    """Headline figure: decode tokens/s against batch for each backend, its largest batch marked."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, r in doc.get("backends", {}).items():
        pts = sorted((int(k), v["tokens_per_s"]) for k, v in r.get("runs", {}).items()
                     if k.isdigit() and v.get("tokens_per_s"))
        if not pts:
            continue
        line, = ax.plot(*zip(*pts), "o-", label=name)
        big = r.get("largest_batch")
        if big is not None and str(big) in r["runs"] and r["runs"][str(big)].get("tokens_per_s"):
            ax.plot([big], [r["runs"][str(big)]["tokens_per_s"]], "*", ms=14, color=line.get_color())
    largest = (doc.get("ratios_zip_over_baseline") or {}).get("largest_batch") or {}
    ratio = largest.get("zip_over_baseline_tokens_per_s")
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"engine decode, one KV budget ({doc.get('model', {}).get('name', '')})"
                 + (f": zip / baseline at each largest {ratio:.3f}x" if ratio else ""), fontsize=9)
    ax.legend(fontsize=8)
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: tiny random model, Triton interpreter")
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=255)
    ap.add_argument("--batches", default="16,32,48")
    ap.add_argument("--budget-seqs", type=float, default=52.0,
                    help="KV budget = this many uncompressed sequences of context + steps tokens")
    ap.add_argument("--kv-model", default="smollm2-135m", help="real model whose KV the prefixes get; 'none': own KV")
    ap.add_argument("--real-kv", help="take the real-model KV bank from this capture file instead of --kv-model")
    ap.add_argument("--kv-tokens", type=int, default=512, help="tokens per text window captured (prose + code)")
    ap.add_argument("--ref-batch", type=int, default=16)
    ap.add_argument("--ref-steps", type=int, default=32, help="timed steps of decompress-then-attend (slow)")
    ap.add_argument("--baseline", default="flashinfer", help="uncompressed backend (and decompress-then-attend's inner)")
    ap.add_argument("--step-tokens", type=int, default=16384, help="SchedulerConfig.max_num_batched_tokens")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cuda-graphs", action="store_true", help="EngineConfig.cuda_graphs for every backend (decode steps)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after the timed runs, profile this many decode steps (17 include a page step)")
    ap.add_argument("--profile-batch", default="smallest", help="batch to profile: smallest, largest or a number")
    ap.add_argument("--profile-trace", type=Path, default=None,
                    help="with --profile-steps: also write each backend's timeline as <stem>_<backend>.json.gz")
    ap.add_argument("--only", default="baseline,zip,decompress",
                    help="which of baseline, zip, decompress to run (comma list; ratios need baseline and zip)")
    ap.add_argument("--format-version", type=int, default=CacheConfig.format_version, choices=(1, 2),
                    help="ZipFusion format of the compressed pool (2: exact-zero escapes; default: CacheConfig's)")
    ap.add_argument("--async-scheduling", default="auto", choices=("auto", "on", "off"),
                    help="EngineConfig.async_scheduling for every backend (auto: on for CUDA)")
    ap.add_argument("--compress-spread-steps", type=int, default=CacheConfig.compress_spread_steps,
                    help="CacheConfig.compress_spread_steps (1: place a page step's pages all in the next step)")
    ap.add_argument("--page-lookahead", type=int, default=SchedulerConfig.page_lookahead,
                    help="SchedulerConfig.page_lookahead (0: every page taken in the step that needs it)")
    ap.add_argument("--zip-largest", type=int, default=None,
                    help="zip's largest batch to try first (default: the estimate from its compressed prefixes); "
                         "lowered while it does not run whole")
    ap.add_argument("--graphs", choices=["auto", "whole", "piecewise"], default="auto",
                    help="with --cuda-graphs: whole-step graphs (attention captured), piecewise (attention eager "
                         "between graphs), or each backend's default (EngineConfig.full_cuda_graphs=None)")
    ap.add_argument("--other-graph-mode", action="store_true",
                    help="with --cuda-graphs: also time each batch with the other kind of graphs, same engine")
    ap.add_argument("--other-mode", action="store_true",
                    help="also time each batch with async scheduling the other way, on the same engine "
                         "(runs '<batch>_sync' or '<batch>_async')")
    ap.add_argument("--zip-options", default=None,
                    help="JSON launch options for the zip kernel (e.g. the best of bench/zip_attention.py), or a "
                         "zip_attention result JSON: its best options at the --context x 64 row (else the last row)")
    for name, _, flag, (on, off), what, _ in KERNEL_RULES:
        ap.add_argument(f"--zip-{name}", choices=("on", "off"), default=None,
                        help=f"{what} ({flag}; default: as shipped)")
        ap.add_argument(f"--other-{name}", type=int, default=0,
                        help=f"zip: after its largest batch, this many rounds of ({name} the other way, then as "
                             f"given), same engine; runs '<batch>_{on}_<i>' and '<batch>_{off}_<i>'")
    a = ap.parse_args(argv)
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first kernel launch
        a.device, a.preset, a.context, a.steps, a.batches = "cpu", "tiny", 48, 3, "2"
        a.budget_seqs, a.kv_tokens, a.ref_batch, a.ref_steps, a.baseline, a.step_tokens = 4, 32, 2, 2, "torch", 256
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/zip_engine.py needs a CUDA device (or --smoke for a CPU dry run)")
    a.dtype = "bfloat16" if a.device == "cuda" else "float32"
    args = RANDOM_PRESETS[a.preset]()
    a.model_name = f"random:{a.preset}"
    if a.layers is not None and a.layers != args.num_layers:
        a.model_name = f"random:{a.preset}-L{a.layers}"
        RANDOM_PRESETS[a.model_name.split(":", 1)[1]] = lambda p=a.preset, n=a.layers: dataclasses.replace(
            RANDOM_PRESETS[p](), num_layers=n)
        args = RANDOM_PRESETS[a.model_name.split(":", 1)[1]]()
    raw_page = args.num_layers * 2 * PAGE * args.num_kv_heads * args.head_dim * 2
    per_seq = math.ceil((a.context + a.steps) / PAGE)
    budget = int(a.budget_seqs * per_seq) * raw_page + 8 * raw_page  # a few pages of slack for the admission reserve
    batches = sorted({int(b) for b in a.batches.split(",")})
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

    for name, mod, flag, _, _, _ in KERNEL_RULES:
        if getattr(a, "zip_" + name.replace("-", "_")) is not None:
            setattr(import_module(mod), flag, getattr(a, "zip_" + name.replace("-", "_")) == "on")
    zip_options = load_zip_options(a.zip_options, a.context)
    if zip_options:
        from kvtide.kernels import zip_attention as za
        za.set_defaults("zip", **zip_options)
    res: dict = {"env": env(), "zip_kernel_options": zip_options or "defaults of kvtide.kernels.zip_attention",
                 "cuda_kernel_stage": _cuda_stage(args.head_dim),
                 **{key: getattr(import_module(mod), flag) for _, mod, flag, _, _, key in KERNEL_RULES},
                 "weights": "RANDOM (std 0.02) at the preset's shape: no trained 8B weights are reachable",
                 "model": {"name": a.model_name, "args": str(args), "compute_dtype": a.dtype, "kv_dtype": "bfloat16"},
                 "setup": {"context": a.context, "timed_decode_steps": a.steps, "page_size": PAGE,
                           "kv_cache_bytes": budget, "kv_cache_gib": budget / 2**30,
                           "budget_note": f"{a.budget_seqs:g} uncompressed sequences of {a.context}+{a.steps} tokens "
                                          "(+8 pages), the same bytes for every backend",
                           "batches": batches, "step_tokens": a.step_tokens, "cuda_graphs": a.cuda_graphs,
                           "format_version": a.format_version, "async_scheduling": a.async_scheduling,
                           "other_mode": a.other_mode, "compress_spread_steps": a.compress_spread_steps,
                           "graphs": a.graphs if a.cuda_graphs else None,
                           "other_graph_mode": a.other_graph_mode,
                           **{f"other_{n}_rounds": getattr(a, f"other_{n}")
                              for n in (name.replace("-", "_") for name, *_ in KERNEL_RULES)},
                           "page_lookahead": a.page_lookahead,
                           "tokens_per_s": "batch * timed steps / sum of timed step seconds (steps where the whole "
                                           "batch decodes and nothing else runs)"}}
    bank = None
    if a.kv_model != "none" or a.real_kv:
        try:
            if a.real_kv:
                info, bk, bv = real_kv_file(a.real_kv, args.head_dim)
            else:
                info, bk, bv = real_kv_bank(a.kv_model, a.device, a.kv_tokens, args.head_dim)
        except Exception as e:  # any failure to load or run it: say what to do instead of a traceback
            sys.exit(f"could not get real-model KV from '{a.real_kv or a.kv_model}' ({type(e).__name__}: {e}); install the "
                     "bundled model, pass a .gguf file or HF directory, or --kv-model none (random-model KV)")
        bank = (bk.to(a.device), bv.to(a.device))
        res["kv_source"] = {**info, "applied_to": "every prefix token (prefill steps); decode-step pages hold the "
                                                  "random model's own KV (16 of each sequence's pages)"}
    else:
        res["kv_source"] = {"model": "none: the random-weight model's own KV (not real-model statistics)"}

    print(f"KV budget {budget / 2**30:.2f} GiB; model {a.model_name} (random weights)", flush=True)
    zip_name = "zip"
    only = set(a.only.split(","))
    if only - {"baseline", "zip", "decompress"}:
        sys.exit(f"--only: unknown part(s) {sorted(only - {'baseline', 'zip', 'decompress'})}")
    res["setup"]["only"] = sorted(only)
    res["backends"] = {}
    a.out.parent.mkdir(parents=True, exist_ok=True)

    def record(name: str, result: dict) -> None:  # written after each backend: a run cut short keeps what it did
        res["backends"][name] = result
        report.write(a.out, {**res, "complete": False}, argv=argv, png=False, indent=2)

    if "baseline" in only:
        record(a.baseline, run_backend(a.baseline, a.baseline, False, a, budget, batches, bank, a.steps, sync,
                                       lambda r: record(a.baseline, r)))
    if "zip" in only:
        record(zip_name, run_backend(zip_name, "zip", True, a, budget, batches, bank, a.steps, sync,
                                     lambda r: record(zip_name, r)))
    if "decompress" in only:
        name = f"decompress+{a.baseline}"
        record(name, run_backend("decompress", a.baseline, True, a, budget, None, bank, a.ref_steps, sync,
                                 lambda r: record(name, r)))
    base, z = res["backends"].get(a.baseline, {}), res["backends"].get(zip_name, {})
    ratios = {"equal_batch": {}, "largest_batch": None}
    for b in batches:
        x, y = tokens_per_s(z, b), tokens_per_s(base, b)
        ratios["equal_batch"][str(b)] = x / y if x and y else None
    if "largest_batch" in z and "largest_batch" in base:
        x, y = tokens_per_s(z, z["largest_batch"]), tokens_per_s(base, base["largest_batch"])
        ratios["largest_batch"] = {"zip_batch": z["largest_batch"], "baseline_batch": base["largest_batch"],
                                   "zip_over_baseline_tokens_per_s": x / y if x and y else None}
    res["ratios_zip_over_baseline"] = ratios
    res["complete"] = True
    report.write(a.out, res, draw, argv, indent=2)

    print(f"\n{'backend':<24}{'batch':>6}{'ms/step':>10}{'tok/s':>10}")
    for name, r in res["backends"].items():
        if "error" in r:
            print(f"{name:<24}  refused: {r['error'][:90]}")
            continue
        for b, run in r["runs"].items():
            print(f"{name:<24}{b:>6}{run.get('median_step_ms', float('nan')):>10.2f}{run.get('tokens_per_s', float('nan')):>10.0f}")
    print(f"zip / {a.baseline} tokens/s: equal batch {ratios['equal_batch']}; largest {ratios['largest_batch']}")
    if "compression_after_prefill" in z:
        c = z["compression_after_prefill"]
        print(f"compressible blocks K {c['k_compressible_block_fraction']:.3f} V {c['v_compressible_block_fraction']:.3f}"
              f" (KV from {res['kv_source']['model']}); KV budget {budget / 2**30:.2f} GiB; wrote {a.out}")


if __name__ == "__main__":
    main()
