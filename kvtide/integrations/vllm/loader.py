"""One step's loads, layer by layer on a loader thread, so they overlap vLLM's forward pass.

For layer i the job fetches every planned chunk entry of layer i in one round trip (Redis MGET, a batch of file
reads), waits for the emulated link if there is one, verifies each record (checksum or MAC, token ids, dtype,
shape) and places the tokens it was asked for in vLLM's blocks; then layer i is ready, and vLLM's attention for
layer i (``wait_for_layer_load``) may run while layer i + 1 loads.

Failures never place data: an entry that is missing, damaged, forged, of other tokens or of a tier that does not
answer marks its chunk and every later chunk of that request as failed (vLLM keeps only a prefix of computed
tokens), and later layers do not fetch them. A layer not ready by the job's deadline is late: the job is
cancelled (its thread checks under a lock before every write, so nothing lands after the cancel) and every chunk
of the step is failed. ``invalid_blocks`` then names the blocks vLLM must recompute.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Sequence

import torch

from kvtide.log import get_logger, warn_limited
from kvtide.store.errors import (
    ChunkCorrupt,
    ChunkForged,
    ChunkMissing,
    ChunkOversize,
    ChunkTruncated,
    StoreError,
    StoreUnavailable,
    TokenMismatch,
)
from kvtide.store.keys import ChunkKey
from kvtide.store.zip_entry import ZipEntry
from kvtide.integrations.vllm.layout import PagedLayout, Placement
from kvtide.integrations.vllm.plan import LoadSpec

log = get_logger("integrations.vllm")

_CAUSES: tuple[tuple[type, str], ...] = (
    (ChunkMissing, "load_missing"), (TokenMismatch, "load_token_mismatch"), (ChunkTruncated, "load_truncated"),
    (ChunkForged, "load_forged"), (ChunkOversize, "load_oversize"), (ChunkCorrupt, "load_corrupt"),
    (StoreUnavailable, "load_unavailable"),
)


def cause(e: StoreError) -> str:
    """The counter of a load failure."""
    for cls, name in _CAUSES:
        if isinstance(e, cls):
            return name
    return "load_corrupt"


class LoadJob:
    """The loads of one step. ``caches[i]``: layer i's KV tensor; ``shape``: an entry's [2, chunk, heads, dim]."""

    def __init__(self, specs: Sequence[LoadSpec], store: Any, caches: Sequence[torch.Tensor], layout: PagedLayout,
                 block_size: int, chunk: int, shape: tuple[int, ...], dtype: torch.dtype, max_bytes: int,
                 timeout_s: float) -> None:
        self.specs = list(specs)
        self.store = store
        self.caches = caches
        self.layout = layout
        self.block_size = block_size
        self.chunk = chunk
        self.shape = tuple(shape)
        self.dtype = dtype
        self.max_bytes = max_bytes
        self.deadline = time.monotonic() + timeout_s
        self.ready = [threading.Event() for _ in caches]
        self.done = threading.Event()
        self._lock = threading.Lock()
        self.cancelled = False
        self.failed_from: dict[str, int] = {}  # req_id -> position in its spec's chunks from which it failed
        self.causes: dict[str, int] = {}
        self.loaded_entries = 0
        self.loaded_bytes = 0
        self.loaded_token_layers = 0  # tokens placed, summed over layers (the load rate's unit)
        self.seconds = 0.0
        # where each chunk's requested tokens go: (their positions in the chunk's entry, their places) per chunk
        self._targets = [[self._target(s, ch.index) for ch in s.chunks] for s in self.specs]

    def _target(self, spec: LoadSpec, index: int) -> tuple[slice, Placement]:
        lo, hi = max(spec.start, index * self.chunk), min(spec.end, (index + 1) * self.chunk)
        where = Placement(lo, hi, spec.block_ids, self.block_size, self.caches[0].device)
        return slice(lo - index * self.chunk, hi - index * self.chunk), where

    # ---- the loader thread ----------------------------------------------------------------------------------
    def run(self) -> None:
        t0 = time.perf_counter()
        try:
            cuda = self.caches[0].device.type == "cuda"
            for layer in range(len(self.caches)):
                if self.cancelled:
                    break
                self._layer(layer)
                if cuda:  # the copies run on this thread's stream: in place before vLLM's attention reads them
                    torch.cuda.current_stream(self.caches[layer].device).synchronize()
                self.ready[layer].set()
        except Exception as e:  # noqa: BLE001 - a loader bug fails the step's loads, never the engine
            log.exception("kvtide connector: load job failed")
            self._fail_all("load_corrupt" if not isinstance(e, StoreError) else cause(e))
        finally:
            self.seconds = time.perf_counter() - t0
            for ev in self.ready:
                ev.set()
            self.done.set()

    def _layer(self, layer: int) -> None:
        work = [(r, j) for r, s in enumerate(self.specs)
                for j in range(min(len(s.chunks), self.failed_from.get(s.req_id, len(s.chunks))))]
        if not work:
            return
        keys = [ChunkKey(self.specs[r].chunks[j].key, self.specs[r].chunks[j].index) for r, j in work]
        fetched = self.store.fetch([(k, layer) for k in keys], max_bytes=self.max_bytes)
        try:
            fetched.wait()
            for (r, j), key, blob in zip(work, keys, fetched.blobs):
                spec = self.specs[r]
                if j >= self.failed_from.get(spec.req_id, j + 1):
                    continue
                kv = self._open(spec, j, key, layer, blob)
                if kv is None:
                    continue
                part, where = self._targets[r][j]
                with self._lock:
                    if self.cancelled:
                        return
                    where.scatter(self.layout, self.caches[layer], kv[:, part])
                self.loaded_entries += 1
                self.loaded_bytes += len(blob)
                self.loaded_token_layers += part.stop - part.start
        finally:
            fetched.release()

    def _open(self, spec: LoadSpec, j: int, key: ChunkKey, layer: int, blob: Any) -> torch.Tensor | None:
        """The verified KV of one entry, or None (the chunk failed, counted)."""
        if isinstance(blob, StoreError):
            self._fail(spec, j, blob)
            return None
        try:
            kv = self.store.open(blob, key, layer, spec.chunks[j].tokens, copy=False, dtype=self.dtype,
                                 max_bytes=self.max_bytes).tensor
            if isinstance(kv, ZipEntry):
                kv = kv.decode()
            if tuple(kv.shape) != self.shape:
                raise ChunkCorrupt(f"{key.entry_name(layer)}: KV of shape {tuple(kv.shape)}, this model's chunk is "
                                   f"{self.shape}", key.entry_name(layer))
        except StoreError as e:
            self._fail(spec, j, e)
            return None
        return kv

    def _fail(self, spec: LoadSpec, j: int, e: StoreError) -> None:
        name = cause(e)
        with self._lock:
            self.causes[name] = self.causes.get(name, 0) + 1
            self.failed_from[spec.req_id] = min(j, self.failed_from.get(spec.req_id, j))
        if not isinstance(e, ChunkMissing):
            warn_limited(log, f"load-{name}", "kvtide connector: chunk %d of request %s not loaded (%s: %s); vLLM "
                         "recomputes it", spec.chunks[j].index, spec.req_id, type(e).__name__, e)

    def _fail_all(self, name: str) -> None:
        with self._lock:
            for s in self.specs:
                self.failed_from[s.req_id] = 0
            self.causes[name] = self.causes.get(name, 0) + 1

    # ---- vLLM's thread ----------------------------------------------------------------------------------------
    def wait(self, layer: int) -> float:
        """Block until ``layer`` is in place or the deadline passed (then cancel: late); returns seconds waited."""
        if self.ready[layer].is_set():
            return 0.0
        t0 = time.perf_counter()
        if not self.ready[layer].wait(max(0.0, self.deadline - time.monotonic())):
            self.cancel()
        return time.perf_counter() - t0

    def cancel(self) -> None:
        """Late: no write after this returns; every chunk of the step fails."""
        with self._lock:
            if self.done.is_set() or self.cancelled:
                return
            self.cancelled = True
        self._fail_all("load_late")
        warn_limited(log, "load-late", "kvtide connector: loads not in place %s after the step started; vLLM "
                     "recomputes them", "by the load deadline")
        for ev in self.ready:
            ev.set()

    def finish(self) -> None:
        """Wait for the whole job (to its deadline; then cancel)."""
        if not self.done.wait(max(0.0, self.deadline - time.monotonic())):
            self.cancel()

    def invalid_blocks(self) -> set[int]:
        """Blocks of the failed chunks' tokens, from the first failed one to the end of each request's load."""
        out: set[int] = set()
        bs = self.block_size
        for s in self.specs:
            j = self.failed_from.get(s.req_id)
            if j is None or j >= len(s.chunks):
                continue
            lo = max(s.start, s.chunks[j].index * self.chunk)
            out.update(s.block_ids[lo // bs: -(-s.end // bs)])
        return out

    def loaded_tokens(self) -> int:
        """Tokens placed in every layer (requests without a failure)."""
        return sum(s.end - s.start for s in self.specs if s.req_id not in self.failed_from)
