"""An in-process transport for tests: peers live in one process, a write is a memcpy into the peer's buffer.

Sessions are ``"inproc:N"`` in a process-wide registry. A write checks, as a real transport's receiver does,
that the destination range lies inside a buffer the peer still has allocated; a closed or unknown peer is
`PeerUnreachable`. Two hooks let tests break transfers on purpose:

- ``delay_s``: every write sleeps this long first (a write whose ``timeout_s`` is shorter sleeps ``timeout_s``
  and raises `TransportTimeout`, copying nothing);
- ``fail_after_bytes``: once this sender has moved that many bytes in all, the write that crosses the line copies
  only the bytes up to it and raises `TransportError` (a transfer killed mid-way); later writes fail at once.
  ``None`` (the default) never fails; `reset_hooks` clears both and the byte count.
"""
from __future__ import annotations

import itertools
import threading
import time
import weakref

import numpy as np

from .base import (BufferFreed, LocalBuffer, PeerUnreachable, RemoteBuffer, Transport, TransportError,
                   TransportTimeout, check_alloc_size, register_kind)

_registry: weakref.WeakValueDictionary[str, InProcTransport] = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()
_ids = itertools.count(1)


class InProcTransport(Transport):
    """A `Transport` whose peers are other `InProcTransport` objects of this process."""

    kind = "inproc"

    def __init__(self, delay_s: float = 0.0, fail_after_bytes: int | None = None):
        self.delay_s = delay_s
        self.fail_after_bytes = fail_after_bytes
        self.bytes_sent = 0  # bytes this endpoint has written into peers (what fail_after_bytes counts)
        self._lock = threading.Lock()
        self._buffers: dict[int, LocalBuffer] = {}  # addr -> live buffer
        self._closed = False
        with _registry_lock:
            self.session = f"inproc:{next(_ids)}"
            _registry[self.session] = self

    def reset_hooks(self) -> None:
        with self._lock:
            self.delay_s, self.fail_after_bytes, self.bytes_sent = 0.0, None, 0

    def alloc(self, nbytes: int) -> LocalBuffer:
        n = check_alloc_size(nbytes)
        buf = LocalBuffer(self, np.zeros(n, dtype=np.uint8))
        with self._lock:
            if self._closed:
                raise BufferFreed(f"{self.session} is closed")
            self._buffers[buf.addr] = buf
        return buf

    def _release(self, buf: LocalBuffer, settled: bool) -> None:  # a memcpy never outlives its write call
        with self._lock:
            self._buffers.pop(buf.addr, None)

    def _target(self, addr: int, nbytes: int) -> np.ndarray:
        """The slice of a live buffer of this endpoint that holds ``[addr, addr + nbytes)``, as a receiver checks."""
        with self._lock:
            if self._closed:
                raise PeerUnreachable(f"{self.session} is closed")
            for buf in self._buffers.values():
                if buf.addr <= addr and addr + nbytes <= buf.addr + buf.nbytes:
                    start = addr - buf.addr
                    return buf.array[start:start + nbytes]
        raise TransportError(f"{self.session} rejected the write: [{addr:#x}, +{nbytes}) is in no allocated buffer")

    def _write(self, src: LocalBuffer, src_offset: int, dst: RemoteBuffer, dst_offset: int, nbytes: int,
               timeout_s: float) -> None:
        if self._closed:
            raise BufferFreed(f"{self.session} is closed")
        with _registry_lock:
            peer = _registry.get(dst.session)
        if peer is None:
            raise PeerUnreachable(f"no in-process peer {dst.session!r}")
        delay = self.delay_s
        if delay > 0:
            time.sleep(min(delay, timeout_s))
            if delay >= timeout_s:
                raise TransportTimeout(f"write to {dst.session} took longer than {timeout_s:g} s")
        target = peer._target(dst.addr + dst_offset, nbytes)
        with self._lock:
            limit, sent = self.fail_after_bytes, self.bytes_sent
            allowed = nbytes if limit is None else max(0, min(nbytes, limit - sent))
            self.bytes_sent += allowed
        np.copyto(target[:allowed], src.array[src_offset:src_offset + allowed])
        if allowed < nbytes:
            raise TransportError(f"write to {dst.session} broke after {allowed} of {nbytes} bytes "
                                 f"(fail_after_bytes={limit})")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            buffers = list(self._buffers.values())
        for buf in buffers:
            buf.free()
        with _registry_lock:
            if _registry.get(self.session) is self:
                del _registry[self.session]


register_kind("inproc", lambda host, protocol, device: InProcTransport())
