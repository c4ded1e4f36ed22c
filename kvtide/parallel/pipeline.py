"""A minimal pipeline-parallel engine: S contiguous layer shards, one process each, greedy generation.

Not the continuous-batching engine: a batch of requests is prefilled (or restored), then decoded together until
each has its tokens. It exists to run CacheFlow's device-wise restoration (CacheFlow §3.1, appendix A.2) on a
real pipeline:

* Forward (prefill, decode): shard 0 embeds, each shard runs its layers over the batch's rows and sends the
  hidden states on; the last shard applies the final norm + LM head, takes the argmax and broadcasts the tokens.
  Rank 0 drives (``generate``), the other ranks follow its commands (``serve``).
* KV: per shard, one contiguous cache per layer (``shard.SlotKV``); a request of a batch owns one slot.
* Store: when a batch finishes, each shard writes every full chunk of its requests (prompt + output) for its own
  layers (one entry per (chunk, layer), the KV store's format) and, shards after the first, the chunk's
  *boundary activation* (its first layer's input hidden states; ``boundary.py``).
* Restoration: a request whose first chunks are in the store is restored instead of prefilled.
  ``devicewise=True``: each shard plans its own layers (``devicewise.plan_shard``: ``planner.plan`` or a
  baseline; shards after the first count the boundary rows they read in the objective), reads the boundary rows
  its first layer replays (every chunk booked on its link at once, checked while the next ones travel), and all
  shards run the executor at once: shard 0 starts at once and learns what it must hand downstream (rows for a
  shard whose boundary activation failed) in the background, the others start when their rows are on the device;
  ``devicewise=False``: one staircase over all layers (rank 0 plans at the shards' aggregate bandwidth) and each
  shard replays from its upstream's rows. Missing or corrupt boundary activations fall back to upstream rows
  (counted); see ``restore/devicewise.py``. Every restoration's ``ShardRecord`` carries a timeline (one host
  clock for all shards), so what ran concurrently can be read off.

``launch(config, driver, *args)`` spawns the processes and returns what ``driver(engine, *args)`` returned on
rank 0. Environment of every process: NCCL_NVLS_ENABLE=0.
"""

from __future__ import annotations

import math
import os
import pickle
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from kvtide.restore.costs import BlockCost, RestoreRequest
from kvtide.restore.devicewise import (
    Route,
    ShardStatus,
    Source,
    boundary_seconds,
    plan_shard,
    resolve_routes,
    shard_ranges,
    split_rows,
    upstream_rows,
)
from kvtide.restore.executor import RestoreExecutor, RestoreJob
from kvtide.restore.methods import METHODS, make_plan
from kvtide.restore.profile import LatencyProfile
from kvtide.store.bandwidth import BandwidthLimitedStore, TokenBucket, gbps
from kvtide.store.base import DTYPES, HEADER_BYTES
from kvtide.store.factory import check_spec, open_tier
from kvtide.store.keys import KeySpace, chunk_keys

from . import comm
from .boundary import boundary_key, iter_boundaries, save_boundary
from .shard import ProfileTap, ShardPort, ShardStoreView, SlotAttention, SlotKV
from .shard_model import load_shard, model_args

META_BYTES_ESTIMATE = 140  # JSON metadata of one store record (key, layer, dtype, shape, ...)
DEFAULT_BANDWIDTH = 2e9  # bytes/s assumed for an unthrottled in-process tier before any load is measured


@dataclass
class PipelineConfig:
    """One pipeline: model, layout, KV and store; every field checked here so a bad one fails before spawning."""

    model: str = "smollm2-135m"
    num_shards: int = 2
    device: str = "cpu"  # cpu | cuda (shard s on cuda:s)
    dtype: str = "auto"  # compute: auto = float32 on CPU, bfloat16 on CUDA
    kv_dtype: str = "bfloat16"
    boundary_dtype: str = "compute"  # stored boundary activations; "compute" keeps replay bit-exact
    chunk_tokens: int = 64
    store: str = "memory"  # per shard: memory (its own tier) | disk:PATH | redis://... (shared)
    memory_bytes: int = 1 << 30
    bandwidth_gbps: float | None = None  # emulated link per shard (each device its own), load path only
    method: str = "cacheflow"  # default plan: cacheflow | recompute | load | cake | layerwise
    devicewise: bool = True  # default restoration layout
    max_batch: int = 4
    max_model_len: int = 2048
    threads: int = 1  # torch threads per shard process on CPU
    seed: int = 0  # random weights
    timeout_s: float = 300.0  # collectives; a dead peer fails the run instead of hanging it
    flash_suffix: bool = True  # CUDA: rows after a prefix attend through FlashAttention (bottom-right causal), not a mask

    def __post_init__(self) -> None:
        if not isinstance(self.num_shards, int) or self.num_shards < 1:
            raise ValueError(f"num_shards must be an int >= 1, got {self.num_shards!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"kv_dtype must be bfloat16, float16 or float32, got {self.kv_dtype!r}")
        if self.boundary_dtype not in ("compute", "bfloat16", "float16", "float32"):
            raise ValueError(f"boundary_dtype must be compute or a float dtype, got {self.boundary_dtype!r}")
        for name in ("chunk_tokens", "max_batch", "max_model_len", "threads", "memory_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.max_model_len < 2 * self.chunk_tokens:
            raise ValueError(f"max_model_len ({self.max_model_len}) must hold two chunks of {self.chunk_tokens}")
        check_spec(self.store)
        if self.bandwidth_gbps is not None and not self.bandwidth_gbps > 0:
            raise ValueError(f"bandwidth_gbps must be > 0 or None, got {self.bandwidth_gbps!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.device == "cpu" else torch.bfloat16
        return DTYPES[self.dtype]


@dataclass
class GenerateOutput:
    """One request's result on rank 0."""

    token_ids: list[int]
    ttft: float  # seconds from the generate call to this request's first token
    latency: float  # to its last token
    cached_tokens: int  # prefix tokens restored from the store (0: plain prefill)


@dataclass
class ShardRecord:
    """One shard's part in one restoration (gathered on rank 0 as ``engine.last_records``)."""

    rank: int
    layers: tuple[int, int]
    method: str
    devicewise: bool
    boundaries: list[list[int]]  # effective, per request, over this shard's layers
    predicted_seconds: float  # this shard's plan objective (device-wise) or the global one (rank 0, sequential)
    planning_seconds: float
    boundary_seconds: float  # loading boundary activations before the run
    boundary_bytes: int
    total_seconds: float  # the executor's run
    recompute_seconds: float
    load_seconds: float
    load_wait_seconds: float  # compute idle, waiting for this shard's loads
    upstream_wait_seconds: float  # compute idle, waiting for upstream rows
    load_bytes: int
    load_failures: int
    kv_fallback_requests: int  # requests the executor re-ran from a failed KV entry
    boundary_fallbacks: int  # requests whose boundary activation was missing or corrupt
    upstream_rows: int  # replay rows received from upstream (fallback or sequential layout)
    poisoned: int  # requests recomputed from scratch (double failure)
    bandwidth: float
    predicted_boundary_seconds: float = 0.0  # the boundary-row load inside ``predicted_seconds`` (device-wise)
    suffix_seconds: float = 0.0  # the executor's suffix layers, not counting waits
    overhead_seconds: float = 0.0  # the executor's total minus its compute-thread work and waits
    # seconds from this shard's ``generate`` start (``t0``, time.perf_counter: CLOCK_MONOTONIC, one clock for every
    # process of the host, so shards line up): restore (entered), planned, boundary (rows on the device), exec
    # (executor starts), exec_end, finish (suffix rows handed on), done (tokens known)
    timeline: dict[str, float] = field(default_factory=dict)
    t0: float = 0.0


@dataclass
class PipelineStats:
    """Counters of one shard over its lifetime."""

    prefills: int = 0
    decode_steps: int = 0
    restorations: int = 0
    restored_requests: int = 0
    boundary_fallbacks: int = 0
    upstream_rows: int = 0
    load_failures: int = 0
    kv_fallbacks: int = 0
    poisoned: int = 0
    chunks_written: int = 0
    boundaries_written: int = 0


class PipelineEngine:
    """The per-process engine of one shard; rank 0 also drives (``generate``, ``call``, ``shutdown``)."""

    def __init__(self, config: PipelineConfig, rank: int) -> None:
        self.config = c = config
        self.rank, self.world = rank, c.num_shards
        self.device = torch.device(f"cuda:{rank}") if c.device == "cuda" else torch.device("cpu")
        self.args = a = model_args(c.model)
        self.layout = shard_ranges(a.num_layers, c.num_shards)
        self.layers = self.layout[rank]
        self.dtype = c.compute_dtype
        self.kv_dtype = DTYPES[c.kv_dtype]
        self.boundary_dtype = self.dtype if c.boundary_dtype == "compute" else DTYPES[c.boundary_dtype]
        self.model, self.tokenizer = load_shard(c.model, self.layers, self.device, self.dtype, seed=c.seed,
                                                max_positions=c.max_model_len)
        self.link = comm.Link(rank, self.world, self.device)
        self.kv = SlotKV(len(self.layers), c.max_batch, c.max_model_len, a.num_kv_heads, a.head_dim, self.kv_dtype,
                         self.device)
        self.attn = SlotAttention(self.kv, self.layers.start, a.head_dim)
        self.attn.lower_right = c.flash_suffix
        # First-layer inputs of every row this shard saw from upstream: what its boundary records are made of.
        self.inputs = (torch.zeros(c.max_batch, c.max_model_len, a.hidden_size, dtype=self.dtype, device=self.device)
                       if rank else None)
        self.known = np.zeros((c.max_batch, c.max_model_len), dtype=bool)
        self.profile = LatencyProfile()  # F(t) per block of this shard, and this shard's link rate
        self.tier = open_tier(c.store, c.memory_bytes)
        self.set_link(c.bandwidth_gbps)
        C = c.chunk_tokens
        self.keyspace = KeySpace(f"{c.model}|{a.num_layers}x{a.hidden_size}x{a.num_kv_heads}x{a.head_dim}", C,
                                 c.kv_dtype)
        itemsize = torch.empty((), dtype=self.kv_dtype).element_size()
        fixed = HEADER_BYTES + META_BYTES_ESTIMATE + 4 * C
        self.bytes_per_token = (fixed + 2 * C * a.num_kv_heads * a.head_dim * itemsize) / C  # s, per block
        b_item = torch.empty((), dtype=self.boundary_dtype).element_size()
        self.boundary_bytes_per_token = (fixed + C * a.hidden_size * b_item) / C  # h
        self.stats = PipelineStats()
        self.last_records: list[ShardRecord] = []
        self.observe_profile = True  # off: runs leave F(t) and the bandwidth estimate alone (benchmark warm-ups)
        self._t0 = 0.0
        # Shard 0 of a device-wise restoration exchanges statuses here while it replays (comm.Link's own group).
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtide-pipe-status")

    # ---- configuration hooks (run on every rank through ``call``) -----------------------------------------
    def set_link(self, gigabits: float | None) -> None:
        """Loads cross an emulated link of ``gigabits`` Gbps (None: the tier's own speed); writes do not.
        The bandwidth estimate starts over."""
        self.config.bandwidth_gbps = gigabits
        self._bucket = None if gigabits is None else TokenBucket(gbps(gigabits))
        self.use_tier(self.tier)
        self.profile.reset_bandwidth()

    def use_tier(self, tier: Any) -> None:
        """Swap the store tier behind the same link (a benchmark replays one workload from several snapshots)."""
        self.tier = tier
        self.store = tier if self._bucket is None else BandwidthLimitedStore(tier, self._bucket)

    def set_observe(self, on: bool) -> None:
        """Whether prefills and restorations feed this shard's latency profile and bandwidth estimate."""
        self.observe_profile = bool(on)

    def bandwidth(self) -> float:
        """Bytes/s this shard's planner assumes: measured loads first, else the emulated link, else a guess."""
        if self.profile.bandwidth is not None:
            return self.profile.bandwidth
        if self.config.bandwidth_gbps is not None:
            return gbps(self.config.bandwidth_gbps)
        return DEFAULT_BANDWIDTH

    def cost(self, num_blocks: int | None = None) -> BlockCost:
        return BlockCost(num_blocks or len(self.layers), self.bytes_per_token, 0.0, replay_time=self.profile)

    # ---- driver side (rank 0) ---------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int | Sequence[int] = 1, *, restore: bool = True,
                 method: str | None = None, devicewise: bool | None = None, save: bool = True) -> list[GenerateOutput]:
        """Greedy generation for a batch; prefixes found in the store are restored (``restore``), finished
        requests' chunks written (``save``). Rank 0 only."""
        if self.rank != 0:
            raise RuntimeError("generate is called on rank 0; the other ranks serve")
        prompts = [list(map(int, p)) for p in prompts]
        mt = [int(max_tokens)] * len(prompts) if isinstance(max_tokens, int) else [int(x) for x in max_tokens]
        method = method or self.config.method
        devicewise = self.config.devicewise if devicewise is None else bool(devicewise)
        self._check_batch(prompts, mt, method)
        kw = dict(prompts=prompts, max_tokens=mt, restore=restore, method=method, devicewise=devicewise, save=save)
        self.link.broadcast_obj(("generate", kw))
        return self._generate(**kw)  # type: ignore[arg-type]

    def call(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(engine, *args)`` on every rank (a picklable, importable function); results by rank."""
        if self.rank != 0:
            raise RuntimeError("call is made on rank 0")
        self.link.broadcast_obj(("call", fn, args))
        return self._call(fn, args)  # type: ignore[return-value]

    def shutdown(self) -> None:
        if self.rank == 0:
            self.link.broadcast_obj(("stop",))

    # ---- follower side ----------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Ranks > 0: follow rank 0's commands until it stops."""
        while True:
            cmd = self.link.broadcast_obj(None)
            if cmd[0] == "stop":
                return
            if cmd[0] == "generate":
                self._generate(**cmd[1])
            elif cmd[0] == "call":
                self._call(cmd[1], cmd[2])
            else:
                raise RuntimeError(f"unknown pipeline command {cmd[0]!r}")

    def _call(self, fn: Callable[..., Any], args: tuple) -> list[Any] | None:
        return self.link.gather_obj(fn(self, *args))

    # ---- one batch ------------------------------------------------------------------------------------------------
    def _check_batch(self, prompts: list[list[int]], mt: list[int], method: str) -> None:
        c = self.config
        if not prompts or len(prompts) > c.max_batch:
            raise ValueError(f"a batch holds 1..{c.max_batch} requests, got {len(prompts)}")
        if len(mt) != len(prompts) or min(mt) < 1:
            raise ValueError("need max_tokens >= 1 for every request")
        for p, m in zip(prompts, mt):
            if not p or len(p) + m > c.max_model_len:
                raise ValueError(f"prompt of {len(p)} tokens + {m} new exceeds max_model_len {c.max_model_len}")
            if min(p) < 0 or max(p) >= self.args.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.args.vocab_size})")
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")

    def _generate(self, prompts: list[list[int]], max_tokens: list[int], restore: bool, method: str,
                  devicewise: bool, save: bool) -> list[GenerateOutput] | None:
        t0 = self._t0 = time.perf_counter()
        R = len(prompts)
        self.known[:R] = False
        cached = [self._lookup(p) if restore else 0 for p in prompts]
        cached = self.link.all_reduce_ints(cached, "min")
        out: list[list[int]] = [[] for _ in range(R)]
        first_at = [0.0] * R
        plain = [r for r in range(R) if cached[r] == 0]
        rest = [r for r in range(R) if cached[r] > 0]
        records: list[ShardRecord] | None = None

        def take(rows: list[int], toks: list[int], stamps: list[float]) -> None:
            now = time.perf_counter()
            for r, t in zip(rows, toks):
                out[r].append(t)
                stamps[r] = now

        if plain:
            take(plain, self._forward([(r, 0, len(prompts[r])) for r in plain], [prompts[r] for r in plain]),
                 first_at)
            self.stats.prefills += 1
        if rest:
            toks, rec = self._restore(rest, prompts, cached, method, devicewise)
            take(rest, toks, first_at)
            records = self.link.gather_obj(rec)
        last_at = list(first_at)
        while True:
            act = [r for r in range(R) if len(out[r]) < max_tokens[r]]
            if not act:
                break
            segs = [(r, len(prompts[r]) + len(out[r]) - 1, len(prompts[r]) + len(out[r])) for r in act]
            take(act, self._forward(segs, [[out[r][-1]] for r in act]), last_at)
            self.stats.decode_steps += 1
        if save:
            self._save([prompts[r] + out[r][:-1] for r in range(R)])
        self.link.flush()
        if self.rank != 0:
            return None
        self.last_records = records or []
        return [GenerateOutput(out[r], first_at[r] - t0, last_at[r] - t0, cached[r]) for r in range(R)]

    # ---- forward through the pipeline ---------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _forward(self, segs: list[tuple[int, int, int]], ids: list[list[int]]) -> list[int]:
        """Rows [start, end) of each slot through every shard; returns the greedy token of each segment's last row."""
        n = sum(e - a for _, a, e in segs)
        if self.link.first:
            h = self.model.model.embed_tokens(torch.tensor([t for x in ids for t in x], device=self.device))
        else:
            h = self.link.recv_prev(n, self.args.hidden_size, self.dtype, comm.TAG_FORWARD)
            o = 0
            for slot, a, e in segs:
                self._record_input(slot, a, h[o:o + e - a])
                o += e - a
        # F(t) from prefills the engine runs anyway
        observe = self.observe_profile and len(segs) == 1 and segs[0][1] == 0 and n > 1
        if observe:
            self._sync()  # the activations have arrived: time this shard's layers only
        t = time.perf_counter()
        self.attn.plan(segs)
        pos = torch.cat([torch.arange(a, e, device=self.device) for _, a, e in segs])
        h = self.model.hidden_states(None, pos, self.attn, layers=self.layers, h=h)  # type: ignore[arg-type]
        if observe:
            self._sync()
            self.profile.observe(n, time.perf_counter() - t, blocks=len(self.layers), source="prefill")
        tokens: list[int] | None = None
        if self.link.last:
            ends = torch.tensor(np.cumsum([e - a for _, a, e in segs]) - 1, device=self.device)
            tokens = self.model.logits(h.index_select(0, ends)).argmax(-1).tolist()
        else:
            self.link.send_next(h, comm.TAG_FORWARD)
        toks = self.link.broadcast_tokens(tokens, len(segs))
        self.link.flush()
        return toks

    def _record_input(self, slot: int, start: int, rows: torch.Tensor) -> None:
        if self.inputs is not None:
            self.inputs[slot, start:start + rows.shape[0]] = rows
            self.known[slot, start:start + rows.shape[0]] = True

    # ---- store: lookup and writes ----------------------------------------------------------------------------------
    def _lookup(self, tokens: list[int]) -> int:
        """Leading prefix tokens whose chunks this shard holds for all its layers (one token always left)."""
        C = self.config.chunk_tokens
        n = 0
        for key in chunk_keys(tokens[:(len(tokens) - 1) // C * C], self.keyspace):
            if not self.tier.contains(key, self.layers.stop - 1):  # layers are written in order
                break
            n += C
        return n

    def _save(self, seqs: list[list[int]]) -> None:
        """Every full chunk of each request's computed tokens: this shard's KV, and its boundary activation."""
        C, lo = self.config.chunk_tokens, self.layers.start
        for slot, ids in enumerate(seqs):
            n = len(ids) // C * C
            for key in chunk_keys(ids[:n], self.keyspace):
                a, b = key.index * C, (key.index + 1) * C
                toks = ids[a:b]
                wrote = False
                for li, g in enumerate(self.layers):
                    if not self.tier.contains(key, g):
                        self.tier.put(key, g, toks, self.kv.read(li, slot, a, b))
                        wrote = True
                self.stats.chunks_written += wrote
                if (self.inputs is not None and self.known[slot, a:b].all()
                        and not self.tier.contains(boundary_key(key, lo), lo)):
                    save_boundary(self.tier, key, lo, toks, self.inputs[slot, a:b].to(self.boundary_dtype))
                    self.stats.boundaries_written += 1

    def _load_boundaries(self, jobs: Sequence[RestoreJob], rows: Sequence[int],
                         have: Sequence[torch.Tensor | None]) -> tuple[list[torch.Tensor | None], int]:
        """Boundary rows [0, rows[i]) of every request on this device, continuing from ``have[i]``; None for a
        request any of whose chunks failed. Every chunk of every request is booked on the link at once
        (``iter_boundaries``) and placed as its batch arrives. Returns the tensors and the bytes read."""
        C, lo, H = self.config.chunk_tokens, self.layers.start, self.args.hidden_size
        out: list[torch.Tensor | None] = list(have)
        items, where = [], []
        for i, (job, want) in enumerate(zip(jobs, rows)):
            got = 0 if have[i] is None else have[i].shape[0]
            n = math.ceil(want / C)
            if n * C <= got:
                continue
            if n > len(job.keys):
                out[i] = None
                continue
            dst = torch.empty(n * C, H, dtype=self.dtype, device=self.device)
            if got:
                dst[:got].copy_(have[i])
            out[i] = dst
            for c in range(got // C, n):
                items.append((job.keys[c], job.token_ids[c * C:(c + 1) * C]))
                where.append((i, c))
        bad: set[int] = set()
        nbytes = 0
        for k, h, nb in iter_boundaries(self.store, items, lo, H, self.boundary_dtype, pool=_verify_pool(self.device)):
            nbytes += nb
            i, c = where[k]
            if isinstance(h, BaseException):
                bad.add(i)
            elif i not in bad:
                out[i][c * C:(c + 1) * C].copy_(h)  # type: ignore[index]
        for i in bad:
            out[i] = None
        return out, nbytes

    # ---- restoration ------------------------------------------------------------------------------------------------
    def _plan(self, method: str, reqs: list[RestoreRequest], devicewise: bool) -> tuple[list[list[int]], float, float]:
        """This shard's rows per request, the plan's objective and its boundary-load part."""
        C = self.config.chunk_tokens
        if devicewise:  # own layers, own profile and link; shards after the first also read boundary rows
            h = self.boundary_bytes_per_token if self.rank > 0 else 0.0
            plan = plan_shard(method, reqs, self.cost(), self.bandwidth(), C, h)
            return plan.boundaries, plan.predicted_seconds, boundary_seconds(plan.boundaries, h, self.bandwidth())
        # one staircase over all layers, at the links' aggregate rate; rank 0 plans so all agree
        full, predicted = None, 0.0
        if self.rank == 0:
            plan = make_plan(method, reqs, self.cost(self.args.num_layers), self.world * self.bandwidth(), C)
            full, predicted = plan.boundaries, plan.predicted_seconds
        full = self.link.broadcast_obj(full)
        return split_rows(full, self.layout)[self.rank], predicted, 0.0

    @torch.inference_mode()
    def _restore(self, rest: list[int], prompts: list[list[int]], cached: list[int], method: str,
                 devicewise: bool) -> tuple[list[int], ShardRecord]:
        C = self.config.chunk_tokens
        stamps = {"restore": time.perf_counter()}
        jobs = [RestoreJob(prompts[r], 0, cached[r], len(prompts[r]), chunk_keys(prompts[r][:cached[r]], self.keyspace),
                           []) for r in rest]
        reqs = [RestoreRequest(j.cached, j.total - j.cached) for j in jobs]
        rows, predicted, predicted_b = self._plan(method, reqs, devicewise)
        stamps["planned"] = time.perf_counter()
        planning = stamps["planned"] - stamps["restore"]

        # Boundary activations first (device-wise, shards after the first): the rows each first layer replays.
        bnd: list[torch.Tensor | None] = [None] * len(jobs)
        b_bytes = 0
        if devicewise and self.rank > 0:
            bnd, b_bytes = self._load_boundaries(jobs, [row[0] for row in rows], bnd)
            self._sync()  # the rows are on the device: what the timeline reports
        stamps["boundary"] = time.perf_counter()
        b_seconds = stamps["boundary"] - stamps["planned"]
        ok = [bool(row[0] == 0 or b is not None) for row, b in zip(rows, bnd)] if devicewise and self.rank else \
            [True] * len(jobs)
        status = [ShardStatus(row[0], row[-1], o) for row, o in zip(rows, ok)]
        if devicewise and self.rank == 0 and self.world > 1:
            # Shard 0 replays from the embeddings whatever the others report: it starts now and learns what to hand
            # downstream (rows for a shard whose boundary activation failed) only when its last layer needs it,
            # instead of idling while the other shards read their boundary rows.
            gathered = self._background.submit(self.link.all_gather_obj, status)
            mine = [Route(Source.EMBED, None, st.first, st.last, False) for st in status]
        else:
            gathered = None
            routes = resolve_routes(self.link.all_gather_obj(status), devicewise)
            mine = routes[self.rank]
        all_routes = (lambda: resolve_routes(gathered.result(), devicewise)) if gathered else (lambda: routes)
        for job, rt, row in zip(jobs, mine, rows):
            job.boundaries = rt.apply(row)

        def extend(i: int, want: int) -> torch.Tensor | None:  # the executor's own fallback wants later rows
            nonlocal b_bytes
            got, nb = self._load_boundaries([jobs[i]], [want], [bnd[i]])
            b_bytes += nb
            return got[0]

        port = ShardPort(model=self.model, kv=self.kv, attention=self.attn, layers=self.layers, link=self.link,
                         jobs=jobs, slots=rest, routes=mine, send_rows=lambda: upstream_rows(all_routes(), self.rank),
                         boundary=bnd, extend_boundary=extend, record_input=self._record_input)
        waits = any(rt.source is Source.UPSTREAM and rt.first > 0 for rt in mine)
        stamps["exec"] = time.perf_counter()
        res = RestoreExecutor(port, ShardStoreView(self.store, self.layers.start), C).run(
            jobs, profile=ProfileTap(self.profile, waits) if self.observe_profile else None)
        stamps["exec_end"] = time.perf_counter()
        port.finish()
        all_routes()  # the background exchange is over before the next collective
        stamps["finish"] = time.perf_counter()
        poisoned = self.link.all_reduce_ints([int(i in port.poisoned) for i in range(len(jobs))], "max")
        tokens = res.logits.argmax(-1).tolist() if self.link.last else None
        bad = [i for i, p in enumerate(poisoned) if p]
        if bad:  # no usable input for some rows anywhere: recompute those requests from scratch
            redo = self._forward([(rest[i], 0, jobs[i].total) for i in bad], [jobs[i].token_ids for i in bad])
            if tokens is not None:
                for i, tok in zip(bad, redo):
                    tokens[i] = tok
        tokens = self.link.broadcast_tokens(tokens, len(jobs))
        self.link.flush()
        stamps["done"] = time.perf_counter()
        fb = sum(rt.fallback for rt in mine)
        st = self.stats
        st.restorations += 1
        st.restored_requests += len(jobs)
        st.boundary_fallbacks += fb
        st.upstream_rows += port.upstream_rows
        st.load_failures += len(res.failures)
        st.kv_fallbacks += len(res.fallback_requests)
        st.poisoned += len(bad)
        rec = ShardRecord(
            rank=self.rank, layers=(self.layers.start, self.layers.stop), method=method, devicewise=devicewise,
            boundaries=[list(j.boundaries) for j in jobs], predicted_seconds=predicted, planning_seconds=planning,
            boundary_seconds=b_seconds, boundary_bytes=b_bytes, total_seconds=res.total_seconds,
            recompute_seconds=res.recompute_seconds, load_seconds=res.load_seconds, load_wait_seconds=res.wait_seconds,
            upstream_wait_seconds=port.wait_seconds, load_bytes=res.load_bytes, load_failures=len(res.failures),
            kv_fallback_requests=len(res.fallback_requests), boundary_fallbacks=fb, upstream_rows=port.upstream_rows,
            poisoned=len(bad), bandwidth=self.bandwidth(), predicted_boundary_seconds=predicted_b,
            suffix_seconds=float(getattr(res, "suffix_seconds", 0.0)),
            overhead_seconds=float(getattr(res, "overhead_seconds", 0.0)),
            timeline={k: v - self._t0 for k, v in stamps.items()}, t0=self._t0)
        return tokens, rec


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOL_LOCK = threading.Lock()


def _verify_pool(device: torch.device) -> ThreadPoolExecutor | None:
    """Threads that verify boundary records in parallel (XXH3 and tensor copies release the GIL): on CUDA
    min(8, cores // 2) as the executor's loads; none on a CPU device, whose other core runs the compute."""
    if device.type != "cuda":
        return None
    n = max(1, min(8, (os.cpu_count() or 2) // 2))
    with _POOL_LOCK:
        if n not in _POOLS:
            _POOLS[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="kvtide-boundary-verify")
        return _POOLS[n]


# ---- processes ------------------------------------------------------------------------------------------------------


def launch(config: PipelineConfig, driver: Callable[..., Any], *args: Any) -> Any:
    """Start one process per shard; rank 0 runs ``driver(engine, *args)``; returns its result.

    ``driver`` must be importable (a module-level function). On CUDA, fewer visible GPUs than shards is an
    error here, before anything starts.
    """
    if config.device == "cuda" and torch.cuda.device_count() < config.num_shards:
        raise RuntimeError(f"{config.num_shards} shards need {config.num_shards} GPUs, "
                           f"{torch.cuda.device_count()} visible")
    os.environ.update(comm.NCCL_ENV)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="kvtide-pipe-") as d:
        out = Path(d) / "result.pkl"
        mp.spawn(_worker, args=(config, comm.free_port(), driver, args, str(out)), nprocs=config.num_shards, join=True)
        return pickle.loads(out.read_bytes())


def _worker(rank: int, config: PipelineConfig, port: int, driver: Callable[..., Any], args: tuple, out: str) -> None:
    os.environ.update(comm.NCCL_ENV)
    if config.device == "cpu":
        torch.set_num_threads(config.threads)
    device = torch.device(f"cuda:{rank}") if config.device == "cuda" else torch.device("cpu")
    comm.init(rank, config.num_shards, port, device, config.timeout_s)
    eng = PipelineEngine(config, rank)
    if rank == 0:
        result = driver(eng, *args)  # an exception here ends the run: mp.spawn stops the other ranks
        eng.shutdown()
        Path(out).write_bytes(pickle.dumps(result))
    else:
        eng.serve()
    dist.destroy_process_group()
