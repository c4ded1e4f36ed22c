"""Host cost of the compressed pool's *page steps* on the CPU, at the bookkeeping scale of the H200 engine run.

What it reproduces: bench/zip_engine.py on the H200 (bench/results/zip_engine_cuda_graphs_h200_split.json, zip
backend, Llama-3.1-8B KV shape: 32 layers, 8 KV heads, page 16, 8192-token prefixes, a 53.6 GiB budget = 55,143
chunks of 255 raw-group slots, 36,618 page ids). Every 16th decode step every sequence fills a page: the scheduler
allocates a new page per sequence (evicting cached prefix pages when the pool is full) and the filled pages are
compressed (``compress_begin`` in one step, ``compress_finish`` in the next). Those steps cost ~44 ms against
23.5 ms at batch 65, with 15 ms in ``Scheduler.schedule`` and 21 ms in compress (host).

How: no model. The engine's scheduler, block manager and compressed store are driven as ``LLMEngine.step`` and
``ModelRunner.execute`` drive them (schedule, write the step's K/V, ``compress_finish`` / ``compress_begin``, commit
the pages, sample a token), through the bench's history: 48 prefixes prefilled (the probe), batch 48 decoded 257
tokens, then batch 65 (17 more prefixes prefilled into a full pool: in-place compression, prefix evictions) decoded
257 tokens. The bookkeeping (page ids, chunks, slots per chunk, groups per page, size classes, layers) is the H200
run's; only the bytes shrink: head_dim 8 and 32-value blocks (4 blocks per group, as d=128 with 512-value blocks), so
the pool is 3.4 GiB. The K/V values are constant but for a per-block outlier that makes ~21% of K blocks and ~7% of V
blocks of prefill steps incompressible (the H200 run measured 79% / 93% compressible on the real-model KV its
prefixes got, format v1; with v2, the engine's default since, 92.8% / 93.0%: pass --p-raw-k 0.072), 5% of decode
steps' (the random model's own KV there), picked by a hash of (layer, page, head, block). The format version and the
spread of placement over steps follow the tree's CacheConfig defaults unless given. With v1 and no spread, the end
state matched the H200 run's closely (pages held 34,587 vs 34,623, compressed in all 35,297 vs 35,297, groups in
place 498K vs 507K, prefix evictions 710 vs 674, no preemption).

Reported: per kind of step of the last batch's decode (page: allocates and finishes compressing pages; begin: stages
the pages that filled; plain), host ms in ``schedule``, ``compress_begin`` / ``compress_finish`` and in the traced
functions inside them. On the CPU the tensor ops in there are compute (pack, analyze, zeroing); on a GPU they are
launches, and a host sync there waits for the device: read the pure-Python/numpy functions (ChunkPool.*,
ZipPagedKV._place, BlockManager._make_room) for the host bookkeeping a GPU host runs too. Torch runs one thread
(with a busy second core, two threads made small ops up to 40x slower). The JSON holds a digest of the final
tables and pool bytes: equal digests = every group placed at the same byte by both versions.

Modes (each rebuilds the history, ~4-8 min, unless resumed from a snapshot; ~5 GiB RAM, twice that with --ab):
    python bench/tools/zip_page_steps.py --out /tmp/new.json --snapshot /tmp/new.pt                 # this tree
    git archive <old commit> kvtide | tar -x -C /tmp/old                                     # an older tree
    python bench/tools/zip_page_steps.py --kvtide /tmp/old --out /tmp/old.json --snapshot /tmp/old.pt
    # whole steps of both versions in one process, in turn, from their snapshots (states must stay equal):
    python bench/tools/zip_page_steps.py --resume /tmp/new.pt --ab /tmp/old --ab-resume /tmp/old.pt --out ab.json
    # the host bookkeeping alone, old and new classes replayed on copies of the same state at each page step:
    python bench/tools/zip_page_steps.py --resume /tmp/new.pt --replay /tmp/old --no-trace --out replay.json
    python bench/tools/zip_page_steps.py --out /tmp/p.json --profile                                   # cProfile
    # the GPU run's block classes (its --real-kv capture, the store's mma order) and the pool's slab ownership:
    python bench/tools/zip_page_steps.py --batches 52,66 --no-trace --real-kv bench/data/real_kv.safetensors \
        --shared-slabs 0 --out /tmp/layer.json                                                 # 1: shared slabs
    python bench/tools/zip_page_steps.py --out /tmp/s.json --layers 4 --context 1024 --steps 64 --batches 6,8 \
        --budget-seqs 7 --step-tokens 2048                                                      # seconds
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import hashlib
import importlib.util
import inspect
import itertools
import json
import math
import os
import pickle
import platform
import pstats
import statistics
import sys
import time
import types
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch


def _import_kvtide(root: str | None):
    sys.path.insert(0, root or str(Path(__file__).resolve().parents[2]))
    import kvtide  # noqa: F401
    from kvtide.cache.zip_pages import ZipGeometry, ZipPagedKV
    from kvtide.config import SchedulerConfig
    from kvtide.engine.block_manager import BlockManager
    from kvtide.engine.sampling_params import SamplingParams
    from kvtide.engine.scheduler import Scheduler
    from kvtide.engine.sequence import Sequence, Status

    return ZipGeometry, ZipPagedKV, SchedulerConfig, BlockManager, SamplingParams, Scheduler, Sequence, Status


PAGE = 16
OLD = "kvtide_old"  # the package name another tree is imported under (--ab)


def _import_tree_as(root: str, alias: str = OLD) -> None:
    """Import the kvtide package of another tree under another name (its modules import each other relatively)."""
    init = Path(root) / "kvtide" / "__init__.py"
    spec = importlib.util.spec_from_file_location(alias, init, submodule_search_locations=[str(init.parent)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod
    spec.loader.exec_module(mod)


def _pickle_as(alias: str) -> types.ModuleType:
    """A pickle module for torch.load that resolves kvtide's classes in package ``alias`` instead."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if module == "kvtide" or module.startswith("kvtide."):
                module = alias + module[len("kvtide"):]
            return super().find_class(module, name)

    m = types.ModuleType(f"pickle_as_{alias}")
    m.Unpickler, m.Pickler, m.load, m.dump = Unpickler, pickle.Pickler, pickle.load, pickle.dump
    return m


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64-style hash of int64 keys -> uniform floats in [0, 1)."""
    x = x * -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (wrapping multiply)
    x = x ^ ((x >> 31) & 0x1FFFFFFFF)
    x = x * -4658895280553007687
    x = x ^ ((x >> 29) & 0x7FFFFFFFF)
    return (x & 0xFFFFFF).double() / float(1 << 24)


def real_raw_patterns(path: str, order: str, block_size: int, version: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Per group of a real-KV capture (bench/zip_attention.py --capture: [rows, 128] K and V, 16 rows a group, the
    GPU engine bench's bank): which of its blocks stay raw, as stored in ``order`` and coded by format ``version``.
    bool [groups, blocks] for K and V, and the class shares (groups by compressed-block count)."""
    from safetensors import safe_open

    from kvtide.cache import zip_order
    from kvtide.cache import zip_blocks as zb

    with safe_open(path, "pt") as f:
        rows = [f.get_tensor("k_rows"), f.get_tensor("v_rows")]
    d = rows[0].shape[1]
    n = rows[0].shape[0] // PAGE
    idx = zip_order.stored_to_natural(order, PAGE, d)  # [2, PAGE * d]
    out, shares = [], {}
    for kind, name in ((0, "k"), (1, "v")):
        groups = rows[kind][: n * PAGE].reshape(n, PAGE * d)[:, idx[kind]].contiguous()
        desc = zb.analyze(groups.view(torch.int16).reshape(-1, block_size), version).view(n, -1)
        raw = desc == zb.RAW
        out.append(raw)
        counts = torch.bincount((~raw).sum(1), minlength=raw.shape[1] + 1)
        shares[name] = [round(c / n, 4) for c in counts.tolist()]
    return out[0], out[1], {"groups": n, "order": order, "class_shares_by_compressed_blocks": shares}


class KVWriter:
    """K/V of a step's tokens: 1.0 everywhere, and 2^40 in dim 0 of every token of a block picked incompressible:
    at random per block (``p_raw``), or with ``patterns`` as the real-KV group the GPU bench's RealKV writes there
    (bench/zip_engine.py: the same (layer, page, head) key picks the bank group, K at key, V at key + 1), so the
    pool sees the real class mix, correlated blocks included."""

    def __init__(self, heads: int, head_dim: int, block_tokens: int, p_raw: tuple[float, float], p_raw_decode: float,
                 patterns: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.h, self.d, self.bt, self.p_raw, self.p_raw_decode = heads, head_dim, block_tokens, p_raw, p_raw_decode
        self.patterns = patterns

    def __call__(self, layer: int, slots: torch.Tensor, decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        page, blk = slots // PAGE, (slots % PAGE) // self.bt
        key = page[:, None] * 1_000_003 + torch.arange(self.h)[None, :] * 7919 + layer * 104_729  # [T, H]
        out = []
        for kind in (0, 1):
            if self.patterns is not None:  # the bank group RealKV writes at this key (K at key, V at key + 1)
                pat = self.patterns[kind]
                if pat.shape[1] * self.bt != PAGE:
                    raise SystemExit(f"real-KV groups have {pat.shape[1]} blocks, the replay's {PAGE // self.bt}")
                raw = pat[(key + kind) % pat.shape[0], blk[:, None].expand_as(key)]  # [T, H]
            else:
                raw = mix((key + blk[:, None] * 31) * 2 + kind) < (self.p_raw_decode if decode else self.p_raw[kind])
            x = torch.ones(len(slots), self.h, self.d)
            x[..., 0] = torch.where(raw, 2.0**40, 1.0)
            out.append(x.to(torch.bfloat16))
        return out[0], out[1]


TRACED = {  # inclusive host time and calls of these, per step (a method missing in a version is skipped)
    "kvtide.engine.block_manager": ("BlockManager", ["allocate_all", "_make_room"]),
    "kvtide.cache.zip_pages": ("ZipPagedKV", ["free_pages", "alloc_pages", "release_pages", "_finish", "_place",
                                              "_raw_groups", "_analyze", "_pack", "_count_stored"]),
    "kvtide.cache.pool": ("ChunkPool", ["alloc", "free", "new_pages_fit", "_take_chunk", "_return_chunk"]),
}


class Clock:
    """Host seconds per phase of the current step, and of the traced functions inside them (calls counted)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def time(self, name: str, fn, *args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t
            self.spent[f"{name}#calls"] = self.spent.get(f"{name}#calls", 0) + 1

    def trace(self, package: str = "kvtide") -> None:
        """Wrap the TRACED methods of ``package`` (class attributes: every instance, this process only)."""
        import importlib

        for mod, (cls_name, names) in TRACED.items():
            cls = getattr(importlib.import_module(package + mod[len("kvtide"):]), cls_name)
            for name in names:
                fn = getattr(cls, name, None)
                if fn is not None and not getattr(fn, "_traced", False):
                    setattr(cls, name, self._wrap(fn, f"{cls_name}.{name}"))

    def _wrap(self, fn, label: str):
        clock = self

        def traced(*args, **kw):
            return clock.time(label, lambda: fn(*args, **kw))

        traced._traced = True
        return traced

    def take(self) -> dict[str, float]:
        out, self.spent = self.spent, {}
        return out


class FakeEngine:
    """LLMEngine.step without the model: the same calls into scheduler, block manager and store, in the same order."""

    def __init__(self, kv, a) -> None:
        ZipGeometry, ZipPagedKV, SchedulerConfig, BlockManager, self.SamplingParams, Scheduler, self.Sequence, \
            self.Status = kv
        cache_cfg = getattr(sys.modules[ZipPagedKV.__module__.split(".")[0] + ".config"], "CacheConfig")()
        version = a.format_version or getattr(cache_cfg, "format_version", 1)  # the tree's engine default
        self.geo = ZipGeometry(a.layers, a.kv_heads, a.head_dim, PAGE, block_size=a.head_dim * PAGE // 4,
                               format_version=version)
        per_seq = math.ceil((a.context + a.steps) / PAGE)
        budget = int((int(a.budget_seqs * per_seq) + 8) * self.geo.raw_page_bytes * a.budget_scale)
        # the pool's slab ownership (CacheConfig.shared_slabs) where the tree has it: the tree's default unless given
        shared = a.shared_slabs if a.shared_slabs is not None else getattr(cache_cfg, "shared_slabs", None)
        has_slabs = "shared_slabs" in inspect.signature(ZipPagedKV).parameters
        if shared and not has_slabs:
            raise SystemExit("--shared-slabs: this kvtide tree's pool has no shared slabs")
        self.store = ZipPagedKV(self.geo, budget, "cpu", **({"shared_slabs": shared} if has_slabs else {}))
        # the engine's spread of page placement over decode steps (CacheConfig.compress_spread_steps), where the tree
        # has it (compress_finish(max_pages)); --compress-spread-steps 1 places a page step's pages at once
        has_spread = "max_pages" in inspect.signature(self.store.compress_finish).parameters
        self.spread = (a.compress_spread_steps or getattr(cache_cfg, "compress_spread_steps", 1)) if has_spread else 1
        self.bm = BlockManager(0, PAGE, True, self.store)  # positional: the pool's keyword was `store` in older trees
        if hasattr(self.store, "evictor") and hasattr(self.bm, "evict_lru") and not a.no_compress_evictions:
            self.store.evictor = self.bm.evict_lru  # as LLMEngine wires it, where the tree has it
        extra = {}  # trees from before SchedulerConfig.page_lookahead lack the field
        if a.page_lookahead is not None and "page_lookahead" in {f.name for f in dataclasses.fields(SchedulerConfig)}:
            extra["page_lookahead"] = a.page_lookahead
        cfg = SchedulerConfig(max_num_seqs=4096, max_num_batched_tokens=a.step_tokens,
                              max_model_len=a.context + a.steps + PAGE, **extra)
        self.sched = Scheduler(cfg, self.bm)
        patterns, self.real_kv = None, None
        if a.real_kv:  # the GPU run's blocks: its store's value order, 512-value blocks of head_dim 128
            k, v, self.real_kv = real_raw_patterns(a.real_kv, a.real_kv_order, 512, version)
            patterns = (k, v)
        self.writer = KVWriter(a.kv_heads, a.head_dim, self.geo.block_size // a.head_dim, (a.p_raw_k, a.p_raw_v),
                               a.p_raw_decode, patterns)
        self.clock = Clock()
        self.profiler: cProfile.Profile | None = None
        self.ids = 0

    def add(self, prompt: list[int], max_tokens: int) -> None:
        self.ids += 1
        self.sched.add(self.Sequence(f"r{self.ids}", None, prompt, self.SamplingParams(max_tokens=max_tokens)))

    def _timed(self, name: str, fn, *args):
        if self.profiler is not None:
            self.profiler.enable()
        try:
            return self.clock.time(name, fn, *args)
        finally:
            if self.profiler is not None:
                self.profiler.disable()

    def step(self):
        plan = self._timed("schedule", self.sched.schedule)
        if not plan.batch:
            raise RuntimeError("nothing scheduled")
        slots = []
        for seq, n in plan.batch:
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                slots.append(seq.pages[pos // PAGE] * PAGE + pos % PAGE)
        slots_t = torch.tensor(slots, dtype=torch.long)
        rows = self.store.write_rows(slots_t)
        decode_only = all(n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens for seq, n in plan.batch)
        t = time.perf_counter()
        for layer in range(self.geo.num_layers):
            self.store.write(layer, *self.writer(layer, slots_t, decode_only), slots_t, rows)
        self.clock.spent["write"] = time.perf_counter() - t
        filled = [pid for seq, n in plan.batch
                  for pid in seq.pages[seq.num_computed_tokens // PAGE:(seq.num_computed_tokens + n) // PAGE]]
        # as ModelRunner.launch: a decode step places a share of the pages begun earlier (compress_spread_steps)
        spread = getattr(self, "spread", 1)
        share = max(8, -(-len(plan.batch) // spread)) if decode_only and spread > 1 else None
        self._timed("compress_finish", self.store.compress_finish, *(() if share is None else (share,)))
        self._timed("compress_begin", self.store.compress_begin, filled)
        if not decode_only:
            self._timed("compress_finish", self.store.compress_finish)
        for seq, n in plan.batch:
            seq.num_computed_tokens += n
            self.bm.commit(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            seq.output_token_ids.append(1 + (seq.num_tokens * 7919) % 30000)  # a deterministic "sampled" token
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                seq.status = self.Status.FINISHED
                self.sched.finish(seq)
        if not self.sched.has_work():
            self.store.compress_finish()
        return plan, decode_only

    def page_events(self) -> tuple[int, int]:
        return self.store.counters["pages_compressed"], self.store.counters["pages_allocated"]

    def steps(self, batch: int, profile: list | None = None):
        """Step until idle, yielding (kind, host seconds by phase and traced function) of each step where all
        ``batch`` sequences decode, after the first (the bench leaves it untimed); kind "page": it allocated or
        compressed pages, "begin": it staged filled pages (compress_begin), else "plain". ``profile`` gets one
        cProfile per page or begin step (their schedule and compress calls only)."""
        decoded = 0
        while self.sched.has_work():
            ev0 = self.page_events()
            fills = any(len(s.pages) * PAGE <= s.num_computed_tokens + 1 for s in self.sched.running)
            if profile is not None and decoded >= 1 and (getattr(self, "profile_all", False) or self.store._pending
                                                         or fills):
                self.profiler = cProfile.Profile()
            plan, decode_only = self.step()
            prof, self.profiler = self.profiler, None
            spent = self.clock.take()
            if not decode_only or len(plan.batch) != batch:
                continue
            decoded += 1
            kind = "page" if self.page_events() != ev0 else "begin" if self.store._pending else "plain"
            if decoded > 1:
                if prof is not None:
                    profile.append((kind, prof, spent))
                yield kind, spent

    def drain(self, batch: int = -1, record: list | None = None, profile: list | None = None) -> None:
        for row in self.steps(batch, profile):
            if record is not None:
                record.append(row)


def prompt(i: int, context: int) -> list[int]:
    return torch.randint(0, 128000, (context,), generator=torch.Generator().manual_seed(1000 + i)).tolist()


def digest(store) -> str:
    """Hash of where every group is and what the pool holds: equal across versions iff they placed alike."""
    h = hashlib.blake2b(digest_size=16)
    for arr in (store._starts_host, store._class_host, store.state, store.group_desc_all.numpy(),
                store.group_start_all.numpy()):
        h.update(np.ascontiguousarray(arr).tobytes())
    h.update(store.pool.numpy()[::4096].tobytes())  # a sample of the bytes (the whole pool takes seconds to hash)
    h.update(json.dumps(store.counters, sort_keys=True).encode())
    return h.hexdigest()


def _rows(st: pstats.Stats, per: float) -> list[dict]:
    return [{"where": f"{Path(file).name}:{line}:{name}" if line else name, "calls": nc / per, "self_ms": tt * 1e3 / per,
             "cum_ms": ct * 1e3 / per} for (file, line, name), (cc, nc, tt, ct, callers) in st.stats.items()]


def split_profile(profs: list[tuple[str, cProfile.Profile, dict]], slowest: int = 0) -> dict:
    """Per page cycle (a page step and the begin step before it): cProfile's top functions by self and cumulative
    time. Its overhead inflates torch's CPU ops many times over: read it for calls and Python-side shares only.
    ``slowest``: also the top functions of each of the steps whose ``schedule`` took longest, one by one (a rare
    slow step disappears in the sum)."""
    cycles = sum(kind == "page" for kind, _, _ in profs) or 1
    st = pstats.Stats(profs[0][1])
    for _, p, _ in profs[1:]:
        st.add(p)
    rows = _rows(st, cycles)
    out = {"page_cycles": cycles, "total_self_ms": sum(r["self_ms"] for r in rows),
           "top_self": sorted(rows, key=lambda r: -r["self_ms"])[:30],
           "top_cumulative": sorted(rows, key=lambda r: -r["cum_ms"])[:40]}
    if slowest:
        worst = sorted(range(len(profs)), key=lambda i: -profs[i][2].get("schedule", 0.0))[:slowest]
        out["slowest_schedule_steps"] = [
            {"step": i, "kind": profs[i][0], "schedule_ms": profs[i][2].get("schedule", 0.0) * 1e3,
             "top_cumulative": sorted(_rows(pstats.Stats(profs[i][1]), 1), key=lambda r: -r["cum_ms"])[:25]}
            for i in worst]
    return out


def summarise(host: list[tuple[str, dict]]) -> dict:
    """Median and mean host ms of every phase and traced function, per kind of step; calls per step."""
    out = {}
    for kind in ("page", "begin", "plain"):
        rows = [h for k, h in host if k == kind]
        if not rows:
            continue
        keys = sorted({k for h in rows for k in h})
        out[kind] = {"steps": len(rows)}
        for key in keys:
            vals = [h.get(key, 0) for h in rows]
            if key.endswith("#calls"):
                out[kind][key] = statistics.mean(vals)
            else:
                out[kind][f"{key}_ms"] = {"median": statistics.median(vals) * 1e3, "mean": statistics.mean(vals) * 1e3}
        comp = [h.get("compress_finish", 0.0) + h.get("compress_begin", 0.0) for h in rows]
        out[kind]["compress_ms"] = {"median": statistics.median(comp) * 1e3, "mean": statistics.mean(comp) * 1e3}
    if "page" in out:
        out["page_ms_each"] = [{k: round(v * 1e3, 3) for k, v in h.items() if not k.endswith("#calls")}
                               for k, h in host if k == "page"]
    return out


_VIEWS = ("_pool16", "_raw_rows", "group_start", "group_desc")  # views of the store's tensors, rebuilt on load


def save_state(eng: FakeEngine, path: Path) -> None:
    """torch.save of the engine; the store's views are left out (torch.save refuses one storage under two dtypes)."""
    held = {k: eng.store.__dict__.pop(k) for k in _VIEWS if k in eng.store.__dict__}
    try:
        torch.save(eng, path)
    finally:
        eng.store.__dict__.update(held)


def load_state(path: Path, package: str = "kvtide") -> FakeEngine:
    eng = torch.load(path, weights_only=False, **({"pickle_module": _pickle_as(package)} if package != "kvtide" else {}))
    st = eng.store
    st._pool16 = st.pool.view(torch.int16)
    rb = st.geo.raw_group_bytes
    st._raw_rows = st.pool.view(-1, rb) if st.alloc.geo.chunk_bytes % rb == 0 else None
    st.group_start, st.group_desc = list(st.group_start_all.unbind(0)), list(st.group_desc_all.unbind(0))
    return eng


def build_history(eng: FakeEngine, batches: list[int], context: int) -> None:
    """The bench's history up to the last batch's decode: probe of the first batch, each batch warmed and decoded,
    then the last batch warmed (prefixes not cached are prefilled: the pool fills, prefixes are evicted)."""
    t0 = time.perf_counter()
    for i in range(batches[0]):  # the probe: prefixes prefilled (and compressed), one token each
        eng.add(prompt(i, context), 1)
    eng.drain(-1)
    print(f"probe of {batches[0]} prefixes: {time.perf_counter() - t0:.1f} s", flush=True)
    for b in batches[:-1]:
        run_batch(eng, b, context)
    warm(eng, batches[-1], context)


def warm(eng: FakeEngine, b: int, context: int) -> None:
    """timed()'s first half: prefill (and compress) whatever of the b prefixes is not cached."""
    for i in range(b):
        eng.add(prompt(i, context), 1)
    eng.drain(-1)


class GcClock:
    """Collections of the cyclic garbage collector and the seconds they took, per generation, during the timed
    decode. Checked on this CPU (batch 65 from the H200-scale snapshot): one or two young-generation collections
    in 255 steps, ~6 ms in all; with everything before the decode frozen (gc.freeze) the page steps were the same
    (the pool's free-slot lists hold ints, which the collector does not track), so collection is not where page
    steps' host time goes."""

    def __init__(self) -> None:
        self.count, self.seconds, self._t = [0, 0, 0], [0.0, 0.0, 0.0], 0.0

    def __enter__(self) -> "GcClock":
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            g = info["generation"]
            self.count[g] += 1
            self.seconds[g] += time.perf_counter() - self._t

    def summary(self) -> dict:
        return {"collections_by_generation": self.count, "seconds_by_generation": self.seconds,
                "tracked_objects": len(gc.get_objects()), "frozen_objects": gc.get_freeze_count()}


def decode(eng: FakeEngine, b: int, context: int, profile: list | None = None) -> dict:
    """timed()'s second half: the b prefixes decode steps + 2 tokens; host times per kind of step."""
    t0 = time.perf_counter()
    pre0 = eng.sched.num_preemptions
    for i in range(b):
        eng.add(prompt(i, context), eng.decode_steps + 2)
    host: list[tuple[str, dict]] = []
    with GcClock() as gcc:
        eng.drain(b, host, profile)
    out = {"batch": b, "seconds": time.perf_counter() - t0, **summarise(host), "gc": gcc.summary(),
           "preemptions": eng.sched.num_preemptions - pre0}
    print(f"batch {b}: {out['preemptions']} preemptions", flush=True)
    print(f"garbage collector during the decode: {gcc.summary()}", flush=True)
    if profile:
        out["profile"] = split_profile(profile, getattr(eng, "profile_slowest", 0))
    pg = out.get("page", {})
    begin = out.get("begin", {}).get("compress_begin_ms", {}).get("median", float("nan"))
    plain = out.get("plain", {}).get("schedule_ms", {}).get("median", float("nan"))
    # (with SchedulerConfig.page_lookahead, pages are taken in earlier steps than the ones that stage filled pages,
    # so every kind may not occur)
    print(f"batch {b}: {pg.get('steps', 0)} page steps: schedule median {pg['schedule_ms']['median']:.2f} ms (mean "
          f"{pg['schedule_ms']['mean']:.2f}), compress median {pg['compress_ms']['median']:.2f} ms (mean "
          f"{pg['compress_ms']['mean']:.2f}); begin steps' compress_begin median {begin:.2f} ms; plain steps' "
          f"schedule {plain:.3f} ms" if pg else f"batch {b}: no page step", flush=True)
    return out


def ab(new: FakeEngine, old: FakeEngine, b: int, context: int) -> dict:
    """The last batch's decode on two engines in one process, step by step in turn (the first to step alternates):
    host times of the two versions on the same states under the same machine load; the states must stay equal."""
    for eng in (new, old):
        for i in range(b):
            eng.add(prompt(i, context), eng.decode_steps + 2)
    runs = {"new": new.steps(b), "old": old.steps(b)}
    host: dict[str, list] = {"new": [], "old": []}
    for i in itertools.count():
        rows = {name: next(runs[name], None) for name in (("new", "old") if i % 2 == 0 else ("old", "new"))}
        if None in rows.values():
            assert all(r is None for r in rows.values()), "the two versions decoded a different number of steps"
            break
        assert rows["new"][0] == rows["old"][0], "the two versions' steps differ in kind"
        for name, row in rows.items():
            host[name].append(row)
    out = {name: summarise(rows) for name, rows in host.items()}
    out["digest"] = {"new": digest(new.store), "old": digest(old.store)}
    assert out["digest"]["new"] == out["digest"]["old"], "the two versions left different pools"
    pages = [(n["schedule"], o["schedule"], n.get("compress_finish", 0) + n.get("compress_begin", 0),
              o.get("compress_finish", 0) + o.get("compress_begin", 0))
             for (k, n), (_, o) in zip(host["new"], host["old"]) if k == "page"]
    out["page_steps_ms_new_old"] = [[round(x * 1e3, 3) for x in row] for row in pages]
    for label, col in (("schedule", 0), ("compress", 2)):
        new_ms = statistics.median(r[col] for r in pages) * 1e3
        old_ms = statistics.median(r[col + 1] for r in pages) * 1e3
        tot_n, tot_o = sum(r[col] for r in pages) * 1e3, sum(r[col + 1] for r in pages) * 1e3
        out[f"page_{label}_ms"] = {"old_median": old_ms, "new_median": new_ms, "old_sum": tot_o, "new_sum": tot_n}
        print(f"page steps ({len(pages)}), {label}: median {old_ms:.2f} -> {new_ms:.2f} ms, sum over the run "
              f"{tot_o:.1f} -> {tot_n:.1f} ms", flush=True)
    return out


def copy_pool(pool, cls: type):
    """A copy of a ChunkPool's state as an instance of ``cls`` (this tree's class or the old tree's: the old methods
    use a subset of the attributes). Sets are rebuilt, so their order may differ from ``pool``'s, but two copies of
    one pool are alike: the versions replay from the same state."""
    c = object.__new__(cls)
    d = {k: v for k, v in pool.__dict__.items() if not isinstance(v, types.FunctionType)}  # no recording wrappers
    for k, v in d.items():
        if isinstance(v, np.ndarray):
            d[k] = v.copy()
    d["slot_free"] = [f[:] for f in pool.slot_free]
    d["private_free"] = [f[:] for f in pool.private_free]
    d["shared_free"] = pool.shared_free[:]
    d["open"] = [[set(s) for s in per] for per in pool.open]
    c.__dict__.update(d)
    return c


class _Shim:
    """What ZipPagedKV._place touches (pool, counters, geometry), for replaying it on a copied pool."""

    def __init__(self, pool, geo, store_cls: type) -> None:
        self.alloc, self.geo = pool, geo
        self.counters = {"groups_in_place": 0, "in_place_waste_bytes": 0}
        for name in ("_alloc_into", "_in_place"):  # this tree's helpers of _place (the old _place has none)
            if hasattr(store_cls, name):
                setattr(self, name, types.MethodType(getattr(store_cls, name), self))


class BookkeepingReplay:
    """Old and new host bookkeeping of each page step on the same state, no tensors: the ChunkPool calls that
    ``schedule`` makes (capacity checks, the evictions' frees, the new pages' slots) and compress_finish's 32 per-layer
    ``_place`` calls are recorded with a copy of the pool before them, then replayed ``reps`` times on fresh copies by
    the old tree's classes and this tree's, in turn; each pair of replays must give the same offsets and state."""

    POOL_CALLS = ("alloc", "free", "new_pages_fit")

    def __init__(self, eng: FakeEngine, reps: int) -> None:
        import kvtide.cache.zip_pages as new_zp

        old_zp = importlib.import_module(f"{OLD}.cache.zip_pages")
        self.eng, self.reps = eng, reps
        self.impl = {"old": (old_zp.ChunkPool, old_zp.ZipPagedKV), "new": (new_zp.ChunkPool, new_zp.ZipPagedKV)}
        self.rows: list[dict] = []
        self._log: list | None = None
        pool, store = eng.store.alloc, eng.store
        for name in self.POOL_CALLS:  # instance-level: the copies replayed are not recorded
            setattr(pool, name, self._recording(getattr(pool, name), name))
        store._place = self._recording(store._place, "_place")
        for obj, name in ((eng.sched, "schedule"), (store, "compress_finish")):
            setattr(obj, name, self._around(getattr(obj, name), name))

    def _recording(self, fn, name: str):
        def rec(*args):
            if self._log is not None and not self._inner:
                self._log.append((name, [a.copy() if isinstance(a, np.ndarray) else a for a in args]))
            self._inner += 1
            try:
                return fn(*args)
            finally:
                self._inner -= 1

        return rec

    _inner = 0

    _decode = False  # whether the current step only decodes (set when it is scheduled)

    def _around(self, fn, phase: str):
        def call(*args):
            if phase == "schedule":
                sched = self.eng.sched
                self._decode = not sched.waiting and all(s.num_computed_tokens >= s.num_prompt_tokens
                                                         for s in sched.running)
            snap, self._log = copy_pool(self.eng.store.alloc, type(self.eng.store.alloc)), []
            try:
                return fn(*args)
            finally:
                log, self._log = self._log, None
                if any(name in ("alloc", "_place") for name, _ in log):
                    self._replay(phase, snap, log)

        return call

    def _run(self, which: str, snap, log: list) -> tuple[float, list, object]:
        pool_cls, store_cls = self.impl[which]
        pool = copy_pool(snap, pool_cls)
        shim = _Shim(pool, self.eng.store.geo, store_cls)
        out = []
        t = time.perf_counter()
        for name, args in log:
            if name == "_place":
                layer, cls, old, new = args
                new = old.copy()  # _place writes destinations into it; it starts as the sources
                store_cls._place(shim, layer, cls, old, new)
                out.append(new)
            else:
                out.append(getattr(pool, name)(*args))
        dt = time.perf_counter() - t
        return dt, out, (pool, shim.counters)

    def _replay(self, phase: str, snap, log: list) -> None:
        times: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(self.reps):
            got = {}
            for which in (("old", "new") if r % 2 == 0 else ("new", "old")):
                dt, out, state = self._run(which, snap, log)
                times[which].append(dt)
                got[which] = (out, state)
            (o_out, (o_pool, o_cnt)), (n_out, (n_pool, n_cnt)) = got["old"], got["new"]
            assert len(o_out) == len(n_out) and all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
                                                    for a, b in zip(o_out, n_out)), f"{phase}: replays differ"
            assert o_cnt == n_cnt and o_pool.slot_free == n_pool.slot_free and o_pool.open == n_pool.open
        self.rows.append({"phase": phase, "decode": self._decode, "calls": len(log),
                          **{f"{w}_ms": statistics.median(v) * 1e3 for w, v in times.items()}})

    def summary(self) -> dict:
        out = {}
        for phase in ("schedule", "compress_finish"):
            rows = [r for r in self.rows if r["phase"] == phase and r["decode"]]  # page steps (not the warm-up)
            if rows:
                out[phase] = {"page_steps": len(rows), "calls_per_step": statistics.mean(r["calls"] for r in rows),
                              **{f"{w}_ms_median": statistics.median(r[f"{w}_ms"] for r in rows) for w in ("old", "new")},
                              **{f"{w}_ms_sum": sum(r[f"{w}_ms"] for r in rows) for w in ("old", "new")},
                              "each": rows}
                print(f"{phase}: host bookkeeping replayed on the same state, median over {len(rows)} page steps "
                      f"{out[phase]['old_ms_median']:.2f} -> {out[phase]['new_ms_median']:.2f} ms, sum "
                      f"{out[phase]['old_ms_sum']:.1f} -> {out[phase]['new_ms_sum']:.1f} ms", flush=True)
        return out


def run_batch(eng: FakeEngine, b: int, context: int, profile: list | None = None) -> dict:
    warm(eng, b, context)
    return decode(eng, b, context, profile)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kvtide", default=None, help="import kvtide from this tree (before/after comparisons)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=8, help="8: 32-value blocks, 4 per group (as d=128, block 512)")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=255)
    ap.add_argument("--batches", default="48,65", help="the H200 run's: probe of the first, then each in turn")
    ap.add_argument("--budget-seqs", type=float, default=52.0)
    ap.add_argument("--budget-scale", type=float, default=1.0, help="shrink the budget (quick looks only)")
    ap.add_argument("--step-tokens", type=int, default=16384)
    ap.add_argument("--profile-slowest", type=int, default=0,
                    help="cProfile every decode step and report the N with the longest schedule one by one")
    ap.add_argument("--format-version", type=int, default=None, help="ZipFusion format (default: the tree's engine default)")
    ap.add_argument("--compress-spread-steps", type=int, default=None,
                    help="CacheConfig.compress_spread_steps (default: the tree's; 1 places a page step's pages at once)")
    ap.add_argument("--page-lookahead", type=int, default=None,
                    help="SchedulerConfig.page_lookahead (default: the tree's; 0 takes every page in the step that "
                         "needs it, as the engine did before the option)")
    ap.add_argument("--shared-slabs", type=int, choices=(0, 1), default=None,
                    help="pool chunks owned per size class for all layers (1) or per layer and class (0); default: "
                         "the tree's CacheConfig")
    ap.add_argument("--no-compress-evictions", action="store_true",
                    help="compressions short of slots compress in place without evicting cached pages (before)")
    ap.add_argument("--real-kv", default=None,
                    help="take each group's raw blocks from this real-KV capture (bench/zip_attention.py --capture), "
                         "as the GPU bench's --real-kv writes it; the --p-raw-* options are then unused")
    ap.add_argument("--real-kv-order", default="mma", choices=("mma", "token"),
                    help="value order the GPU store keeps (mma: the CUDA kernel's)")
    ap.add_argument("--p-raw-k", type=float, default=0.21, help="share of K blocks made incompressible")
    ap.add_argument("--p-raw-v", type=float, default=0.07, help="share of V blocks made incompressible")
    ap.add_argument("--p-raw-decode", type=float, default=0.05,
                    help="the same for K and V written by decode steps (the bench's random model: Gaussian-like KV, "
                         "~95%% of 512-value blocks compressible)")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the last batch's page and begin steps (a separate run: the profiler inflates "
                         "torch's CPU ops many times over, so time without it)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: with a busy second core, 2 threads made small ops up to 40x slower)")
    ap.add_argument("--no-trace", action="store_true", help="do not time the TRACED functions")
    ap.add_argument("--snapshot", type=Path, help="save the state before the last batch's decode here (torch.save)")
    ap.add_argument("--resume", type=Path, help="load such a state (saved by the same kvtide tree) and only decode")
    ap.add_argument("--ab", metavar="OLD_TREE",
                    help="also load OLD_TREE's kvtide (as kvtide_old) with its state --ab-resume, and decode both in "
                         "turn, step by step (needs --resume; twice the memory)")
    ap.add_argument("--ab-resume", type=Path, help="the state OLD_TREE saved with --snapshot")
    ap.add_argument("--replay", metavar="OLD_TREE",
                    help="at each page step, replay the host bookkeeping (pool calls of schedule, _place of "
                         "compress_finish) with OLD_TREE's classes and this tree's on copies of the same state")
    ap.add_argument("--replay-reps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kv = _import_kvtide(a.kvtide)
    import kvtide

    batches = [int(b) for b in a.batches.split(",")]
    if a.resume:
        t0 = time.perf_counter()
        eng = load_state(a.resume)
        print(f"resumed {a.resume} in {time.perf_counter() - t0:.1f} s", flush=True)
    else:
        eng = FakeEngine(kv, a)
        eng.decode_steps = a.steps
        build_history(eng, batches, a.context)
        if a.snapshot:
            save_state(eng, a.snapshot)
    if not a.no_trace:
        eng.clock.trace()
    if a.replay:
        _import_tree_as(a.replay)
        replay = BookkeepingReplay(eng, a.replay_reps)
        run = decode(eng, batches[-1], a.context)
        run["bookkeeping_replay"] = replay.summary()
        run["note"] = ("the per-phase step timings of this run include copying the pool before every schedule and "
                       "compress_finish call (the replay's recording): read bookkeeping_replay")
    elif a.ab:
        if not (a.resume and a.ab_resume):
            sys.exit("--ab needs --resume (this tree's state) and --ab-resume (OLD_TREE's)")
        _import_tree_as(a.ab)
        old = load_state(a.ab_resume, OLD)
        if not a.no_trace:
            old.clock.trace(OLD)
        run = ab(eng, old, batches[-1], a.context)
    else:
        eng.profile_slowest = a.profile_slowest
        eng.profile_all = a.profile_slowest > 0  # every decode step's schedule, not only page steps'
        run = decode(eng, batches[-1], a.context, [] if (a.profile or a.profile_slowest) else None)
    st = eng.store.stats()
    res = {
        "env": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.processor() or
                platform.machine(), "cpus": torch.get_num_threads(), "python": platform.python_version(),
                "torch": torch.__version__, "kvtide_from": str(Path(kvtide.__file__).parents[1]),
                "load_average": os.getloadavg()},
        "setup": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "geometry": {"layers": eng.geo.num_layers, "kv_heads": eng.geo.num_kv_heads, "head_dim": eng.geo.head_dim,
                     "format_version": eng.geo.format_version, "compress_spread_steps": getattr(eng, "spread", 1),
                     "block_size": eng.geo.block_size, "blocks_per_group": eng.geo.blocks_per_group,
                     "chunk_bytes": eng.store.alloc.geo.chunk_bytes, "num_chunks": eng.store.alloc.geo.num_chunks,
                     "raw_slots_per_chunk": eng.store.alloc.geo.slots_per_chunk(0),
                     "num_page_ids": eng.store.num_page_ids, "pool_bytes": eng.store.pool.numel(),
                     "shared_slabs": getattr(eng.store.alloc.geo, "shared_slabs", False),
                     "real_kv": getattr(eng, "real_kv", None)},
        "note": "CPU, no model: the engine's scheduler, block manager and compressed store driven as the engine does; "
                "bookkeeping at the H200 run's scale (pages, chunks, slots, layers), bytes shrunk (head_dim 8); "
                "synthetic K/V with a chosen share of incompressible blocks. Tensor ops are CPU compute here, "
                "launches on a GPU. Host ms of the last batch's decode by kind of step: page (allocates and finishes "
                "compressing pages), begin (stages the pages that filled), plain.",
        "run": run,
        "kv_stats_end": {**{k: v for k, v in st.items() if isinstance(v, (int, float, bool))},
                         "prefix_evictions": eng.bm.stats["evictions"], "preemptions": eng.sched.num_preemptions},
        "digest": digest(eng.store),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2))
    print(f"end: {json.dumps(res['kv_stats_end'])}\ndigest {res['digest']}; wrote {a.out}", flush=True)


if __name__ == "__main__":
    main()
