"""The connector in vLLM's worker: loads into the paged KV, saves out of it, the load errors and measurements.

Per step (vLLM's order): ``begin`` when the metadata is bound, ``start_loads`` before the forward pass (the loader
thread works layer by layer, ``loader.LoadJob``), ``wait_layer`` from each attention layer, ``save_layer`` after it
(the chunks to save are copied out of the blocks at once, so vLLM may free or reuse them when the step ends), and
``end`` when vLLM waits for saves: the loads are finished or cancelled, and the copied chunks go to the store's
background writer (``StoreWriter``: encoding, checksums and I/O off the step) unless their request's load failed
in this step (then its computed KV came from a forward pass vLLM throws away). ``take_invalid`` hands vLLM the
blocks to recompute, ``take_report`` the measurements (compute time of each step, load jobs) and the
chunks not to take as stored.
"""
from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

import torch

from kvtide.log import get_logger, warn_limited
from kvtide.store.keys import ChunkKey
from kvtide.store.record import record_bytes_bound
from kvtide.store.writer import StoreWriter
from kvtide.integrations.vllm.config import ConnectorConfig
from kvtide.integrations.vllm.layout import PagedLayout, Placement, get_layout
from kvtide.integrations.vllm.loader import LoadJob
from kvtide.integrations.vllm.plan import SaveSpec, StepPlan, WorkerReport
from kvtide.integrations.vllm.stats import Counters
from kvtide.integrations.vllm.stores import ZipWrites

log = get_logger("integrations.vllm")


def layer_order(names: list[str]) -> list[str]:
    """Layer names in model order (by the numbers in the name: ``model.layers.10.self_attn.attn`` after 9)."""
    return sorted(names, key=lambda n: ([int(x) for x in re.findall(r"\d+", n)], n))


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, store: Any, counters: Counters, *, num_layers: int, num_kv_heads: int,
                 head_dim: int, block_size: int, kv_dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.store = store
        self.counters = counters
        self.num_layers = num_layers
        self.block_size = block_size
        self.head_dim = head_dim
        self.kv_dtype = kv_dtype
        self.chunk = cfg.restore.chunk_tokens
        self.shape = (2, self.chunk, num_kv_heads, head_dim)
        self.num_kv_heads = num_kv_heads
        self.max_bytes = record_bytes_bound(self.shape, kv_dtype, self.chunk)
        self.layout: PagedLayout | None = None
        self.caches: list[torch.Tensor] = []
        self.layer_of: dict[str, int] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtide-vllm-load")
        self._lock = threading.Lock()
        self._report = WorkerReport()
        self._invalid: set[int] = set()
        self.plan: StepPlan | None = None
        self.job: LoadJob | None = None
        self._t0 = 0.0
        self._waited = 0.0
        self._copies: list[list[list[torch.Tensor | None]]] = []  # [save spec][chunk][layer]
        self._targets: list[list[Placement]] = []
        self._bytes_seen = 0
        self.writer: StoreWriter | None = None
        if cfg.save:
            writes = ZipWrites(store) if cfg.restore.store_codec == "zip" else store
            self.writer = StoreWriter(writes, max_bytes=cfg.restore.write_queue_bytes,
                                      flush_timeout=cfg.restore.flush_timeout_s, on_chunk=self._written)

    # ---- setup --------------------------------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, torch.Tensor], layout: str) -> None:
        """vLLM's per-layer KV tensors; ``layout``: ``cpu`` or ``gpu`` (``layout.py``)."""
        names = layer_order(list(kv_caches))
        if len(names) != self.num_layers:
            raise ValueError(f"kvtide connector: vLLM registered {len(names)} KV layers, the model has "
                             f"{self.num_layers}")
        self.layout = get_layout(layout)
        for name in names:
            self.layout.check(kv_caches[name], self.num_kv_heads, self.head_dim, self.block_size)
            if kv_caches[name].dtype != self.kv_dtype:
                raise ValueError(f"kvtide connector: layer {name} holds {kv_caches[name].dtype} KV, expected "
                                 f"{self.kv_dtype}")
        self.layer_of = {n: i for i, n in enumerate(names)}
        self.caches = [kv_caches[n] for n in names]

    # ---- one step -----------------------------------------------------------------------------------------
    def begin(self, plan: StepPlan) -> None:
        if self.plan is not None:  # the last step never reached end() (an error in vLLM's step)
            self.end()
        self.plan = plan
        self._t0 = time.perf_counter()
        self._waited = 0.0
        if plan.counts:
            self.counters.add(**plan.counts)
        self._copies = [[[None] * self.num_layers for _ in s.chunks] for s in plan.saves]
        dev = self.caches[0].device if self.caches else torch.device("cpu")
        self._targets = [[Placement(ch.index * self.chunk, (ch.index + 1) * self.chunk, s.block_ids, self.block_size,
                                    dev) for ch in s.chunks] for s in plan.saves]

    def start_loads(self) -> None:
        plan = self.plan
        if plan is None or not plan.loads or self.job is not None:
            return
        if not self.caches:
            warn_limited(log, "no-caches", "kvtide connector: loads planned before vLLM registered its KV caches")
            return
        self.job = LoadJob(plan.loads, self.store, self.caches, self.layout, self.block_size, self.chunk,
                           self.shape, self.kv_dtype, self.max_bytes, self.cfg.load_timeout_s)
        self.counters.add(load_requests=len(plan.loads))
        self._pool.submit(self.job.run)

    def wait_layer(self, name: str) -> None:
        job = self.job
        if job is not None and name in self.layer_of:
            self._waited += job.wait(self.layer_of[name])

    def save_layer(self, name: str, kv_layer: torch.Tensor) -> None:
        plan = self.plan
        if plan is None or not plan.saves or self.layout is None or name not in self.layer_of:
            return
        i = self.layer_of[name]
        for s, spec in enumerate(plan.saves):
            for c, where in enumerate(self._targets[s]):
                x = where.gather(self.layout, kv_layer, self.head_dim)  # a copy: the blocks may be reused
                self._copies[s][c][i] = x if x.device.type == "cpu" else x.to("cpu")

    def end(self) -> None:
        plan, job = self.plan, self.job
        self.plan = self.job = None
        if plan is None:
            return
        failed: set[str] = set()
        invalid: set[int] = set()
        # the forward pass's own time: the step less what it waited for loads. Steps beside loads count too: they
        # are the ones that compute after a cached prefix, and a split's recompute runs beside loads as they did
        seconds = time.perf_counter() - self._t0 - self._waited
        if job is not None:
            job.finish()
            failed = set(job.failed_from)
            invalid = job.invalid_blocks()
            self._account(job, invalid)
        if any(n for _, n in plan.parts) and not failed:
            with self._lock:
                self._report.steps.append((list(plan.parts), seconds))
        for spec, copies in zip(plan.saves, self._copies):
            # a request whose load failed, or that read a failed request's blocks (a shared prefix), computed this
            # step over KV that was not placed: vLLM throws that step away, and so does the store
            self._submit(spec, copies, spec.req_id in failed or not invalid.isdisjoint(spec.block_ids))
        self._copies, self._targets = [], []

    def _account(self, job: LoadJob, invalid: set[int]) -> None:
        errors = sum(job.causes.values())
        self.counters.add(loaded_chunks=job.loaded_entries, loaded_bytes=job.loaded_bytes, load_seconds=job.seconds,
                          loaded_tokens=job.loaded_tokens(), load_errors=errors,
                          load_failed_requests=len(job.failed_from), invalid_blocks=len(invalid), **job.causes)
        with self._lock:
            self._invalid |= invalid
            if job.loaded_entries and not job.cancelled:
                self._report.loads.append((job.loaded_token_layers, job.loaded_bytes, job.seconds))
            for s in job.specs:
                j = job.failed_from.get(s.req_id)
                if j is not None:
                    self._report.failed.extend(ch.key for ch in s.chunks[j:])

    def _submit(self, spec: SaveSpec, copies: list[list[torch.Tensor | None]], tainted: bool) -> None:
        for ch, layers in zip(spec.chunks, copies):
            whole = all(x is not None for x in layers)
            if self.writer is None or tainted or not whole:
                self.counters.add(saves_skipped=1)
                with self._lock:
                    self._report.unsaved.append(ch.key)
                continue
            self.writer.submit(ChunkKey(ch.key, ch.index), list(ch.tokens), layers)  # type: ignore[arg-type]

    def _written(self, key: ChunkKey, written: bool) -> None:
        """The writer's report (its thread)."""
        if written:
            self.counters.add(saved_chunks=1)
        else:
            self.counters.add(save_failures=1)
            with self._lock:
                self._report.unsaved.append(key.hex)

    # ---- what vLLM collects after a step --------------------------------------------------------------------
    def take_invalid(self) -> set[int]:
        with self._lock:
            out, self._invalid = self._invalid, set()
        return out

    def take_report(self) -> WorkerReport | None:
        if self.writer is not None:
            written = self.writer.stats.bytes
            if written > self._bytes_seen:
                self.counters.add(saved_bytes=written - self._bytes_seen)
                self._bytes_seen = written
        with self._lock:
            out, self._report = self._report, WorkerReport()
        return None if out.empty() else out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is written (at most ``timeout`` seconds)."""
        return self.writer.flush(timeout) if self.writer is not None else True

    def close(self) -> None:
        if self.plan is not None:
            self.end()
        if self.writer is not None:
            self.writer.close()
        self._pool.shutdown(wait=False)
