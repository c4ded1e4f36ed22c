"""Run a restoration plan: recompute a staircase on the compute thread while an I/O thread loads the rest.

For request r and block (= layer) i the plan's boundary j_ri splits the prefix: [start_r, j_ri) is recomputed,
[j_ri, N_r) is loaded from a store (one entry per (chunk, layer)), in the order the planner's objective
max(P + L*sigma, Q/B + sigma) assumes (CacheFlow §3.2, appendix A.1). A failed entry sends its request to a plain
prefill from the first bad position, so unverified KV never reaches attention. The executor sees the model only
through ``ModelPort``. The design and its reasons (read-ahead, verify workers, stealing, failures) are in
docs/design/executor.md.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from kvtide.cache import zip_blocks
from kvtide.store.base import ChunkCorrupt, StoreUnavailable, record_bytes_bound, token_array
from kvtide.store.zip_entry import BLOCK_SIZE as ZIP_BLOCK_SIZE
from kvtide.store.zip_entry import ZipEntry
from kvtide.store.profile_entry import ProfileEntry
from kvtide.store.keys import ChunkKey

__all__ = ["LoadConfig", "ModelPort", "RestoreExecutor", "RestoreJob", "RestoreResult", "RestoreRun", "Segment",
           "LoadFailure"]


@dataclass(frozen=True)
class Segment:
    """Rows of one request in a layer call: positions [start, end) of its sequence, attending over [0, end)."""

    request: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


class ModelPort(Protocol):
    """The narrow model interface the executor needs (the engine implements it over its runner)."""

    num_layers: int
    device: torch.device

    def run_layer(self, layer: int, h: torch.Tensor | None, segments: Sequence[Segment]) -> torch.Tensor:
        """Run ``layer`` over the segments' rows (``h`` None: embed their tokens), writing their K/V; returns h."""

    def write_kv(self, layer: int, request: int, start: int, kv: torch.Tensor) -> None:
        """Place ``kv`` [2, T, kv_heads, head_dim] as layer ``layer``'s K/V of positions [start, start+T).

        A port may also offer ``write_kv_chunks(layer, request, start, chunks)``, ``chunks`` [k, 2, C, kv_heads,
        head_dim] for k consecutive whole chunks from ``start``: the CUDA path then places each run of them in one
        call (fewer host calls on the I/O thread, which shares the GIL with the compute thread)."""

    def kv_entry_shape(self) -> tuple[int, int]:
        """(kv_heads, head_dim) a loaded entry must have."""

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...


@dataclass
class RestoreJob:
    """One request: prefix [0, cached) of which [0, start) is already on the device; suffix [cached, total)."""

    token_ids: Sequence[int]
    start: int
    cached: int
    total: int
    keys: Sequence[ChunkKey]  # chunk keys of the prefix, chunk c covers [c*C, (c+1)*C)
    boundaries: list[int]  # absolute j_i per layer: recompute [start, j_i), load [j_i, cached)
    # the KVServe profile the entries under ``keys`` were stored by (None: lossless entries); an entry of another
    # profile, or a lossless one where a profile's is expected (and the reverse), is refused as corrupt
    profile: str | None = None

    def validate(self, num_layers: int, chunk: int) -> None:
        if not 0 <= self.start <= self.cached < self.total <= len(self.token_ids):
            raise ValueError(f"need 0 <= start <= cached < total <= len(tokens), got {self.start}, {self.cached}, "
                             f"{self.total}, {len(self.token_ids)} (at least one suffix token to sample)")
        if len(self.boundaries) != num_layers:
            raise ValueError(f"need {num_layers} boundaries, got {len(self.boundaries)}")
        prev = self.cached
        for j in self.boundaries:
            if not self.start <= j <= prev:
                raise ValueError(f"boundaries must be non-increasing within [start, cached]: {self.boundaries}")
            prev = j
        if self.boundaries[-1] < self.cached and len(self.keys) * chunk < self.cached:
            raise ValueError(f"{len(self.keys)} chunk keys do not cover the {self.cached} cached tokens")


@dataclass(frozen=True)
class LoadConfig:
    """How the I/O side moves entries.

    ``batch_bytes``: raw bytes per ``fetch`` (one store round trip; on CUDA one staging slot and one
    host-to-device copy). ``read_ahead``: fetches in flight beyond the batch being placed (the link works while
    the CPU verifies); None picks 2 on CUDA and 1 on a CPU device (``resolved_read_ahead``). ``workers``: threads
    that verify and stage a batch's entries in parallel; None picks 0 on a CPU device (its spare core already runs
    this thread) and min(2, cores // 2) on CUDA. ``steal``, ``merge_layers``: docs/design/executor.md.
    """

    batch_bytes: int = 64 << 20
    read_ahead: int | None = None
    workers: int | None = None
    steal: bool = False  # idle link takes recompute chunks of staircase layers not started yet
    merge_layers: int = 1  # most consecutive layers whose entries share a fetch (1: a fetch per layer)

    def __post_init__(self) -> None:
        if not isinstance(self.batch_bytes, int) or self.batch_bytes < 1:
            raise ValueError(f"batch_bytes must be an int >= 1, got {self.batch_bytes!r}")
        if self.read_ahead is not None and (not isinstance(self.read_ahead, int) or isinstance(self.read_ahead, bool)
                                            or self.read_ahead < 0):
            raise ValueError(f"read_ahead must be None or an int >= 0, got {self.read_ahead!r}")
        if not isinstance(self.merge_layers, int) or isinstance(self.merge_layers, bool) or self.merge_layers < 1:
            raise ValueError(f"merge_layers must be an int >= 1, got {self.merge_layers!r}")
        if self.workers is not None and (not isinstance(self.workers, int) or self.workers < 0):
            raise ValueError(f"workers must be None or an int >= 0, got {self.workers!r}")

    def resolved_read_ahead(self, device: torch.device) -> int:
        """None: 2 on CUDA (with one fetch ahead the link idles whenever a batch's verify runs long), 1 on a CPU
        device (verify shares the cores with the compute thread; a second fetch ahead gains nothing there)."""
        if self.read_ahead is not None:
            return self.read_ahead
        return 2 if device.type == "cuda" else 1

    def resolved_workers(self, device: torch.device) -> int:
        if self.workers is not None:
            return self.workers
        return 0 if device.type != "cuda" else max(1, min(2, (os.cpu_count() or 2) // 2))


@dataclass(frozen=True)
class LoadFailure:
    request: int
    layer: int
    chunk: int
    position: int  # first token of the entry's range that could not be placed
    error: str  # exception class name
    message: str


@dataclass
class RestoreResult:
    """What happened, with the times the latency profile and the benchmarks want."""

    logits: torch.Tensor  # [requests, vocab], last suffix row of each
    total_seconds: float = 0.0
    recompute_seconds: float = 0.0  # staircase (prefix replay) on the compute thread
    suffix_seconds: float = 0.0  # suffix layers, not counting waits
    wait_seconds: float = 0.0  # compute thread idle, waiting for loads
    load_seconds: float = 0.0  # I/O thread: first load start -> last load end
    # the plan's own loads (before any stealing): what the load-rate estimate learns from. Stolen chunks go one at a
    # time, the link idle while each is verified and placed, so a rate over them understates what a plan's
    # pipelined loads get; plans made with it recompute more and leave the link idle for more stealing
    planned_load_seconds: float = 0.0
    planned_load_bytes: int = 0
    link_wait_seconds: float = 0.0  # I/O thread idle, waiting for bytes to cross the (emulated) link
    overhead_seconds: float = 0.0  # total minus the compute thread's recompute + suffix + waits
    load_batches: int = 0
    stolen_tokens: int = 0  # sum over (request, layer) of tokens the I/O side took over from recompute
    boundaries: list[list[int]] = field(default_factory=list)  # as executed (stealing lowers planned ones)
    load_bytes: int = 0
    loaded_entries: int = 0
    recomputed_tokens: int = 0  # sum over (request, layer) of j - start
    loaded_tokens: int = 0  # sum over (request, layer) of tokens placed from the store
    layer_recompute_seconds: list[float] = field(default_factory=list)
    suffix_layer_seconds: list[float] = field(default_factory=list)
    # per suffix layer: did the compute thread reach it before its loads were in (its launch then waited on the
    # link, and on CUDA its measured time holds the host's launch gaps, not only device work)
    suffix_layer_paced: list[bool] = field(default_factory=list)
    failures: list[LoadFailure] = field(default_factory=list)
    fallback_requests: list[int] = field(default_factory=list)
    fallback_tokens: int = 0  # positions re-run through every layer by the fallback
    fallback_seconds: float = 0.0
    # time between ``RestoreRun.advance`` calls (the caller's own work, e.g. decode steps), within total_seconds
    paused_seconds: float = 0.0
    advances: int = 0  # advance calls that ran compute work (1 for a blocking run)
    decode_seconds: float = 0.0  # I/O thread decoding entries stored under a KVServe profile (within load_seconds)
    decoded_entries: int = 0


class _Loads:
    """State shared between the compute thread and the I/O thread."""

    def __init__(self, num_layers: int, device: torch.device, jobs: Sequence[RestoreJob] = ()) -> None:
        self.bounds = [list(j.boundaries) for j in jobs]  # current boundaries (stealing lowers unclaimed ones)
        # each request's ids converted once for the stores' token checks (sliced per entry, compared as bytes)
        self.token_ids = [token_array(j.token_ids) for j in jobs]
        self.claimed = -1  # staircase layers <= claimed are fixed (the compute thread started them)
        self.stair_done = threading.Event()
        self.steal_lock = threading.Lock()  # held by the I/O thread from picking a steal until it is placed
        self.steal_event: Any = None  # CUDA: recorded on the I/O stream after the last stolen chunk
        self.stolen = 0
        self.ready = [threading.Event() for _ in range(num_layers)]
        self.cuda_events: list[Any] = [None] * num_layers
        self.failures: list[LoadFailure] = []
        self.failed_requests: set[int] = set()
        self.tier_down = False  # a tier-level error (StoreUnavailable) was seen: no further loads
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.t_start = 0.0
        self.t_end = 0.0
        self.t_planned = 0.0  # the plan's loads in (host clock), before stealing
        self.planned_bytes = 0
        self.bytes = 0
        self.entries = 0
        self.tokens = 0
        self.batches = 0
        self.link_wait = 0.0
        self.decode_seconds = 0.0  # profile entries decoded on the I/O thread
        self.decoded_entries = 0
        self.crash: BaseException | None = None


class RestoreExecutor:
    """Executes staircases on a ``ModelPort`` with a store (``fetch``/``open``, or just ``get_entry``)."""

    def __init__(self, port: ModelPort, store: Any, chunk: int, load: LoadConfig | None = None,
                 kv_dtype: torch.dtype | None = None) -> None:
        """``kv_dtype``: the dtype loaded entries must hold (the pages' KV dtype); None: any the store holds."""
        if chunk <= 0:
            raise ValueError(f"chunk must be > 0 tokens, got {chunk}")
        self.port = port
        self.store = store
        self.chunk = chunk
        self.load = load or LoadConfig()
        self.kv_dtype = kv_dtype

    def max_entry_bytes(self) -> int:
        """The most bytes an entry of this port's shape can take (what a tier may read of one)."""
        heads, dim = self.port.kv_entry_shape()
        return record_bytes_bound((2, self.chunk, heads, dim), self.kv_dtype, self.chunk)

    def _fetch(self, pairs: list) -> Any:
        return self.store.fetch(pairs, max_bytes=self.max_entry_bytes())

    def _check_entry(self, kv: Any, key: ChunkKey, layer: int, want: tuple[int, ...]) -> None:
        """Shape (and dtype, when known) of a verified entry; ChunkCorrupt otherwise."""
        if tuple(kv.shape) != want:
            raise ChunkCorrupt(f"entry {key.entry_name(layer)} has shape {list(kv.shape)}, expected {list(want)}",
                               key.entry_name(layer))
        if self.kv_dtype is not None and kv.dtype != self.kv_dtype:
            raise ChunkCorrupt(f"entry {key.entry_name(layer)} holds {kv.dtype}, the pages hold {self.kv_dtype}",
                               key.entry_name(layer))

    # ------------------------------------------------------------------------------------- I/O side
    def _per_batch(self) -> int:
        """Entries per fetch."""
        heads, dim = self.port.kv_entry_shape()
        per_entry = 2 * self.chunk * heads * dim * 2 + 4 * self.chunk + 256  # bf16 estimate: only sizes the batches
        return max(1, self.load.batch_bytes // per_entry)

    def _work(self, jobs: Sequence[RestoreJob]) -> list[list[tuple[int, list[tuple[int, int, int, int]]]]]:
        """The fetches, in order; each is a list of (layer, items) pieces, items being (request, chunk, first
        token, end token). Layers go in order; a fetch takes up to ``per_batch`` entries from up to
        ``LoadConfig.merge_layers`` consecutive layers (1: each layer's entries alone)."""
        C = self.chunk
        per_batch = self._per_batch()
        out: list[list[tuple[int, list[tuple[int, int, int, int]]]]] = []
        used = per_batch  # entries in out[-1] (full: the next piece opens a fetch)
        for layer in range(self.port.num_layers):
            items = []
            for r, job in enumerate(jobs):
                lo = job.boundaries[layer]
                for c in range(lo // C, -(-job.cached // C)) if lo < job.cached else ():
                    items.append((r, c, max(c * C, lo), min((c + 1) * C, job.cached)))
            k = 0
            while k < len(items):
                if used >= per_batch or len(out[-1]) >= self.load.merge_layers:
                    out.append([])
                    used = 0
                take = min(per_batch - used, len(items) - k)
                out[-1].append((layer, items[k:k + take]))
                used += take
                k += take
        return out

    def _load_all(self, jobs: Sequence[RestoreJob], st: _Loads) -> None:
        port = self.port
        cuda = port.device.type == "cuda"
        stream = _io_stream(port.device) if cuda else None
        st.t_start = time.perf_counter()
        nxt = 0  # layers below are signalled

        def signal(upto: int) -> None:  # layers are signalled in order: the suffix consumes them in order
            nonlocal nxt
            while nxt < upto:
                if cuda:
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    st.cuda_events[nxt] = ev
                st.ready[nxt].set()
                nxt += 1

        try:
            with (torch.cuda.device(port.device) if cuda else _nullctx()), \
                    (torch.cuda.stream(stream) if cuda else _nullctx()):
                work = self._work(jobs)
                left = [0] * port.num_layers
                for fetch in work:
                    for layer, _ in fetch:
                        left[layer] += 1
                first_busy = lambda: next((i for i in range(port.num_layers) if left[i]), port.num_layers)  # noqa: E731
                signal(first_busy())
                if hasattr(self.store, "fetch") and hasattr(self.store, "open"):
                    steps = self._pipelined(jobs, work, st)
                else:
                    steps = self._one_by_one(jobs, work, st)
                for layer in steps:
                    left[layer] -= 1
                    signal(first_busy())
                    if st.stop.is_set():
                        return
                if self.load.steal and hasattr(self.store, "fetch"):
                    if cuda:
                        stream.synchronize()  # the plan's copies are done: their end, for the rate estimate
                    st.t_planned, st.planned_bytes = time.perf_counter(), st.bytes
                    self._steal(jobs, st, stream)
        except BaseException as e:  # never leave the compute thread waiting
            st.crash = e
        finally:
            if cuda:
                stream.synchronize()
            st.t_end = time.perf_counter()
            if not st.t_planned:
                st.t_planned, st.planned_bytes = st.t_end, st.bytes
            for ev in st.ready:
                ev.set()

    def _steal(self, jobs: Sequence[RestoreJob], st: _Loads, stream: Any) -> None:
        """While the staircase runs, load the top chunk of the unstarted layer with the largest boundary."""
        C = self.chunk
        L = self.port.num_layers
        while not st.stair_done.is_set() and not st.stop.is_set():
            with st.steal_lock:
                if not self._steal_one(jobs, st, C, L, stream):
                    return

    def _steal_one(self, jobs: Sequence[RestoreJob], st: _Loads, C: int, L: int, stream: Any) -> bool:
        """Pick (under the lock) and load one chunk; False when nothing is left to take (or the tier is down)."""
        with st.lock:
            if st.tier_down:
                return False
            best = None
            for r, job in enumerate(jobs):
                if r in st.failed_requests:
                    continue
                b = st.bounds[r]
                for i in range(st.claimed + 1, L):
                    j = b[i]
                    floor = max(b[i + 1] if i + 1 < L else job.start, job.start)
                    new = (j - 1) // C * C
                    if j > job.start and new >= floor and (best is None or (j, i) > (best[0], best[1])):
                        best = (j, i, r, new)
            if best is None:
                return False
            j, i, r, new = best
            st.bounds[r][i] = new
            st.stolen += j - new
        f = self._fetch([(jobs[r].keys[new // C], i)])
        self._place(jobs, [(i, [(r, new // C, new, j)])], f, st, None)
        if stream is not None:
            ev = torch.cuda.Event()
            ev.record(stream)
            st.steal_event = ev
        return True

    def _live(self, items: list[tuple[int, int, int, int]], layer: int, st: _Loads) -> list[tuple[int, int, int, int]]:
        """Every item while the tier is up; none once it is down, each request's first skipped item of this layer
        recorded (its lowest position here), so its fallback starts low enough."""
        if not st.tier_down:
            return items
        skipped = set()
        with st.lock:
            for r, c, a, _ in items:
                if r not in skipped:
                    skipped.add(r)
                    st.failures.append(LoadFailure(r, layer, c, a, "Skipped", "tier unavailable"))
                    st.failed_requests.add(r)
        return []

    def _pipelined(self, jobs: Sequence[RestoreJob], work: list, st: _Loads) -> Iterator[int]:
        """Fetch batch k+read_ahead while batch k is verified and placed; yields the layer of each placed piece
        (a batch of several layers yields each, in order)."""
        inflight: deque[tuple[list, Any]] = deque()
        workers = self.load.resolved_workers(self.port.device)
        ahead = self.load.resolved_read_ahead(self.port.device)
        pool = _pool(workers) if workers > 1 else None
        for group in work:
            segs = [(layer, self._live(items, layer, st)) for layer, items in group]
            pairs = [(jobs[r].keys[c], layer) for layer, items in segs for r, c, _, _ in items]
            inflight.append((segs, self._fetch(pairs) if pairs else None))
            while len(inflight) > ahead:
                yield from self._place(jobs, *inflight.popleft(), st, pool)
        while inflight:
            yield from self._place(jobs, *inflight.popleft(), st, pool)

    def _place(self, jobs: Sequence[RestoreJob], segs: list[tuple[int, list]], f: Any, st: _Loads,
               pool: ThreadPoolExecutor | None) -> list[int]:
        """Verify and place one fetch holding the (layer, items) pieces ``segs``; returns their layers."""
        layers = [layer for layer, _ in segs]
        if f is None:
            return layers
        after = None
        try:
            after = self._place_fetched(jobs, segs, f, st, pool)
        finally:
            release = getattr(f, "release", None)  # a tier's own memory (PinnedMemoryStore): give it back
            if release is not None:
                if after is None and getattr(f, "pinned", False) and self.port.device.type == "cuda":
                    after = torch.cuda.Event()  # an error after some device copies began: behind those copies
                    after.record()
                release(after)
        return layers

    def _place_fetched(self, jobs: Sequence[RestoreJob], segs: list[tuple[int, list]], f: Any, st: _Loads,
                       pool: ThreadPoolExecutor | None) -> Any:
        """``_place``'s work; returns the event behind device copies still reading ``f``'s bytes (or None)."""
        st.link_wait += f.wait()
        C = self.chunk
        heads, dim = self.port.kv_entry_shape()
        want = (2, C, heads, dim)
        flat = [(layer, it) for layer, items in segs for it in items]  # f.blobs[i] is flat[i]'s entry

        def open_one(i: int) -> torch.Tensor | BaseException:
            layer, (r, c, _, _) = flat[i]
            blob = f.blobs[i]
            if isinstance(blob, BaseException):
                return blob
            key = jobs[r].keys[c]
            try:
                kw = {"dtype": self.kv_dtype} if self.kv_dtype is not None else {}
                kv = self.store.open(blob, key, layer, st.token_ids[r][c * C:(c + 1) * C], copy=False,
                                     decode=False, **kw).tensor
                self._check_entry(kv, key, layer, want)
                got = kv.profile if isinstance(kv, ProfileEntry) else None
                if got != jobs[r].profile:
                    raise ChunkCorrupt(f"entry {key.entry_name(layer)} is stored under profile {str(got)[:40]!r}, "
                                       f"this load wants {str(jobs[r].profile)[:40]!r}", key.entry_name(layer))
                if isinstance(kv, ZipEntry) and kv.block_size != ZIP_BLOCK_SIZE:  # one decode launch per fetch
                    raise ChunkCorrupt(f"entry {key.entry_name(layer)} has ZipFusion blocks of {kv.block_size}, this "
                                       f"loader decodes blocks of {ZIP_BLOCK_SIZE}", key.entry_name(layer))
                return kv
            except Exception as e:  # noqa: BLE001 - any failure of a tier means "recompute this", never garbage
                return e

        idx = range(len(flat))
        opened = list(pool.map(open_one, idx)) if pool is not None else [open_one(i) for i in idx]
        ok = []
        for i, kv in enumerate(opened):
            layer, (r, c, a, b) = flat[i]
            if isinstance(kv, BaseException):
                _record_failure(st, r, layer, c, a, kv)
            else:
                ok.append((i, kv))
        placed = self._place_profiled(flat, [(i, kv) for i, kv in ok if isinstance(kv, ProfileEntry)], st)
        ok = [(i, kv) for i, kv in ok if not isinstance(kv, ProfileEntry)]
        after = None
        if self.port.device.type == "cuda":
            placed_dev, after = self._place_cuda(flat, ok, pool, direct=getattr(f, "pinned", False))
            placed += placed_dev
        else:
            for i, kv in ok:
                layer, (r, c, a, b) = flat[i]
                if isinstance(kv, ZipEntry):
                    kv = kv.decode()
                self.port.write_kv(layer, r, a, kv[:, a - c * C:b - c * C])
                placed.append(i)
        with st.lock:
            st.batches += 1
            for i in placed:
                _, (r, c, a, b) = flat[i]
                st.bytes += len(f.blobs[i])
                st.entries += 1
                st.tokens += b - a
        return after

    def _place_profiled(self, flat: list[tuple[int, tuple[int, int, int, int]]], ok: list[tuple[int, ProfileEntry]],
                        st: _Loads) -> list[int]:
        """Decode profile entries on the port's device (on CUDA on the I/O stream, synchronised so the decode time
        is measured) and write them to the pages; returns the placed indices. A blob that does not decode is a
        failed entry (recomputed), like any other."""
        if not ok:
            return []
        C, dev = self.chunk, self.port.device
        cuda = dev.type == "cuda"
        t0 = time.perf_counter()
        placed = []
        for i, e in ok:
            layer, (r, c, a, b) = flat[i]
            try:
                kv = e.decode(dev if cuda else None)
            except Exception as ex:  # noqa: BLE001 - a blob that does not decode costs a recompute, never garbage
                _record_failure(st, r, layer, c, a, ex)
                continue
            self.port.write_kv(layer, r, a, kv[:, a - c * C:b - c * C])
            placed.append(i)
        if cuda:
            torch.cuda.current_stream(dev).synchronize()
        with st.lock:
            st.decode_seconds += time.perf_counter() - t0
            st.decoded_entries += len(ok)
        return placed

    def _place_cuda(self, flat: list[tuple[int, tuple[int, int, int, int]]], ok: list[tuple[int, torch.Tensor]],
                    pool: ThreadPoolExecutor | None, direct: bool = False) -> tuple[list[int], Any]:
        """Entries to the device on the I/O stream (the caller's current stream), then page writes there.

        ``direct``: the entries lie in page-locked memory (``PinnedMemoryStore``), so each is copied to the device
        by DMA straight from the record; returns the event behind those copies, before which the records must
        not be reused. Otherwise they are staged in one pinned buffer (parallel copies) for one async copy.
        """
        if not ok:
            return [], None
        C = self.chunk
        sizes = [_nbytes(kv) for _, kv in ok]
        offs = [0]
        for n in sizes:
            offs.append(offs[-1] + -(-n // 64) * 64)
        after = None
        if direct:
            dev = torch.empty(offs[-1], dtype=torch.uint8, device=self.port.device)
            for k, (_, kv) in enumerate(ok):
                dev[offs[k]:offs[k] + sizes[k]].copy_(_bytes(kv), non_blocking=True)
            after = torch.cuda.Event()
            after.record()
        else:
            # torch's caching host allocator recycles pinned blocks and, having recorded the copy's event on this
            # stream, hands a block out again only after that copy has finished: no staging block is overwritten
            # early.
            host = torch.empty(offs[-1], dtype=torch.uint8, pin_memory=True)

            def stage(k: int) -> None:
                host[offs[k]:offs[k] + sizes[k]].copy_(_bytes(ok[k][1]))

            if pool is not None:
                list(pool.map(stage, range(len(ok))))
            else:
                for k in range(len(ok)):
                    stage(k)
            dev = host.to(self.port.device, non_blocking=True)
        if any(isinstance(kv, ZipEntry) for _, kv in ok):  # one decode launch for the fetch: then all plain KV
            dev, offs, sizes = _unzip(dev, [kv for _, kv in ok], offs, sizes)  # ZipEntry has .shape, .dtype
        chunks = getattr(self.port, "write_kv_chunks", None)
        runs = _chunk_runs([flat[i] for i, _ in ok], [tuple(kv.shape) for _, kv in ok], offs, sizes, C) \
            if chunks is not None else [(k, k + 1) for k in range(len(ok))]
        for k, e in runs:
            i, kv = ok[k]
            layer, (r, c, a, b) = flat[i]
            if e - k > 1:  # whole chunks of one request's layer, back to back in the buffer: one write
                chunks(layer, r, a, dev[offs[k]:offs[e - 1] + sizes[e - 1]].view(kv.dtype).view(e - k, *kv.shape))
            else:
                x = dev[offs[k]:offs[k] + sizes[k]].view(kv.dtype).view(kv.shape)
                self.port.write_kv(layer, r, a, x[:, a - c * C:b - c * C])
        return [i for i, _ in ok], after

    def _one_by_one(self, jobs: Sequence[RestoreJob], work: list, st: _Loads) -> Iterator[int]:
        """Stores with only ``get_entry`` (wrappers): each entry read, verified and placed in turn."""
        for layer, items in (piece for fetch in work for piece in fetch):
            for r, c, a, b in self._live(items, layer, st):
                self._load_one(jobs[r], r, layer, c, a, st)
            with st.lock:
                st.batches += 1
            yield layer

    def _load_one(self, job: RestoreJob, r: int, layer: int, c: int, lo: int, st: _Loads) -> None:
        C = self.chunk
        a, b = max(c * C, lo), min((c + 1) * C, job.cached)
        try:
            key = job.keys[c]
            entry = self.store.get_entry(key, layer, job.token_ids[c * C:(c + 1) * C])
            kv = entry.tensor
            heads, dim = self.port.kv_entry_shape()
            self._check_entry(kv, key, layer, (2, C, heads, dim))
            kv = kv[:, a - c * C:b - c * C]
            if self.port.device.type == "cuda":
                kv = kv.pin_memory().to(self.port.device, non_blocking=True)
            self.port.write_kv(layer, r, a, kv)
        except Exception as e:  # noqa: BLE001 - any failure of a tier means "recompute this", never garbage
            _record_failure(st, r, layer, c, a, e)
            return
        with st.lock:
            st.bytes += entry.nbytes
            st.entries += 1
            st.tokens += b - a

    # --------------------------------------------------------------------------------- compute side
    def run(self, jobs: Sequence[RestoreJob], profile: Any = None) -> RestoreResult:
        """Restore every job's prefix by its boundaries, prefill its suffix, return last-row logits.

        ``profile`` (a LatencyProfile) gets the per-layer recompute times of single-request layers that start
        at position 0 (that is F(j)) and the observed load bandwidth. Blocking: ``start`` then ``advance(inf)``.
        """
        r = self.start(jobs, profile)
        r.advance(math.inf)
        return r.result()

    def start(self, jobs: Sequence[RestoreJob], profile: Any = None,
              quantum_cost: "Callable[[Sequence[Segment]], float] | None" = None) -> "RestoreRun":
        """Begin a restoration that the caller advances by time budgets (``RestoreRun.advance``) between its own
        work (an engine's decode steps); the loads start now on the I/O thread. ``quantum_cost(segments)``: the
        predicted seconds of one layer call over those segments, charged against a budget where it exceeds the
        host time the call took (on CUDA a launch returns long before its kernels end) and used to split a call
        that alone would exceed the budget."""
        return RestoreRun(self, jobs, profile, quantum_cost)

    def _compute(self, jobs: Sequence[RestoreJob], st: _Loads, res: RestoreResult, clock: "_Clock",
                 run: "RestoreRun") -> Iterator[tuple]:
        """The compute thread's work as a generator: it yields ``("call", predicted seconds)`` before each layer
        call (or piece of one) and ``("wait", is_ready, block)`` where it needs loads that are not in yet; it
        returns (staircase marks, suffix marks, suffix start mark) in ``run.marks`` when the logits are made."""
        port = self.port
        cuda = clock.cuda
        stair: list = []
        try:
            h: torch.Tensor | None = None
            prev: list[Segment] = []
            for layer in range(port.num_layers):
                with st.lock:  # claim the layer: from now on its boundary is fixed
                    st.claimed = layer
                    segs = [Segment(r, j.start, st.bounds[r][layer]) for r, j in enumerate(jobs)
                            if st.bounds[r][layer] > j.start]
                if not segs:
                    break
                if h is not None:
                    h = _keep_rows(h, prev, segs)
                h = yield from run.call(layer, h, segs)
                stair.append((run.last_marks, segs))
                res.recomputed_tokens += sum(s.length for s in segs)
                prev = segs
        finally:
            with st.lock:
                st.claimed = port.num_layers
            st.stair_done.set()

        alive = list(range(len(jobs)))
        h = None
        marks: list = []
        start = clock.mark()
        paused = run.paused_seconds
        # no steal starts after the staircase; wait for the one in flight, if any
        if st.steal_lock.locked():
            yield ("wait", lambda: not st.steal_lock.locked(), lambda: st.steal_lock.acquire() and
                   st.steal_lock.release())
        with st.steal_lock:
            pass
        if cuda and st.steal_event is not None:
            torch.cuda.current_stream(port.device).wait_event(st.steal_event)
        for layer in range(port.num_layers):
            paced = not st.ready[layer].is_set()
            if paced:
                yield ("wait", st.ready[layer].is_set, st.ready[layer].wait)
            if cuda and st.cuda_events[layer] is not None:
                torch.cuda.current_stream(port.device).wait_event(st.cuda_events[layer])
            with st.lock:
                failed = set(st.failed_requests)
            if failed & set(alive):
                keep = [r for r in alive if r not in failed]
                if h is not None:
                    old = [Segment(r, jobs[r].cached, jobs[r].total) for r in alive]
                    new = [Segment(r, jobs[r].cached, jobs[r].total) for r in keep]
                    h = _keep_rows(h, old, new) if keep else None
                alive = keep
            if not alive:
                break
            h = yield from run.call(layer, h, [Segment(r, jobs[r].cached, jobs[r].total) for r in alive])
            marks.append(run.last_marks)
            res.suffix_layer_paced.append(paced)
        if not alive:
            h = None
        run.marks = (stair, marks, start, run.paused_seconds - paused)
        yield ("wait", run.io_done, run.join_io)  # the loads' end (their failures decide the fallback)

        last: dict[int, torch.Tensor] = {}
        if alive:
            ends = torch.tensor(_row_ends([jobs[r].total - jobs[r].cached for r in alive]), device=h.device) - 1
            for r, row in zip(alive, h.index_select(0, ends)):
                last[r] = row
        bad = sorted(set(range(len(jobs))) - set(alive))
        if bad:
            rows = yield from self._fallback(jobs, bad, st.failures, res, cuda, run)
            last.update(rows)
        res.logits = port.logits(torch.stack([last[r] for r in range(len(jobs))]))

    def _times(self, jobs: Sequence[RestoreJob], res: RestoreResult, clock: "_Clock", stair: list,
               suffix_start: Any, suffix_marks: list, profile: Any, suffix_paused: float = 0.0) -> None:
        """Per-layer recompute, suffix and wait times from the marks (CUDA events are read here, once). A layer
        call is one mark pair, or one per row slice; spans that held the caller's own work between advances
        (``paused_seconds``) are counted without it: sums of calls, waits less the pauses."""
        layer_time = lambda ms: sum(clock.between(a, b) for a, b in ms)  # noqa: E731
        res.layer_recompute_seconds = [layer_time(ms) for ms, _ in stair]
        if not stair:
            res.recompute_seconds = 0.0
        elif res.paused_seconds:
            res.recompute_seconds = sum(res.layer_recompute_seconds)
        else:
            res.recompute_seconds = clock.between(stair[0][0][0][0], stair[-1][0][-1][1])
        res.suffix_layer_seconds = [layer_time(ms) for ms in suffix_marks]
        res.suffix_seconds = sum(res.suffix_layer_seconds)
        if suffix_marks:
            span = clock.between(suffix_start, suffix_marks[-1][-1][1])
            res.wait_seconds = max(0.0, span - res.suffix_seconds - suffix_paused)
        busy = res.recompute_seconds + res.suffix_seconds + res.wait_seconds + res.fallback_seconds
        res.overhead_seconds = max(0.0, res.total_seconds - busy - res.paused_seconds)
        if profile is not None:
            for (ms, segs), dt in zip(stair, res.layer_recompute_seconds):
                if len(ms) == 1 and len(segs) == 1 and segs[0].start == 0 and dt > 0:
                    getattr(profile, "observe_call", profile.observe)(segs[0].end, dt)

    def _fallback(
        self, jobs: Sequence[RestoreJob], bad: list[int], failures: list[LoadFailure], res: RestoreResult, cuda: bool,
        run: "RestoreRun",
    ) -> Iterator[tuple]:
        """Recompute [m, total) through every layer, m = first position that failed to load (a generator like
        ``_compute``; returns the last row of each request)."""
        t = time.perf_counter()
        paused = run.paused_seconds
        first = {r: min(f.position for f in failures if f.request == r) for r in bad}
        segs = [Segment(r, max(jobs[r].start, first[r]), jobs[r].total) for r in bad]
        h = None
        for layer in range(self.port.num_layers):
            h = yield from run.call(layer, h, segs)
        if cuda:
            torch.cuda.current_stream(self.port.device).synchronize()
        ends = torch.tensor(_row_ends([s.length for s in segs]), device=h.device) - 1
        res.fallback_requests = bad
        res.fallback_tokens = sum(s.length for s in segs)
        res.fallback_seconds = time.perf_counter() - t - (run.paused_seconds - paused)
        return {r: row for r, row in zip(bad, h.index_select(0, ends))}


class RestoreRun:
    """A restoration in flight (``RestoreExecutor.start``): the I/O thread loads in the background while the caller
    runs the compute side in quanta, one layer call (or a row slice of one) at a time, by ``advance(budget_s)``.

    ``advance(math.inf)`` is the blocking executor: it runs every quantum, waiting for loads where the suffix needs
    them, in exactly the order and shapes of the one-shot run. A finite budget never waits for loads (it returns and
    is called again), stops before a quantum that would overrun the budget (after at least one), and splits a layer
    call whose predicted cost exceeds the whole budget into row slices (causal attention over the pages makes a
    slice the same computation as chunked prefill). Between advances the caller may run other work on the same
    thread and stream (ordering on the compute stream is kept), but must not touch the restoring sequences' pages.
    """

    def __init__(self, ex: RestoreExecutor, jobs: Sequence[RestoreJob], profile: Any,
                 quantum_cost: Callable[[Sequence[Segment]], float] | None) -> None:
        port = ex.port
        for job in jobs:
            job.validate(port.num_layers, ex.chunk)
        self.ex, self.jobs, self.profile, self.quantum_cost = ex, list(jobs), profile, quantum_cost
        self.cuda = port.device.type == "cuda"
        if self.cuda:  # page tables and slots the I/O stream reads were made on this stream
            torch.cuda.current_stream(port.device).synchronize()
        self.t0 = time.perf_counter()
        self.st = _Loads(port.num_layers, port.device, jobs)
        self.io = threading.Thread(target=ex._load_all, args=(jobs, self.st), name="kvtide-restore-io", daemon=True)
        self.io.start()
        self.res = RestoreResult(logits=torch.empty(0))
        self.clock = _Clock(port.device)
        self.marks: tuple = ([], [], None, 0.0)
        self.last_marks: list = []  # (start, end) marks of the pieces of the latest layer call
        self.paused_seconds = 0.0
        self.done = False
        self._budget = math.inf
        self._left_at: float | None = None
        self._item: tuple = ("call", 0.0)  # what the generator asked for last, not acted on yet
        self._ratios: deque[float] = deque(maxlen=8)  # host time / predicted cost of recent quanta
        self._gen = ex._compute(self.jobs, self.st, self.res, self.clock, self)

    # ---- helpers for the compute generator
    def io_done(self) -> bool:
        return not self.io.is_alive()

    def join_io(self) -> None:
        self.io.join()

    def call(self, layer: int, h: torch.Tensor | None, segs: list[Segment]) -> Iterator[tuple]:
        """One layer call over ``segs`` as quanta: whole, or in row slices when a finite budget is too small for it."""
        cost = self.quantum_cost(segs) * self._correction() if self.quantum_cost is not None else 0.0
        pieces = 1 if not math.isfinite(self._budget) or self._budget <= 0 else math.ceil(cost / self._budget)
        rows = sum(s.length for s in segs)
        clock = self.clock
        if pieces <= 1 or rows < 2:
            yield ("call", cost)
            a = clock.mark()
            h = self.ex.port.run_layer(layer, h, segs)
            self.last_marks = [(a, clock.mark())]
            return h
        outs, marks = [], []
        o = 0
        for part in _slice_rows(segs, min(pieces, rows)):
            n = sum(s.length for s in part)
            yield ("call", cost * n / rows)
            x = h[o:o + n] if h is not None else None
            a = clock.mark()
            outs.append(self.ex.port.run_layer(layer, x, part).clone())  # layer graphs return their own buffer
            marks.append((a, clock.mark()))
            o += n
        self.last_marks = marks
        return torch.cat(outs)

    def _correction(self) -> float:
        """How much longer than predicted recent quanta took on the host (>= 1; on CUDA a launch returns early, so
        host time only ever says a quantum was longer, never shorter): slices are cut to what calls really take."""
        if not self._ratios:
            return 1.0
        return max(1.0, float(sorted(self._ratios)[len(self._ratios) // 2]))

    # ---- the caller's side
    def advance(self, budget_s: float) -> bool:
        """Run compute quanta for about ``budget_s`` seconds (at least one if one can run); True once restored."""
        if self.done:
            return True
        if not budget_s >= 0:
            raise ValueError(f"budget_s must be >= 0, got {budget_s!r}")
        now = time.perf_counter()
        if self._left_at is not None:
            self.paused_seconds += now - self._left_at
        reset = getattr(self.ex.port, "reset_plan", None)  # other work may have planned the attention backend
        if reset is not None and self._left_at is not None:
            reset()
        self._budget = budget_s
        self.res.advances += 1
        spent = 0.0
        try:
            while True:
                kind = self._item[0]
                charge = 0.0
                if kind == "wait":
                    _, ready, block = self._item
                    if not ready():
                        if math.isfinite(budget_s):
                            break
                        block()
                else:
                    charge = self._item[1]
                    if spent > 0 and spent + charge > budget_s:
                        break
                t = time.perf_counter()
                try:
                    self._item = next(self._gen)
                except StopIteration:
                    self._finish()
                    return True
                took = time.perf_counter() - t
                if charge > 0:
                    self._ratios.append(took / charge)
                spent += max(took, charge)
        except BaseException:
            self.cancel()
            raise
        self._left_at = time.perf_counter()
        return False

    def cancel(self) -> None:
        """Stop: the I/O thread ends after the fetch in flight and is joined, so no load writes pages afterwards."""
        self.st.stop.set()
        self._gen.close()
        self.io.join()
        if self.cuda:
            torch.cuda.current_stream(self.ex.port.device).synchronize()
        self.done = True

    def result(self) -> RestoreResult:
        if not self.done:
            raise RuntimeError("the restoration has not finished: advance it until it returns True")
        return self.res

    def _finish(self) -> None:
        ex, st, res = self.ex, self.st, self.res
        self.io.join()
        if st.crash is not None:
            raise RuntimeError("restore I/O thread failed outside a load") from st.crash
        res.failures = list(st.failures)
        res.load_bytes, res.loaded_entries, res.loaded_tokens = st.bytes, st.entries, st.tokens
        res.load_batches, res.link_wait_seconds, res.stolen_tokens = st.batches, st.link_wait, st.stolen
        res.decode_seconds, res.decoded_entries = st.decode_seconds, st.decoded_entries
        res.boundaries = [list(b) for b in st.bounds]
        jobs = self.jobs
        loads = any(j.boundaries[-1] < j.cached for j in jobs)
        res.load_seconds = max(0.0, st.t_end - st.t_start) if loads else 0.0
        res.planned_load_seconds = max(0.0, st.t_planned - st.t_start) if loads else 0.0
        res.planned_load_bytes = st.planned_bytes
        if self.cuda:
            torch.cuda.current_stream(ex.port.device).synchronize()
        res.total_seconds = time.perf_counter() - self.t0
        res.paused_seconds = self.paused_seconds
        stair, marks, start, suffix_paused = self.marks
        ex._times(jobs, res, self.clock, stair, start, marks, self.profile, suffix_paused)
        # the link's rate is learnt from plain loads only: with profile entries the I/O thread's time holds their
        # decode, which the planner prices apart (BlockCost.decode_seconds_per_token)
        if self.profile is not None and res.planned_load_bytes and res.planned_load_seconds > 0 \
                and not res.decoded_entries:
            self.profile.observe_load(res.planned_load_bytes, res.planned_load_seconds,
                                      overlapped=res.recompute_seconds > 0)
        self.done = True


def _slice_rows(segs: Sequence[Segment], pieces: int) -> list[list[Segment]]:
    """``segs``' rows (in order) cut into ``pieces`` runs of near-equal length, each a list of sub-segments."""
    total = sum(s.length for s in segs)
    cuts = [total * k // pieces for k in range(1, pieces + 1)]
    out: list[list[Segment]] = []
    cur: list[Segment] = []
    o, k = 0, 0
    for s in segs:
        a = s.start
        while a < s.end:
            take = min(s.end - a, cuts[k] - o)
            cur.append(Segment(s.request, a, a + take))
            a += take
            o += take
            if o == cuts[k]:
                out.append(cur)
                cur = []
                k += 1
    return [p for p in out if p]


def _nbytes(kv: "torch.Tensor | ZipEntry") -> int:
    """Bytes a loaded entry moves to the device: its KV, or a ZipFusion entry's payload (descriptors and blocks)."""
    return kv.span.numel() if isinstance(kv, ZipEntry) else kv.numel() * kv.element_size()


def _bytes(kv: "torch.Tensor | ZipEntry") -> torch.Tensor:
    return kv.span if isinstance(kv, ZipEntry) else kv.reshape(-1).view(torch.uint8)


def _unzip(dev: torch.Tensor, entries: list, offs: list[int], sizes: list[int]
           ) -> tuple[torch.Tensor, list[int], list[int]]:
    """Entries staged in ``dev`` (uint8; entry k at byte ``offs[k]``, ``sizes[k]`` bytes, a ``ZipEntry``'s payload or
    plain KV) -> a new buffer of plain KV, entry k at ``k * raw``: one Triton launch decodes every ZipFusion block of
    the fetch on the device, with no host sync (the store checked each payload's descriptors and length; the loader,
    their block size). A plain entry among them is BF16 like the zipped ones: chunk keys carry the KV dtype."""
    from kvtide.kernels import zip_unpack  # Triton: imported by the first fetch that needs it
    raw = math.prod(entries[0].shape) * 2
    out = torch.empty(len(entries) * raw, dtype=torch.uint8, device=dev.device)
    zk = [k for k, e in enumerate(entries) if isinstance(e, ZipEntry)]
    for k, e in enumerate(entries):
        if not isinstance(e, ZipEntry):  # a plain record among zipped ones (a store written both ways)
            out[k * raw:(k + 1) * raw].copy_(dev[offs[k]:offs[k] + sizes[k]])
    e0 = entries[zk[0]]
    nb, bsz = e0.num_blocks, e0.block_size
    pad = -(-nb // 16) * 16
    desc = torch.stack([dev[offs[k]:offs[k] + nb] for k in zk])  # [E, nb], on the device
    bsizes = torch.where(desc == zip_blocks.RAW, zip_blocks.raw_nbytes(bsz), zip_blocks.compressed_nbytes(bsz))
    bsizes = bsizes.to(torch.int64)
    first = torch.tensor([offs[k] + pad for k in zk], dtype=torch.int64).to(dev.device, non_blocking=True)
    offsets = first[:, None] + bsizes.cumsum(1) - bsizes
    if len(zk) == len(entries):
        zip_unpack.unpack(dev, desc, offsets, bsz, out=out.view(torch.int16))
    else:
        dec = zip_unpack.unpack(dev, desc, offsets, bsz)
        for j, k in enumerate(zk):
            out[k * raw:(k + 1) * raw].copy_(dec[j * nb:(j + 1) * nb].reshape(-1).view(torch.uint8))
    return out, [k * raw for k in range(len(entries))], [raw] * len(entries)


def _chunk_runs(items: list[tuple[int, tuple[int, int, int, int]]], shapes: list[tuple[int, ...]], offs: list[int],
                sizes: list[int], chunk: int) -> list[tuple[int, int]]:
    """Split placed entries k = 0.. (``items[k]`` = (layer, (request, chunk index, start, end))) into runs [k, e) that
    one write can place: whole chunks of one request and layer, consecutive in token order and in the staging
    buffer (byte offsets ``offs``, sizes ``sizes``), all of one shape."""
    runs, k = [], 0
    while k < len(items):
        layer, (r, c, a, b) = items[k]
        e = k + 1
        if a == c * chunk and b == (c + 1) * chunk:
            while e < len(items):
                layer2, (r2, c2, a2, b2) = items[e]
                n = c + e - k
                if (layer2, r2, c2, a2, b2) != (layer, r, n, n * chunk, (n + 1) * chunk) or shapes[e] != shapes[k] \
                        or sizes[e] != sizes[k] or offs[e] != offs[k] + (e - k) * sizes[k]:
                    break
                e += 1
        runs.append((k, e))
        k = e
    return runs


def _record_failure(st: _Loads, r: int, layer: int, c: int, a: int, e: BaseException) -> None:
    """Entry (request ``r``, ``layer``, chunk ``c`` from position ``a``) failed. Its request falls back; a tier-level
    error (``StoreUnavailable``: the tier did not answer) also marks the tier down: no further loads from it."""
    with st.lock:
        st.failures.append(LoadFailure(r, layer, c, a, type(e).__name__, str(e)[:200]))
        st.failed_requests.add(r)
        if isinstance(e, StoreUnavailable):
            st.tier_down = True


def _row_ends(lengths: Sequence[int]) -> list[int]:
    out, s = [], 0
    for n in lengths:
        s += n
        out.append(s)
    return out


def _keep_rows(h: torch.Tensor, prev: Sequence[Segment], segs: Sequence[Segment]) -> torch.Tensor:
    """The rows of ``prev``'s output ``h`` that feed ``segs`` (same starts, each end <= its previous end).

    Slices on the device: an index built on the host and copied over would be a pageable host-to-device copy,
    which synchronises the host with the device once per staircase layer (the host would then wait out every
    layer before it launches the next one)."""
    off = {}
    o = 0
    for s in prev:
        off[s.request] = o
        o += s.length
    parts = [(off[s.request], s.length) for s in segs]
    if len(parts) == 1 and parts[0][0] == 0:
        return h[:parts[0][1]]
    return torch.cat([h[a:a + n] for a, n in parts])


class _Clock:
    """Time marks on the compute side: ``perf_counter`` on CPU; CUDA events on CUDA, read once at the end, so
    timing never makes the host wait for the device."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def between(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


_STREAMS: dict[int, Any] = {}
_POOLS: dict[int, ThreadPoolExecutor] = {}
_SHARED_LOCK = threading.Lock()


def _io_stream(device: torch.device) -> Any:
    """The I/O side's own CUDA stream per device (made once: loads of successive restorations share it)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    with _SHARED_LOCK:
        if idx not in _STREAMS:
            _STREAMS[idx] = torch.cuda.Stream(device=torch.device("cuda", idx))
        return _STREAMS[idx]


def _pool(n: int) -> ThreadPoolExecutor:
    """A shared pool of ``n`` verify/stage threads (made once per size)."""
    with _SHARED_LOCK:
        if n not in _POOLS:
            _POOLS[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="kvtide-restore-verify")
        return _POOLS[n]


class _nullctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None
