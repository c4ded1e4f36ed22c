"""Chunk allocator for the compressed KV pool: slabs of fixed-size slots, per layer or shared by all layers.

The pool's bytes are cut into equal chunks; a chunk is free, or owned by one layer (with shared slabs: by all layers)
and one *size class* and cut into slots of that class's size. Class k = a group with k compressed blocks,
``slot_bytes[k] = raw - k * B / 2``; class 0 (raw) holds pages being written and groups that stayed raw. A chunk
that empties returns at once (to its layer's private list, else the shared one). ``new_pages_fit``: how many new
pages fit in every layer at raw size; with ``reserve=True`` (what the scheduler admits by) one chunk is held back per
(layer, compressed class) slab that has no free slot. Why slabs, and what counts as waste: docs/design/pool.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import zip_blocks as zb


@dataclass(frozen=True)
class PoolGeometry:
    """Sizes that fix the allocator: all bytes, all multiples of 16 (zip_blocks.ALIGN)."""

    num_layers: int
    groups_per_page: int  # per layer: kv_heads * 2 (K and V)
    blocks_per_group: int
    block_size: int  # values per block
    chunk_bytes: int
    num_chunks: int
    private_chunks: int  # per slab owner (a layer, or all layers with shared_slabs)
    # chunks owned by a size class for all layers (one owner) instead of by a (layer, class): free slots of one
    # layer serve every layer, so there is one partly used chunk per class instead of one per layer and class
    shared_slabs: bool = False

    @property
    def num_owners(self) -> int:
        """Who owns chunks: each layer, or with ``shared_slabs`` all layers as one."""
        return 1 if self.shared_slabs else self.num_layers

    def __post_init__(self) -> None:
        if self.num_chunks < self.num_owners * self.private_chunks:
            raise ValueError(f"{self.num_chunks} chunks cannot give {self.num_owners} slab owner(s) "
                             f"{self.private_chunks} private chunk(s) each; raise the KV budget or lower private_chunks")
        if self.chunk_bytes % zb.ALIGN or self.chunk_bytes < self.slot_bytes(0):
            raise ValueError(f"chunk_bytes {self.chunk_bytes} must be a multiple of {zb.ALIGN} holding a raw group "
                             f"({self.slot_bytes(0)} B)")

    @property
    def num_classes(self) -> int:
        return self.blocks_per_group + 1

    def slot_bytes(self, k: int) -> int:
        """Bytes of a group with k compressed blocks."""
        return self.blocks_per_group * zb.raw_nbytes(self.block_size) - k * (self.block_size // 2)

    def slots_per_chunk(self, k: int) -> int:
        return self.chunk_bytes // self.slot_bytes(k)


class ChunkPool:
    """Bookkeeping only (host side): hands out byte offsets of slots; the bytes live in the caller's tensor."""

    def __init__(self, geo: PoolGeometry):
        self.geo = geo
        n, nl = geo.num_chunks, geo.num_owners
        # a layer's slab owner: itself, or 0 for every layer with shared slabs
        self._owner_of = [0] * geo.num_layers if geo.shared_slabs else list(range(geo.num_layers))
        self.owner = np.full(n, -1, dtype=np.int64)  # slab owner (layer, or 0 when shared) of each chunk, -1 free
        self.klass = np.full(n, -1, dtype=np.int64)
        self.used = np.zeros(n, dtype=np.int64)  # slots in use per chunk
        self.private_of = np.full(n, -1, dtype=np.int64)  # owner a chunk is private to, -1 shared
        self.slot_free: list[list[int]] = [[] for _ in range(n)]  # free slot indices of owned chunks
        # Private chunks: the first private_chunks * num_owners chunks, owner-major.
        self.private_free: list[list[int]] = []
        for layer in range(nl):
            ids = list(range(layer * geo.private_chunks, (layer + 1) * geo.private_chunks))
            self.private_of[ids] = layer
            self.private_free.append(ids[::-1])
        self.shared_free: list[int] = list(range(nl * geo.private_chunks, n))[::-1]
        # Non-full chunks of each (owner, class), and free class-0 slots per owner (for capacity).
        self.open: list[list[set[int]]] = [[set() for _ in range(geo.num_classes)] for _ in range(nl)]
        self.raw_free_slots = np.zeros(nl, dtype=np.int64)
        self.chunks_returned = 0  # chunks that emptied and went back to a free list
        self.shared_reuses = 0  # shared chunks taken by an owner other than the one that last held them
        self.last_owner = np.full(n, -1, dtype=np.int64)
        self._slot_bytes = [geo.slot_bytes(k) for k in range(geo.num_classes)]  # per class, looked up per slot
        self.slot_bytes_by_class = np.array(self._slot_bytes, dtype=np.int64)  # for numpy lookups
        # chunk ids as sort keys: numpy's stable sort of 16-bit integers is a radix sort, much faster than of int64
        # (an eviction may free hundreds of thousands of slots in one step; tens of thousands of chunks fit 16 bits)
        self._chunk_key = np.uint16 if n <= 1 << 16 else np.int64

    # ---- allocation -------------------------------------------------------------------------
    def _take_chunk(self, layer: int, k: int) -> int | None:
        """A free chunk for owner ``layer`` (an owner index, see ``_owner_of``) as a new slab chunk of class k."""
        if self.private_free[layer]:
            c = self.private_free[layer].pop()
        elif self.shared_free:
            c = self.shared_free.pop()
            if self.last_owner[c] not in (-1, layer):
                self.shared_reuses += 1
        else:
            return None
        self.owner[c], self.klass[c], self.used[c] = layer, k, 0
        self.last_owner[c] = layer
        self.slot_free[c] = list(range(self.geo.slots_per_chunk(k)))[::-1]
        self.open[layer][k].add(c)
        if k == 0:
            self.raw_free_slots[layer] += len(self.slot_free[c])
        return c

    def can_alloc(self, layer: int, k: int) -> bool:
        """Whether ``alloc(layer, k, n)`` would give anything: an open chunk of that slab, or a free chunk."""
        o = self._owner_of[layer]
        return bool(self.open[o][k] or self.private_free[o] or self.shared_free)

    def alloc(self, layer: int, k: int, count: int) -> np.ndarray:
        """Byte offsets of up to ``count`` slots of class k for ``layer`` (fewer if the pool runs dry)."""
        if count <= 0 or not self.can_alloc(layer, k):  # a full pool: compression asks this hundreds of times a step
            return np.zeros(0, dtype=np.int64)
        layer = self._owner_of[layer]  # from here on the slab's owner
        chunks = self.open[layer][k]
        # Fullest open chunks first (ties in set order), then new chunks. Sorted once: a chunk is visited at most
        # once per call (it fills up or the request is met), so this is the order re-picking the fullest gives.
        cand = np.fromiter(chunks, dtype=np.int64, count=len(chunks))
        queue = iter(cand[np.argsort(-self.used[cand], kind="stable")].tolist())
        taken_from: list[int] = []
        takes: list[int] = []
        slots: list[int] = []  # slot indices, in the order they are handed out
        got = 0
        while got < count:
            c = next(queue, None)
            if c is None:
                c = self._take_chunk(layer, k)
            if c is None:
                break
            free = self.slot_free[c]
            take = min(count - got, len(free))
            tail = free[len(free) - take:]  # a stack: the last `take`, handed out last first
            del free[len(free) - take:]
            tail.reverse()
            slots += tail
            taken_from.append(c)
            takes.append(take)
            got += take
            if not free:
                chunks.discard(c)
        if not got:
            return np.zeros(0, dtype=np.int64)
        # counts and offsets once for all the chunks visited (each is visited once: plain fancy indexing adds)
        self.used[taken_from] += takes
        if k == 0:
            self.raw_free_slots[layer] -= got
        base = np.repeat(np.asarray(taken_from, dtype=np.int64) * self.geo.chunk_bytes, takes)
        return base + np.asarray(slots, dtype=np.int64) * self._slot_bytes[k]

    def free(self, offsets: np.ndarray) -> None:
        """Give back slots by their byte offsets (any layers and classes). Grouped by chunk with numpy: a compression
        step frees tens of thousands of raw slots, and an eviction of hundreds of compressed pages a few hundred
        thousand slots in ~30K chunks; the per-chunk loop keeps only what must run in order (free lists, open
        slabs, returns), with no numpy scalars or small arrays per chunk."""
        offs = np.asarray(offsets, dtype=np.int64).ravel()
        if not offs.size:
            return
        cb = self.geo.chunk_bytes
        chunk = offs // cb
        order = np.argsort(chunk.astype(self._chunk_key), kind="stable")  # within a chunk: in the order given
        chunk, offs = chunk[order], offs[order]
        cuts = np.flatnonzero(np.diff(chunk)) + 1
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [chunk.size]])
        cs = chunk[starts]
        layer, k = self.owner[cs], self.klass[cs]
        assert (layer >= 0).all(), "freeing a slot of a free chunk"
        slots = ((offs - chunk * cb) // self.slot_bytes_by_class[self.klass[chunk]]).tolist()
        n = ends - starts
        self.used[cs] -= n  # chunks are distinct: plain fancy indexing
        raw = k == 0
        np.add.at(self.raw_free_slots, layer[raw], n[raw])
        emptied = self.used[cs] == 0
        # chunks in the order their last slot comes back, as one-by-one freeing would return emptied ones (and add
        # to each open slab in that order: a set's iteration order, which breaks ties in alloc, depends on it)
        groups = np.argsort(np.maximum.reduceat(order, starts), kind="stable")
        slot_free, open_ = self.slot_free, self.open
        for c, a, b, lay, kk, e in zip(cs[groups].tolist(), starts[groups].tolist(), ends[groups].tolist(),
                                       layer[groups].tolist(), k[groups].tolist(), emptied[groups].tolist()):
            slot_free[c] += slots[a:b]
            open_[lay][kk].add(c)
            if e:
                self._return_chunk(c)

    def _return_chunk(self, c: int) -> None:
        layer, k = int(self.owner[c]), int(self.klass[c])
        self.open[layer][k].discard(c)
        if k == 0:
            self.raw_free_slots[layer] -= len(self.slot_free[c])
        self.slot_free[c] = []
        self.owner[c] = self.klass[c] = -1
        self.chunks_returned += 1
        if self.private_of[c] >= 0:
            self.private_free[self.private_of[c]].append(c)
        else:
            self.shared_free.append(c)

    # ---- capacity -----------------------------------------------------------------------------
    def _reserved_per_owner(self) -> np.ndarray:
        """Per slab owner: compressed-class slabs with no free slot (each may need one chunk at the next
        compression)."""
        return np.array([sum(1 for k in range(1, self.geo.num_classes) if not self.open[o][k])
                         for o in range(self.geo.num_owners)], dtype=np.int64)

    def new_pages_fit(self, reserve: bool = True) -> int:
        """How many new raw pages (``groups_per_page`` class-0 slots in every layer) fit now."""
        g = self.geo
        s0 = g.slots_per_chunk(0)
        per_page = g.groups_per_page * (g.num_layers // g.num_owners)  # class-0 slots a page takes of each owner
        priv = np.array([len(p) for p in self.private_free], dtype=np.int64)
        extra = self._reserved_per_owner() if reserve else np.zeros(g.num_owners, dtype=np.int64)
        shared = len(self.shared_free)

        def fits(n: int) -> bool:
            need_slots = np.maximum(0, n * per_page - self.raw_free_slots)
            chunks = -(-need_slots // s0) + extra
            return int(np.maximum(0, chunks - priv).sum()) <= shared

        if not fits(0):
            return 0
        lo = 0
        hi = int((shared + priv.sum()) * s0 // per_page + self.raw_free_slots.max() // per_page) + 1
        while lo < hi:  # largest n with fits(n); fits is monotone in n
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ---- reporting ------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Chunk counts and waste. Free class-0 slots are not waste (new pages use them: they count in
        ``new_pages_fit``); free slots of compressed classes and chunk tails are, until compression fills them."""
        g = self.geo
        owned = self.owner >= 0
        free_slot = [0] * g.num_classes
        tail_bytes = 0
        for c in np.nonzero(owned)[0].tolist():
            k = int(self.klass[c])
            free_slot[k] += len(self.slot_free[c]) * g.slot_bytes(k)
            tail_bytes += g.chunk_bytes - g.slots_per_chunk(k) * g.slot_bytes(k)
        total = g.num_chunks * g.chunk_bytes
        waste = sum(free_slot[1:]) + tail_bytes
        return {
            "chunk_bytes": g.chunk_bytes,
            "num_chunks": g.num_chunks,
            "chunks_owned": int(owned.sum()),
            "chunks_shared_free": len(self.shared_free),
            "chunks_private_free": sum(len(p) for p in self.private_free),
            "chunks_returned": self.chunks_returned,
            "shared_chunk_reuses_across_layers": self.shared_reuses,
            "free_raw_slot_bytes": free_slot[0],
            "free_compressed_slot_bytes": sum(free_slot[1:]),
            "chunk_tail_bytes": tail_bytes,
            "fragmentation": waste / total if total else 0.0,
        }
