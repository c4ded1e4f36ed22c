"""In-process tier: entries as bytes in an LRU bounded by total bytes.

Stored serialised (not as tensors) so the same checks run on every tier and the byte bound is exact.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Sequence

from kvtide.store.base import ChunkMissing, ChunkOversize, KVStore, StoreError


def oversize(name: str, size: int, max_bytes: int | None) -> ChunkOversize | None:
    """The error for an entry of ``size`` bytes read under ``max_bytes`` (None: it fits)."""
    if max_bytes is not None and size > max_bytes:
        return ChunkOversize(f"{name}: {size} bytes, more than the {max_bytes} a record of this shape takes", name)
    return None


class MemoryStore(KVStore):
    """LRU over entry bytes; a read refreshes recency."""

    shared_tier = False

    def __init__(self, capacity_bytes: int, drop_bad: bool = True, **records: Any) -> None:
        """``records``: ``secret``, ``store_token_ids`` (``KVStore.configure_records``)."""
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be an int > 0, got {capacity_bytes!r}")
        super().__init__(drop_bad, **records)
        self.capacity_bytes = capacity_bytes
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    def copy(self) -> "MemoryStore":
        """An independent store holding the same entries (a snapshot to replay a workload from)."""
        out = MemoryStore(self.capacity_bytes, self.drop_bad)
        out.auth, out.store_token_ids = self.auth, self.store_token_ids
        with self._lock:
            out._data = self._data.copy()
            out._used = self._used
        return out

    @classmethod
    def filled_from(cls, source: Any, capacity_bytes: int, drop_bad: bool = True) -> "MemoryStore":
        """A new store holding ``source.records()`` (this tier or ``PinnedMemoryStore``), in LRU order."""
        out = cls(capacity_bytes, drop_bad)
        for name, blob in source.records():
            out._write(name, blob)
        return out

    def records(self) -> list[tuple[str, bytes]]:
        """(name, record bytes) of every entry, least recently used first (to refill another tier)."""
        with self._lock:
            return list(self._data.items())

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._data)

    def _write(self, name: str, blob: bytes) -> bool:
        if len(blob) > self.capacity_bytes:
            self.stats.add(rejected=1)
            return False
        evicted = 0
        with self._lock:
            old = self._data.pop(name, None)
            if old is not None:
                self._used -= len(old)
            while self._used + len(blob) > self.capacity_bytes:
                _, victim = self._data.popitem(last=False)
                self._used -= len(victim)
                evicted += 1
            self._data[name] = blob
            self._used += len(blob)
        if evicted:
            self.stats.add(evictions=evicted)
        return True

    def _read(self, name: str, max_bytes: int | None = None) -> bytes:
        with self._lock:
            blob = self._data.get(name)
            if blob is None:
                raise ChunkMissing(f"{name}: not in memory store", name)
            err = oversize(name, len(blob), max_bytes)
            if err is not None:
                raise err
            self._data.move_to_end(name)
            return blob

    def _read_many(self, names: Sequence[str], max_bytes: int | None = None) -> list[bytes | StoreError | None]:
        """One lock for a whole batch (the executor fetches a layer's chunks at once)."""
        out: list[bytes | StoreError | None] = []
        with self._lock:
            for n in names:
                blob = self._data.get(n)
                if blob is not None:
                    err = oversize(n, len(blob), max_bytes)
                    if err is not None:
                        out.append(err)
                        continue
                    self._data.move_to_end(n)
                out.append(blob)
        return out

    def _delete(self, name: str) -> None:
        with self._lock:
            old = self._data.pop(name, None)
            if old is not None:
                self._used -= len(old)

    def _exists(self, name: str) -> bool:
        with self._lock:
            return name in self._data

    # test/fault-injection hook: replace the stored bytes of an entry
    def _poke(self, name: str, blob: bytes) -> None:
        with self._lock:
            old = self._data.get(name)
            self._used += len(blob) - (len(old) if old is not None else 0)
            self._data[name] = blob
