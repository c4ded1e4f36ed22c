"""In-process tier in page-locked host memory: a load's bytes go to the device by DMA, with no staging copy.

Why: with records as ordinary bytes, every loaded byte crosses host memory three times before it reaches the GPU
(the checksum reads it, a copy into a pinned staging buffer reads and writes it, the device copy reads it), and
that path can run below the link it serves (``bench/load_path.py``). Here records are built in and read from
page-locked slabs, so a load is the checksum (CPU) then one host-to-device copy straight from the record: what a
serving engine's CPU tier does, and what a NIC that DMAs into pinned receive buffers gives a remote tier.

Memory: ``capacity_bytes`` of slabs (``slab_bytes`` each, allocated as the tier fills), records placed first-fit
at 64-byte offsets (``PAYLOAD_ALIGN``: payloads stay aligned). Eviction is LRU over record bytes, like
``MemoryStore``; a record the slabs cannot place for fragmentation evicts further.

Safety of zero-copy reads: ``fetch`` hands out views of the slabs under a lease; a record evicted, deleted or
overwritten while leased keeps its bytes until every lease on it is released, and ``Fetched.release(after=ev)``
defers that until ``ev.query()`` (the device copy reading it has finished). Every other read path (``get_entry``,
``get_layers``) copies the bytes out under the lock, so it never sees a slot being reused.

Without CUDA the slabs are ordinary memory (``pinned`` is False) with the same allocator and leases, so the CPU
tests cover all of it but the DMA.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from kvtide.store.base import (
    PAYLOAD_ALIGN,
    ChunkMissing,
    Fetched,
    KVStore,
    StoreError,
    encode_record,
)
from kvtide.store.keys import ChunkKey
from kvtide.store.memory import oversize

DEFAULT_SLAB_BYTES = 256 << 20


def _round_up(n: int) -> int:
    return -(-n // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


@dataclass(eq=False)
class _Rec:
    """One record's place in a slab; ``leases`` readers may still use it, ``dead``: no longer in the index."""

    slab: int
    off: int
    size: int  # the record's bytes
    span: int  # bytes taken in the slab (size rounded up to PAYLOAD_ALIGN)
    leases: int = 0
    dead: bool = False


class SlabArena:
    """Slabs of host memory handed out as aligned extents, first fit; freed extents coalesce. Not thread-safe
    (the store calls it under its lock)."""

    def __init__(self, capacity_bytes: int, slab_bytes: int = DEFAULT_SLAB_BYTES, pin: bool | None = None) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be an int > 0, got {capacity_bytes!r}")
        if not isinstance(slab_bytes, int) or slab_bytes <= 0:
            raise ValueError(f"slab_bytes must be an int > 0, got {slab_bytes!r}")
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        if self.pin and not torch.cuda.is_available():
            raise ValueError("pin=True needs CUDA (page-locked memory is a CUDA host allocation)")
        self.slab_bytes = _round_up(min(slab_bytes, capacity_bytes))
        self.max_slabs = -(-capacity_bytes // self.slab_bytes)
        self.slabs: list[torch.Tensor] = []
        self.views: list[np.ndarray] = []  # numpy views of the slabs: memoryview slices without torch calls
        self._free: list[list[tuple[int, int]]] = []  # per slab: sorted (offset, length) of free extents

    @property
    def reserved_bytes(self) -> int:
        return len(self.slabs) * self.slab_bytes

    def alloc(self, size: int) -> _Rec | None:
        """An extent for ``size`` bytes, or None when no slab has room and no slab may be added."""
        span = _round_up(max(size, 1))
        if span > self.slab_bytes:
            return None
        for si, free in enumerate(self._free):
            for k, (off, length) in enumerate(free):
                if length >= span:
                    if length == span:
                        del free[k]
                    else:
                        free[k] = (off + span, length - span)
                    return _Rec(si, off, size, span)
        if len(self.slabs) >= self.max_slabs:
            return None
        slab = torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=self.pin)
        self.slabs.append(slab)
        self.views.append(slab.numpy())
        self._free.append([(span, self.slab_bytes - span)] if span < self.slab_bytes else [])
        return _Rec(len(self.slabs) - 1, 0, size, span)

    def free(self, rec: _Rec) -> None:
        """Return an extent; it merges with free neighbours."""
        free = self._free[rec.slab]
        off, length = rec.off, rec.span
        k = bisect.bisect_left(free, (off, 0))
        if k < len(free) and free[k][0] == off + length:  # merge the next extent
            length += free.pop(k)[1]
        if k > 0 and free[k - 1][0] + free[k - 1][1] == off:  # merge the previous one
            off, length = free[k - 1][0], free[k - 1][1] + length
            k -= 1
            free.pop(k)
        free.insert(k, (off, length))

    def tensor(self, rec: _Rec) -> torch.Tensor:
        return self.slabs[rec.slab][rec.off:rec.off + rec.size]

    def view(self, rec: _Rec) -> memoryview:
        return memoryview(self.views[rec.slab][rec.off:rec.off + rec.size])

    def free_bytes(self) -> int:
        return sum(length for free in self._free for _, length in free)


class _Lease:
    """The records one ``fetch`` handed out; released once (at once, or when an event says a copy is done)."""

    def __init__(self, store: "PinnedMemoryStore", recs: list[_Rec]) -> None:
        self._store = store
        self._recs = recs
        self._done = False
        self._lock = threading.Lock()

    def release(self, after: Any = None) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._store._release(self._recs, after)

    def orphan(self) -> None:
        """The fetch was collected unreleased. This may run inside the garbage collector, even in a thread that holds
        the store's lock, so it only queues the records; the next operation under the lock gives them back."""
        with self._lock:
            if self._done:
                return
            self._done = True
        self._store._orphans.append(self._recs)  # deque.append: atomic, no lock


class PinnedMemoryStore(KVStore):
    """LRU over record bytes in (page-locked) slabs; ``fetch`` returns leased zero-copy views."""

    shared_tier = False

    def __init__(self, capacity_bytes: int, drop_bad: bool = True, slab_bytes: int = DEFAULT_SLAB_BYTES,
                 pin: bool | None = None, **records: Any) -> None:
        """``records``: ``secret``, ``store_token_ids`` (``KVStore.configure_records``)."""
        super().__init__(drop_bad, **records)
        self.arena = SlabArena(capacity_bytes, slab_bytes, pin)
        self.capacity_bytes = capacity_bytes
        self._data: OrderedDict[str, _Rec] = OrderedDict()
        self._used = 0  # bytes of live records and of slots being written (the LRU bound; not leased dead ones)
        self._pending: deque[tuple[Any, list[_Rec]]] = deque()  # (event, records) released once event.query()
        self._leases = 0  # (record, fetch) pairs not yet released
        self._orphans: deque[list[_Rec]] = deque()  # records of fetches collected unreleased (see _Lease.orphan)
        self._lock = threading.Lock()

    @property
    def pinned(self) -> bool:
        return self.arena.pin

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._data)

    def copy(self) -> "PinnedMemoryStore":
        """An independent store holding the same entries (own slabs, only as many as they need)."""
        out = PinnedMemoryStore.filled_from(self, self.capacity_bytes, self.drop_bad, self.arena.slab_bytes,
                                            self.arena.pin)
        out.auth, out.store_token_ids = self.auth, self.store_token_ids
        return out

    @classmethod
    def filled_from(cls, source: Any, capacity_bytes: int, drop_bad: bool = True,
                    slab_bytes: int = DEFAULT_SLAB_BYTES, pin: bool | None = None) -> "PinnedMemoryStore":
        """A new store holding ``source.records()`` (a ``MemoryStore`` or another of these), in LRU order."""
        out = cls(capacity_bytes, drop_bad, slab_bytes, pin)
        for n, b in source.records():
            out._write(n, b)
        return out

    def records(self) -> list[tuple[str, bytes]]:
        """(name, record bytes) of every entry, least recently used first (copies)."""
        with self._lock:
            return [(n, bytes(self.arena.view(r))) for n, r in self._data.items()]

    # ---- writes
    def put(self, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, kv: torch.Tensor) -> int:
        """Encode straight into a slab slot (no intermediate buffer); the slot is published once complete."""
        name = key.entry_name(layer)
        slot: list[_Rec] = []

        def alloc(n: int) -> torch.Tensor:
            with self._lock:
                rec = self._make_room(n)
            if rec is None:
                raise _NoRoom
            slot.append(rec)
            return self.arena.tensor(rec)

        try:
            self._note_trust()
            encode_record(key, layer, tokens, kv, alloc=alloc, auth=self.auth, store_token_ids=self.store_token_ids)
        except _NoRoom:
            self.stats.add(rejected=1)
            return 0
        except BaseException:
            if slot:
                with self._lock:
                    self.arena.free(slot[0])
                    self._used -= slot[0].size
            raise
        rec = slot[0]
        with self._lock:
            self._publish(name, rec)
        self.stats.add(puts=1, bytes_written=rec.size)
        return rec.size

    def _write(self, name: str, blob: bytes) -> bool:
        with self._lock:
            rec = self._make_room(len(blob))
            if rec is None:
                self.stats.add(rejected=1)
                return False
            self.arena.views[rec.slab][rec.off:rec.off + rec.size] = np.frombuffer(blob, np.uint8)
            self._publish(name, rec)
        return True

    def _make_room(self, size: int) -> _Rec | None:
        """A slot for ``size`` bytes: LRU records go for the byte bound; when the slabs still have no slot (free
        space too scattered, or held by leases), the oldest device copy still reading a record is waited for
        (microseconds to milliseconds), then more unleased records are evicted. None: every slot is leased to
        fetches not yet released, or the record fits no slab."""
        if size > self.capacity_bytes or _round_up(size) > self.arena.slab_bytes:
            return None
        self._reap()
        evicted = 0
        while self._used + size > self.capacity_bytes and self._data:
            self._drop(self._data.popitem(last=False)[1])
            evicted += 1
        rec = self.arena.alloc(size)
        while rec is None:
            if self._pending:
                self._pending[0][0].synchronize()
                self._reap()
            else:
                victim = next((n for n, r in self._data.items() if not r.leases), None)
                if victim is None:
                    break
                self._drop(self._data.pop(victim))
                evicted += 1
            rec = self.arena.alloc(size)
        if evicted:
            self.stats.add(evictions=evicted)
        if rec is not None:
            self._used += size  # reserved now: a put encoding into it is counted against the bound
        return rec

    def _publish(self, name: str, rec: _Rec) -> None:
        old = self._data.pop(name, None)
        if old is not None:
            self._drop(old)
        self._data[name] = rec  # its bytes were counted when the slot was made

    def _drop(self, rec: _Rec) -> None:
        """Out of the index; its slot is free at once unless leased (then at the last release)."""
        self._used -= rec.size
        rec.dead = True
        if rec.leases == 0:
            self.arena.free(rec)

    # ---- leases
    def _release(self, recs: list[_Rec], after: Any) -> None:
        with self._lock:
            if after is not None and not after.query():
                self._pending.append((after, recs))
            else:
                self._unlease(recs)
            self._reap()

    def _reap(self) -> None:
        while self._orphans:
            self._unlease(self._orphans.popleft())
        while self._pending and self._pending[0][0].query():
            self._unlease(self._pending.popleft()[1])

    def _unlease(self, recs: list[_Rec]) -> None:
        self._leases -= len(recs)
        for rec in recs:
            rec.leases -= 1
            if rec.leases == 0 and rec.dead:
                self.arena.free(rec)

    @property
    def leased(self) -> int:
        """Record leases not yet released (tests: nonzero once every load has finished would be a leak)."""
        with self._lock:
            self._reap()
            return self._leases

    # ---- reads
    def fetch(self, items: Sequence[tuple[ChunkKey, int]], max_bytes: int | None = None) -> Fetched:
        """Zero-copy views of the entries, valid until ``release`` (also run when the result is collected)."""
        names = [k.entry_name(layer) for k, layer in items]
        views: list[memoryview | StoreError | None] = []
        recs: list[_Rec] = []
        with self._lock:
            for n in names:
                rec = self._data.get(n)
                if rec is None:
                    views.append(None)
                    continue
                err = oversize(n, rec.size, max_bytes)
                if err is not None:
                    views.append(err)
                    continue
                self._data.move_to_end(n)
                rec.leases += 1
                self._leases += 1
                recs.append(rec)
                views.append(self.arena.view(rec))
        lease = _Lease(self, recs)
        f = self._fetched(names, views, max_bytes, lease=lease, pinned=self.arena.pin)
        weakref.finalize(f, lease.orphan)  # a fetch dropped unplaced (an error upstream) gives its records back
        return f

    def _read(self, name: str, max_bytes: int | None = None) -> bytes:
        with self._lock:
            rec = self._data.get(name)
            if rec is None:
                raise ChunkMissing(f"{name}: not in memory store", name)
            err = oversize(name, rec.size, max_bytes)
            if err is not None:
                raise err
            self._data.move_to_end(name)
            return bytes(self.arena.view(rec))

    def _read_many(self, names: Sequence[str], max_bytes: int | None = None) -> list[bytes | StoreError | None]:
        out: list[bytes | StoreError | None] = []
        with self._lock:
            for n in names:
                rec = self._data.get(n)
                if rec is None:
                    out.append(None)
                elif (err := oversize(n, rec.size, max_bytes)) is not None:
                    out.append(err)
                else:
                    self._data.move_to_end(n)
                    out.append(bytes(self.arena.view(rec)))
        return out

    def _delete(self, name: str) -> None:
        with self._lock:
            rec = self._data.pop(name, None)
            if rec is not None:
                self._drop(rec)

    def _exists(self, name: str) -> bool:
        with self._lock:
            return name in self._data

    # test/fault-injection hook: replace the stored bytes of an entry (same as MemoryStore._poke)
    def _poke(self, name: str, blob: bytes) -> None:
        self._write(name, blob)


class _NoRoom(Exception):
    """No slot for a record (internal: ``put`` counts it as rejected)."""
