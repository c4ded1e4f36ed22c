"""`BufferPool`: a transport's registered buffers kept for reuse between hand-offs.

A fresh buffer costs a registration with the transport and, as it is first written, a page fault per 4 KiB page
(a second or more per GB moved on a busy host); a hand-off that reuses one pays neither. Only settled buffers
come back (every write into them has returned); one that may still be written to is freed the transport's way.
The pool holds at most ``max_buffers`` buffers and ``max_bytes`` bytes; past either, the smallest go.
"""
from __future__ import annotations

import threading

from .base import LocalBuffer, Transport


class BufferPool:
    """Thread-safe; ``take`` hands out the smallest pooled buffer that fits, else a new one."""

    def __init__(self, transport: Transport, max_buffers: int = 4, max_bytes: int | None = None):
        if max_buffers < 0:
            raise ValueError(f"max_buffers must be >= 0, got {max_buffers}")
        self.transport = transport
        self.max_buffers = max_buffers
        self.max_bytes = max_bytes
        self._free: list[LocalBuffer] = []  # by size, smallest first
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> LocalBuffer:
        with self._lock:
            for i, b in enumerate(self._free):
                if b.nbytes >= nbytes:
                    return self._free.pop(i)
        return self.transport.alloc(nbytes)

    def give(self, buf: LocalBuffer, settled: bool = True) -> None:
        """Return ``buf``: pooled if ``settled`` (no write into it can still land), else freed unsettled."""
        if buf.freed:
            return
        if not settled:
            buf.free(settled=False)
            return
        drop: list[LocalBuffer] = []
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.nbytes)
            while self._free and (len(self._free) > self.max_buffers or
                                  (self.max_bytes is not None and self._held() > self.max_bytes)):
                drop.append(self._free.pop(0))
        for b in drop:
            b.free(settled=True)

    def held_bytes(self) -> int:
        with self._lock:
            return self._held()

    def _held(self) -> int:
        return sum(b.nbytes for b in self._free)

    def close(self) -> None:
        with self._lock:
            drop, self._free = self._free, []
        for b in drop:
            b.free(settled=True)
