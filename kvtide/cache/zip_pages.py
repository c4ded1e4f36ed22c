"""Compressed paged KV storage (ZipFusion III-B, III-D): one byte pool per device, lookup tables per layer.

STORAGE CONTRACT (what attention backends and kernels read; keep to it exactly)
-------------------------------------------------------------------------------
* ``pool``: ONE contiguous uint8 tensor per device holding every KV byte of every layer (view it as int16 or
  int32 for wide loads; its length is a multiple of 16). It is cut into chunks of ``chunk_bytes``; a chunk
  belongs to one layer at a time, or with shared slabs to one size class of every layer (see
  :mod:`kvtide.cache.pool`).
* A *group* is (layer, page, kv_head, K|V): ``page_size x head_dim`` BF16 values in the pool's value order
  (``geo.value_order``, :mod:`kvtide.cache.zip_order`: "token" = [token, dim], value index = token * head_dim + dim;
  "mma" = the CUDA kernel's fragment order), cut into ``blocks_per_group`` blocks of ``block_size`` values
  (``block_size`` divides ``page_size * head_dim``; head_dim 64, page 16, block 512 -> 2 blocks of 8 tokens).
* ``group_start[layer]``: int64 [num_page_ids, kv_heads, 2] byte offset in ``pool`` of the group's first
  block (index 0 = K, 1 = V), 16-byte aligned. ``group_desc[layer]``: uint8 [num_page_ids, kv_heads, 2,
  blocks_per_group], the format's descriptors (:mod:`kvtide.cache.zip_format`; ``0xFF`` = raw block,
  else compressed with base 2 * desc; version 2 adds ``0x80 | b/2`` zero-escape blocks). Both tables are
  also whole tensors (``group_start_all`` [L, ...], ``group_desc_all`` [L, ...]) indexed by layer first.
* The blocks of a group follow each other from its start: block j is at start + sum of the sizes of
  blocks 0..j-1 (raw 2 * block_size bytes, compressed 1.5 * block_size bytes), the in-block byte
  arrangement being zip_format's. A raw group is therefore just its 2 * page_size * head_dim bytes of BF16
  values in [token, dim] order.
* Indexing is by the engine's page id, which never changes; entries of pages not held are stale (0 / 0xFF)
  and must not be read. ``format_version`` says which descriptors may appear.
* Life of a page: allocated RAW (all descriptors 0xFF, all values +0.0) in every layer; new tokens' K/V are written into its
  raw bytes (``write``). When it fills, ``compress`` (called after the step's attention reads; the engine's decode
  steps split it into ``compress_begin`` and ``compress_finish`` one step later, the page raw meanwhile) re-encodes it
  into a new place of its size class and frees the raw bytes; groups whose blocks all stayed raw keep their
  place; if no destination is free, and evicting cached pages (``evictor``, the engine's block manager) frees
  none, the group is compressed in place (through a staging copy, since ``zip_blocks.pack`` must not alias its
  source). No uncompressed copy of a compressed page remains.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.profiler import record_function

from . import zip_blocks as zb
from . import zip_order
from . import zip_format as zf
from .pool import ChunkPool, PoolGeometry

RAW, COMPRESSED, ABSENT = 0, 1, -1


@dataclass(frozen=True)
class ZipGeometry:
    """Model and format shape of the pool; checked here so a bad config fails before memory is taken."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    block_size: int = 512
    format_version: int = zf.FORMAT_VERSION
    value_order: str = "token"  # value order inside a group (kvtide.cache.zip_order): "token" or "mma"

    def __post_init__(self) -> None:
        zf._check_version(self.format_version)
        zf._check_block_size(self.block_size)
        if self.group_values % self.block_size:
            raise ValueError(f"CacheConfig.block_size {self.block_size} does not divide a page group of "
                             f"page_size x head_dim = {self.page_size} x {self.head_dim} = {self.group_values} values")
        zip_order.check(self.value_order, self.page_size, self.head_dim, self.block_size)

    @property
    def group_values(self) -> int:
        return self.page_size * self.head_dim

    @property
    def blocks_per_group(self) -> int:
        return self.group_values // self.block_size

    @property
    def groups_per_page(self) -> int:
        return self.num_kv_heads * 2

    @property
    def raw_group_bytes(self) -> int:
        return self.group_values * 2

    @property
    def raw_page_bytes(self) -> int:
        """One page across all layers, uncompressed (what the fixed-tensor cache spends on it)."""
        return self.num_layers * self.groups_per_page * self.raw_group_bytes


def auto_chunk_bytes(geo: ZipGeometry, budget: int) -> int:
    """Chunks of about 4..256 raw groups: small enough that each (layer, class) slab's partly used chunk
    stays a small share of the budget (about 1/16 in all), large enough to keep bookkeeping cheap.
    The size is a multiple of both the raw and the fully compressed slot (no tail in the two classes
    nearly all groups take), and of every class's slot when that fits the target."""
    nb, classes = geo.blocks_per_group, geo.blocks_per_group + 1
    slots = int(min(256, max(4, budget // (geo.raw_group_bytes * geo.num_layers * classes * 16))))
    unit = geo.block_size // 2  # every slot size is a whole number of half blocks
    target = slots * geo.raw_group_bytes // unit
    step = 12 * nb  # lcm(4 nb, 3 nb): raw and fully compressed slots
    target = max(step, target - target % step)
    common = math.lcm(*(4 * nb - k for k in range(classes)))
    if common <= target:
        target -= target % common
    return target * unit


def _by_class(idx: np.ndarray, cls: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(k, the entries of ``idx`` whose group has class k, in their order) for each class present, ascending."""
    c = cls[idx]
    order = np.argsort(c, kind="stable")
    c = c[order]
    bounds = [0, *(np.flatnonzero(c[1:] != c[:-1]) + 1).tolist(), len(c)]
    idx = idx[order]
    return [(int(c[a]), idx[a:b]) for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class PoolKernels:
    """Device kernels a pool on a GPU runs instead of its torch code, with the same bytes out: the fused write and
    the encode's analyse and pack passes. Handed in by whoever builds the pool (the engine binds
    ``kvtide.kernels``' Triton kernels), so this package imports no kernel module."""

    write_pool: Callable[..., None]  # kv_write.write_pool(pool16, group_start, stored_pos, k, v, slot_mapping, page_size)
    analyze: Callable[..., torch.Tensor]  # zip_encode.analyze(blocks_bf16, block_size, version) -> descriptors
    pack: Callable[..., None]  # zip_encode.pack(blocks_bf16, desc, offsets, pool, block_size, check=...)


@dataclass
class _PendingCompression:
    """A compression begun on the device (staged bytes, block descriptors, group classes on their way to the host)."""

    pids: list[int]
    generations: np.ndarray  # the pages' allocation counts when begun: a page freed and reused since is skipped
    src: torch.Tensor  # int16 [L, n, H, 2, page_size * head_dim]
    desc: torch.Tensor  # uint8 [L, n, H, 2, blocks_per_group]
    classes: torch.Tensor  # int8 [L, n, H, 2] (pinned host memory on CUDA)
    event: torch.cuda.Event | None
    done: int = 0  # pages [0, done) finished (compress_finish may take a job a few pages at a time)


class ZipPagedKV:
    """The pool, the lookup tables, and the operations the engine needs: allocate/free pages, write new
    tokens, compress filled pages, rebuild pages as BF16, capacity and statistics."""

    def __init__(self, geo: ZipGeometry, budget_bytes: int, device: torch.device | str = "cpu",
                 chunk_bytes: int | None = None, private_chunks: int = 1, shared_slabs: bool = True,
                 kernels: PoolKernels | None = None):
        self.geo = geo
        self.device = torch.device(device)
        self.kernels = kernels  # device kernels for write and compression (None: the torch code)
        chunk_bytes = chunk_bytes or auto_chunk_bytes(geo, budget_bytes)
        num_chunks = budget_bytes // chunk_bytes
        if num_chunks < 1:
            raise ValueError(f"KV budget {budget_bytes} B is smaller than one chunk ({chunk_bytes} B)")
        self.alloc = ChunkPool(PoolGeometry(geo.num_layers, geo.groups_per_page, geo.blocks_per_group,
                                            geo.block_size, chunk_bytes, num_chunks, private_chunks, shared_slabs))
        self.pool = torch.zeros(num_chunks * chunk_bytes, dtype=torch.uint8, device=self.device)
        self._pool16 = self.pool.view(torch.int16)
        # Raw slots start on raw-group boundaries when a chunk holds a whole number of them (auto_chunk_bytes
        # makes it so): raw groups are then rows of this view, zeroed and staged by row index (one index per
        # 2 * page_size * head_dim bytes instead of one per value: a 65-page step built a 545 MB index twice).
        rb = geo.raw_group_bytes
        self._raw_rows = self.pool.view(-1, rb) if chunk_bytes % rb == 0 else None
        # Page ids: enough for a pool full of fully compressed pages.
        min_page = geo.num_layers * geo.groups_per_page * geo.blocks_per_group * zb.compressed_nbytes(geo.block_size)
        self.num_page_ids = max(1, self.pool.numel() // min_page)
        shape = (geo.num_layers, self.num_page_ids, geo.num_kv_heads, 2)
        self.group_start_all = torch.zeros(shape, dtype=torch.int64, device=self.device)
        self.group_desc_all = torch.full(shape + (geo.blocks_per_group,), zb.RAW, dtype=torch.uint8, device=self.device)
        self.group_start = list(self.group_start_all.unbind(0))
        self.group_desc = list(self.group_desc_all.unbind(0))
        self._starts_host = np.zeros(shape, dtype=np.int64)  # mirror, for freeing without a device sync
        self._class_host = np.zeros(shape, dtype=np.int8)  # compressed blocks per group, for statistics
        self._generation = np.zeros(self.num_page_ids, dtype=np.int64)  # allocations of each page id so far
        # groups each page holds compressed in place (in a raw-sized slot) and the bytes that wastes, all layers:
        # what the pool loses to in-place compression now (the counters count every such group ever)
        self._in_place_groups = np.zeros(self.num_page_ids, dtype=np.int64)
        self._in_place_bytes = np.zeros(self.num_page_ids, dtype=np.int64)
        self._pending: list[_PendingCompression] = []  # begun, not finished (compress_begin / compress_finish)
        # evictor(n, keep): evicts up to n cached pages (never those in keep), returns how many; set by the engine's
        # block manager (BlockManager.evict_lru). A compression that finds no slot of a group's class evicts before
        # it compresses in place: a group in place keeps a raw-size slot for the life of its page.
        self.evictor = None
        self._finishing: set[int] = set()  # pages of the running _finish: never evicted under it
        self.state = np.full(self.num_page_ids, ABSENT, dtype=np.int8)
        self._value_idx = torch.arange(geo.group_values, device=self.device)
        self._mma = geo.value_order != "token"
        # stored position of each natural (token * head_dim + dim) value, K and V: [2, page_size * head_dim]
        self._stored_pos = zip_order.natural_to_stored(geo.value_order, geo.page_size, geo.head_dim, self.device)
        # write: one kernel launch per layer on a GPU (``kernels.write_pool``) instead of ~5 torch ops; the torch
        # code stays on the CPU (the reference, and fast enough there). Tests set it on a CPU pool given kernels to
        # run the kernel in the Triton interpreter.
        self.fused_write = kernels is not None and self.device.type == "cuda"
        self.counters = {"pages_compressed": 0, "pages_allocated": 0, "groups_in_place": 0, "in_place_waste_bytes": 0,
                         "evictions_for_compression": 0,
                         "k_stored_bytes": 0, "v_stored_bytes": 0, "k_raw_bytes": 0, "v_raw_bytes": 0}

    @property
    def block_size(self) -> int:
        return self.geo.block_size

    @property
    def format_version(self) -> int:
        return self.geo.format_version

    @property
    def raw_capacity_pages(self) -> int:
        """Pages the same bytes hold without compression (the fixed-tensor cache's figure)."""
        return self.pool.numel() // self.geo.raw_page_bytes

    # ---- capacity and page life -------------------------------------------------------------------
    def free_pages(self, reserve: bool = True) -> int:
        """New pages that fit now at their raw size across all layers (see ChunkPool.new_pages_fit)."""
        return self.alloc.new_pages_fit(reserve)

    def alloc_pages(self, pids: list[int]) -> None:
        """Give each page raw slots in every layer; the caller checked ``free_pages(reserve=False)``."""
        if not pids:
            return
        with record_function("kvtide.zip_alloc_pages"):  # a profile's name for this host work
            self._alloc_pages(pids)

    def _alloc_pages(self, pids: list[int]) -> None:
        g = self.geo
        n = len(pids) * g.groups_per_page
        if self.alloc.geo.num_owners == 1:
            # one slab owner (shared slabs): one pass over its open chunks for all layers, which hands out the slots
            # one call per layer would, in the same order; each call sorts every open raw chunk, and with thousands
            # of them (raw slots freed by compression all over the pool) one call per layer is a large share of a
            # page step's host time
            flat = self.alloc.alloc(0, 0, n * g.num_layers)
            taken = [flat[i * n:(i + 1) * n] for i in range(g.num_layers)] if len(flat) == n * g.num_layers \
                else [flat]
        else:
            taken = [self.alloc.alloc(layer, 0, n) for layer in range(g.num_layers)]
        if len(taken) < g.num_layers or any(len(offs) < n for offs in taken):
            self.alloc.free(np.concatenate(taken))
            raise MemoryError("KV pool ran out while allocating pages (capacity check skipped?)")
        self._starts_host[:, pids] = np.stack(taken).reshape(g.num_layers, len(pids), g.num_kv_heads, 2)
        idx = self._to_device(np.asarray(pids, dtype=np.int64))
        starts = self._to_device(self._starts_host[:, pids])
        self.group_start_all[:, idx] = starts
        self.group_desc_all.index_fill_(1, idx, zb.RAW)  # setitem would copy a CPU scalar: a host sync on CUDA
        # Zero the new raw groups: slots hold a previous owner's bytes (compressed codes read as BF16 can be
        # NaN), and readers that load whole pages mask the unwritten tail, which 0 * NaN would defeat.
        self._raw_groups(starts, zero=True)
        self.state[pids] = RAW
        self._generation[pids] += 1
        self.counters["pages_allocated"] += len(pids)

    def release_pages(self, pids: list[int]) -> None:
        """Free every byte the pages hold, in all layers."""
        if not pids:
            return
        with record_function("kvtide.zip_release_pages"):
            self._release_pages(pids)

    def _release_pages(self, pids: list[int]) -> None:
        state = self.state[pids]
        assert (state != ABSENT).all(), "releasing a page that holds no storage"
        comp = np.asarray(pids)[state == COMPRESSED]
        if comp.size:
            self._count_stored(comp.tolist(), -1)
        self.alloc.free(self._starts_host[:, pids])
        self.state[pids] = ABSENT
        self._in_place_groups[pids] = 0
        self._in_place_bytes[pids] = 0

    # ---- data path -------------------------------------------------------------------------------
    def write_rows(self, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer-independent part of :meth:`write`'s index: (page of each token, its value offsets within a
        group [T, 1, 1, D], or [T, 1, 2, D] in the "mma" order, where K and V differ). Plan it once per step and
        pass it to every layer's write (plan/run split): a layer's write then issues ~5 ops instead of ~9, which
        matters where each op is a kernel launch; on the CPU the copy dominates."""
        g = self.geo
        rel = ((slot_mapping % g.page_size) * g.head_dim)[:, None, None, None] + self._value_idx[: g.head_dim]
        if self._mma:
            rel = self._stored_pos[:, rel[:, 0, 0]].permute(1, 0, 2)[:, None]  # [T, 1, 2, D]
        return slot_mapping // g.page_size, rel

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
              rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Store new tokens' K/V ([T, kv_heads, head_dim]) into their (raw) pages; slot = page * page_size + offset.
        ``rows``: :meth:`write_rows` of the same ``slot_mapping``, planned once for all layers (unused by the fused
        write, which computes each value's place in its one launch)."""
        if self.fused_write:
            self.kernels.write_pool(self._pool16, self.group_start[layer], self._stored_pos if self._mma else None,
                                k, v, slot_mapping, self.geo.page_size)
            return
        pages, rel = self.write_rows(slot_mapping) if rows is None else rows
        idx = (self.group_start[layer][pages] // 2)[..., None] + rel  # [T, H, 2, D]
        vals = torch.stack([k, v], dim=2).to(torch.bfloat16).view(torch.int16)  # [T, H, 2, D]
        self._pool16[idx.reshape(-1)] = vals.reshape(-1)

    def read_pages(self, layer: int, pids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """BF16 [n, 2, page_size, kv_heads, head_dim] (the dense cache's layout) of pages ``pids`` in ``layer``."""
        g = self.geo
        n = pids.numel()
        starts = self.group_start[layer][pids].reshape(-1)
        desc = self.group_desc[layer][pids].reshape(-1, g.blocks_per_group)
        offsets = zb.offsets_from_starts(starts, desc, g.block_size)
        bits = zb.unpack(self.pool, desc, offsets, g.block_size)
        if self._mma:
            bits = zip_order.to_natural(bits.view(n, g.num_kv_heads, 2, -1), g.value_order, g.page_size, g.head_dim)
        vals = bits.view(torch.bfloat16).view(n, g.num_kv_heads, 2, g.page_size, g.head_dim).permute(0, 2, 3, 1, 4)
        if out is None:
            return vals.contiguous()
        out.copy_(vals)
        return out

    def compress(self, pids: list[int]) -> None:
        """Compress filled raw pages (after the step's attention reads): every layer, K and V, in one pass."""
        self.compress_begin(pids)
        self.compress_finish()

    def compress_begin(self, pids: list[int]) -> None:
        """First half of :meth:`compress`, for the engine's decode loop: stage the pages' bytes and classify their
        blocks on the device now (enqueued after this step's attention reads), bring the classes to pinned host
        memory without waiting. :meth:`compress_finish`, called once the next step's forward is enqueued, places
        them on the host while the device runs that step: the host placement (the larger share of a page step's
        host time at a large batch) then overlaps device work instead of adding to the step. Until then the pages stay raw and readable;
        one released (or released and allocated again) meanwhile is skipped."""
        pending = {p: g for job in self._pending for p, g in zip(job.pids[job.done:], job.generations[job.done:].tolist())}
        pids = [p for p in pids if self.state[p] == RAW and pending.get(p) != self._generation[p]]
        if not pids:
            return
        nb, bsz = self.geo.blocks_per_group, self.geo.block_size
        idx = self._to_device(np.asarray(pids, dtype=np.int64))
        # Staging copy of the raw groups: pack may then write anywhere, the groups' own slots included.
        src = self._raw_groups(self.group_start_all[:, idx])  # [L, n, H, 2, PD]
        desc = self._analyze(src.reshape(-1, bsz)).view(*src.shape[:4], nb)
        ncomp = (desc != zb.RAW).sum(-1, dtype=torch.int8)  # class of each group
        event = None
        if self.device.type == "cuda":
            cls = torch.empty(ncomp.shape, dtype=torch.int8, pin_memory=True)
            cls.copy_(ncomp, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            cls = ncomp
        self._pending.append(_PendingCompression(pids, self._generation[pids].copy(), src, desc, cls, event))

    @property
    def pages_pending(self) -> int:
        """Pages begun (:meth:`compress_begin`) and not finished yet."""
        return sum(len(job.pids) - job.done for job in self._pending)

    def compress_finish(self, max_pages: int | None = None) -> None:
        """Second half of :meth:`compress`: place begun compressions, pack them, switch the tables over; oldest
        first, at most ``max_pages`` pages (None: all). Why a limit: in a batch decoding in lockstep every sequence
        fills a page in the same step, and placing all of them (host work per page) in one step makes that step
        host-bound under async scheduling; a few pages per step hide behind the device.
        Pages not yet finished stay raw and readable, as between the two halves."""
        budget = math.inf if max_pages is None else max_pages
        while self._pending and budget > 0:
            job = self._pending[0]
            if job.event is not None:
                with record_function("kvtide.zip_compress_wait"):
                    job.event.synchronize()  # normally long done: the step that began it has synced since
            a = job.done
            b = len(job.pids) if budget >= len(job.pids) - a else a + int(budget)
            job.done = b
            if b == len(job.pids):
                self._pending.pop(0)
            live = [i for i in range(a, b) if self.state[job.pids[i]] == RAW
                    and self._generation[job.pids[i]] == job.generations[i]]
            budget -= len(live)
            if not live:
                continue
            src, desc, cls = job.src, job.desc, job.classes.numpy()
            if len(live) < len(job.pids):
                sel = self._to_device(np.asarray(live, dtype=np.int64))
                src, desc, cls = src[:, sel], desc[:, sel], cls[:, live]
            self._finish(np.asarray(job.pids)[live].tolist(), src, desc, cls)

    def _finish(self, pids: list[int], src: torch.Tensor, desc: torch.Tensor, cls: np.ndarray) -> None:
        g = self.geo
        bsz = g.block_size
        old_h = self._starts_host[:, pids]
        new_h = old_h.copy()
        in_place = []
        self._finishing = set(pids)
        try:
            with record_function("kvtide.zip_place"):
                for layer in range(g.num_layers):
                    in_place += self._place(layer, cls[layer].reshape(-1), old_h[layer].reshape(-1),
                                            new_h[layer].reshape(-1)) or []  # (a test's reference _place: None)
        finally:
            self._finishing = set()
        if in_place:  # group index // (heads * 2) is the page's place in ``pids``
            at = np.asarray(pids, dtype=np.int64)[np.concatenate([gr for gr, _ in in_place]) // (g.num_kv_heads * 2)]
            np.add.at(self._in_place_groups, at, 1)
            np.add.at(self._in_place_bytes, at, np.concatenate([w for _, w in in_place]))
        new = self._to_device(new_h)
        packed = np.flatnonzero(cls.reshape(-1) > 0)  # groups stored compressed, in [L, n, H, 2] order
        if packed.size:
            with record_function("kvtide.zip_pack"):
                self._check_starts(new_h.reshape(-1)[packed], cls.reshape(-1)[packed])
                sel = self._to_device(packed)  # an index, not a mask: a mask costs a host sync (nonzero) per use
                pdesc = desc.reshape(-1, g.blocks_per_group).index_select(0, sel)  # [m, nb]
                offsets = zb.offsets_from_starts(new.reshape(-1).index_select(0, sel), pdesc, bsz)
                self._pack(src.reshape(-1, g.group_values).index_select(0, sel).reshape(-1, bsz), pdesc, offsets)
        idx = self._to_device(np.asarray(pids, dtype=np.int64))
        self.group_start_all[:, idx] = new
        self.group_desc_all[:, idx] = desc
        self._starts_host[:, pids] = new_h
        self._class_host[:, pids] = cls
        self.state[pids] = COMPRESSED
        self.counters["pages_compressed"] += len(pids)
        self._count_stored(pids, +1)

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        """A host array on the pool's device without a host sync. A copy from pageable memory waits for the stream,
        i.e. in compress_finish for the whole forward the step just enqueued; on CUDA the array goes through pinned
        memory, non-blocking. On the CPU the tensor shares the array's memory (callers pass arrays they keep as is)."""
        t = torch.from_numpy(np.ascontiguousarray(a))
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _check_starts(self, starts: np.ndarray, cls: np.ndarray) -> None:
        """What pack would check on the device (aligned, inside the pool), on the host: groups of class k end at
        start + slot_bytes(k). Cheap here; on the device it cost three host syncs per compressing step."""
        end = starts + self.alloc.slot_bytes_by_class[cls]
        if (starts % zb.ALIGN).any() or starts.min() < 0 or end.max() > self.pool.numel():
            raise AssertionError("compressed group placed outside the pool or unaligned")

    def _raw_groups(self, starts: torch.Tensor, zero: bool = False) -> torch.Tensor | None:
        """int16 values [*starts.shape, page_size * head_dim] of the raw groups at byte offsets ``starts`` (a copy),
        or with ``zero`` set them to +0.0 instead."""
        if self._raw_rows is not None:
            rows = (starts // self.geo.raw_group_bytes).reshape(-1)
            if zero:
                self._raw_rows.index_fill_(0, rows, 0)
                return None
            return self._raw_rows.index_select(0, rows).view(torch.int16).view(*starts.shape, -1)
        idx = (starts // 2)[..., None] + self._value_idx
        if zero:
            self._pool16[idx.reshape(-1)] = 0
            return None
        return self._pool16[idx]

    def _place(self, layer: int, cls: np.ndarray, old: np.ndarray,
               new: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Destinations for one layer's groups of class ``cls`` now at ``old``, written into ``new`` (a view); returns
        the groups compressed in place, with the bytes each wastes (:meth:`_in_place`).

        First one allocation per class for all the groups; if the pool runs short, the rest go raw chunk by raw
        chunk, and each raw slot is freed as soon as its group has a destination, so a chunk emptied by one batch
        can take the next batch's compressed groups: a nearly full pool still compresses. The data is safe
        meanwhile: every source is already in the staging copy. When no slab of the classes left can give a slot
        (no open chunk, no free chunk), cached pages are evicted (``evictor``) until one can; once none are left,
        every later allocation would come back empty and every free would free nothing, so the rest is compressed
        in place at once. Why evict first: a group in place holds a raw-size slot (up to a quarter more) as long as
        its page lives, while the cached pages would go first anyway when new pages need room: a full pool then
        keeps decoding where it would preempt (docs/design/pool.md).
        """
        todo = np.flatnonzero(cls > 0)
        if not todo.size:
            return []
        placed, short, left = [], [], []  # placed groups, those that found no slot, and their classes
        for k, sel in _by_class(todo, cls):
            got = self._alloc_into(layer, k, sel, new)
            placed.append(got)
            if len(got) < len(sel):
                short.append(sel[len(got):])
                left.append(k)
        self.alloc.free(old[np.concatenate(placed)])
        if not short:
            return []
        todo = np.sort(np.concatenate(short))
        if not self._room_for(layer, left):  # the common case in a full pool: no chunk came back, nothing to evict
            return [self._in_place(todo, cls)]
        in_place = []
        chunk = old[todo] // self.alloc.geo.chunk_bytes
        order = np.argsort(chunk, kind="stable")
        segs = np.split(todo[order], np.flatnonzero(np.diff(chunk[order])) + 1)
        for i, seg in enumerate(segs):
            if not self._room_for(layer, left):
                in_place.append(self._in_place(np.concatenate(segs[i:]), cls))
                return in_place
            placed = []
            for k, sel in _by_class(seg, cls):
                got = self._alloc_into(layer, k, sel, new)
                while len(got) < len(sel) and self._room_for(layer, [k]):  # evicting cached pages gave room
                    more = self._alloc_into(layer, k, sel[len(got):], new)
                    if not len(more):
                        break
                    got = np.concatenate([got, more])
                placed.append(got)
                if len(got) < len(sel):  # no destination left: compress in place (the raw slot keeps its size)
                    in_place.append(self._in_place(sel[len(got):], cls))
            self.alloc.free(old[np.concatenate(placed)])  # the segment's raw chunk may empty for the next one
        return in_place

    EVICT_BATCH = 4  # cached pages evicted per try when a compression is short of a class's slots

    def _room_for(self, layer: int, classes: list[int]) -> bool:
        """Whether some class in ``classes`` can give ``layer`` a slot, evicting cached pages (LRU first, through
        ``evictor``) until one can or none are left."""
        while not any(self.alloc.can_alloc(layer, k) for k in classes):
            if self.evictor is None or not self.evictor(self.EVICT_BATCH, self._finishing):
                return False
            self.counters["evictions_for_compression"] += 1
        return True

    def _alloc_into(self, layer: int, k: int, sel: np.ndarray, new: np.ndarray) -> np.ndarray:
        """Slots of class k for groups ``sel`` (as many as the pool gives), written into ``new``; the groups placed."""
        offs = self.alloc.alloc(layer, k, len(sel))
        got = sel[: len(offs)]
        new[got] = offs
        return got

    def _in_place(self, groups: np.ndarray, cls: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Count groups compressed where they are (their raw slot keeps its size); (groups, bytes each wastes)."""
        self.counters["groups_in_place"] += len(groups)
        waste = self.geo.raw_group_bytes - self.alloc.slot_bytes_by_class[cls[groups]]
        self.counters["in_place_waste_bytes"] += int(waste.sum())
        return np.asarray(groups, dtype=np.int64), waste.astype(np.int64)

    def _analyze(self, blocks: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and self.device.type == "cuda":
            return self.kernels.analyze(blocks.view(torch.bfloat16), self.geo.block_size,
                                        self.geo.format_version).view(-1)
        return zb.analyze(blocks, self.geo.format_version)

    def _pack(self, blocks: torch.Tensor, desc: torch.Tensor, offsets: torch.Tensor) -> None:
        if self.kernels is not None and self.device.type == "cuda":
            self.kernels.pack(blocks.view(torch.bfloat16).reshape(desc.shape[0], -1), desc, offsets, self.pool,
                              self.geo.block_size, check=False)  # placed by the allocator, checked on the host
        else:
            zb.pack(blocks, desc.reshape(-1), offsets.reshape(-1), self.pool)

    # ---- statistics ------------------------------------------------------------------------------
    def _count_stored(self, pids: list[int], sign: int) -> None:
        """From the host mirror of group classes: no device sync (a group of class k stores k blocks compressed)."""
        ncomp = self._class_host[:, pids].sum(axis=(0, 1, 2), dtype=np.int64)  # compressed blocks, [K, V]
        raw = len(pids) * self.geo.num_layers * self.geo.num_kv_heads * self.geo.raw_group_bytes
        per_kind = raw - ncomp * (zb.raw_nbytes(self.geo.block_size) - zb.compressed_nbytes(self.geo.block_size))
        for kind, stored in zip("kv", per_kind.tolist()):
            self.counters[f"{kind}_stored_bytes"] += sign * int(stored)
            self.counters[f"{kind}_raw_bytes"] += sign * raw

    def stats(self) -> dict:
        """Compression ratios of the compressed pages held now (stored / raw bytes; lower is better),
        pages by state, capacity in pages with and without compression, and the allocator's waste."""
        c = self.counters
        held = int((self.state != ABSENT).sum())
        fit = self.free_pages()
        ratio = {kind: (c[f"{kind}_stored_bytes"] / c[f"{kind}_raw_bytes"]) if c[f"{kind}_raw_bytes"] else 1.0
                 for kind in "kv"}
        return {
            "compress": True,
            "format_version": self.geo.format_version,
            "block_size": self.geo.block_size,
            "k_ratio": ratio["k"],
            "v_ratio": ratio["v"],
            "pages_held": held,
            "pages_compressed_held": int((self.state == COMPRESSED).sum()),
            "pages_compressed_total": c["pages_compressed"],
            "groups_in_place": c["groups_in_place"],  # every group ever compressed in place
            "in_place_waste_bytes": c["in_place_waste_bytes"],
            "groups_in_place_held": int(self._in_place_groups.sum()),  # held now, in pages the pool still holds
            "in_place_waste_bytes_held": int(self._in_place_bytes.sum()),
            "evictions_for_compression": c["evictions_for_compression"],  # evictor calls by short compressions
            "free_pages": fit,
            "capacity_pages": held + fit,
            "capacity_pages_uncompressed": self.raw_capacity_pages,
            "pool_bytes": self.pool.numel(),
            **self.alloc.stats(),
        }
