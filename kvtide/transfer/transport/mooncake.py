"""`MooncakeTransport`: the Mooncake Transfer Engine (its Python API) behind the `Transport` interface.

The engine starts with ``P2PHANDSHAKE`` metadata (peers exchange segment descriptors directly; no metadata
server) on protocol ``tcp`` (``rdma`` where the host has RDMA NICs; ``device`` filters them). Its RPC port is
chosen by the engine, so a session is ``"host:rpc_port"``. Buffers are numpy arrays registered with
``register_memory``; a write is ``transfer_submit_write`` polled with ``transfer_check_status`` until done, failed
or past ``timeout_s``.

What a dead peer does (measured on the TCP transport): a killed peer fails the write at once (connection refused
or reset, status -1), and the receiver rejects a range outside its registered memory. A peer that is alive but
stalled (stopped process, partitioned link) never answers: the engine itself drops such a connection only after
its progress timeout (``MC_TCP_PROGRESS_TIMEOUT_SEC``, 30 s by default). So `write` stops waiting at
``timeout_s`` and raises `TransportTimeout`, while the native transfer is left to finish or fail on its own: the
batch and the source memory are parked (kept alive, polled and freed by later calls), never released under it.
A freed buffer is unregistered at once but its memory is held ``free_grace_s`` more, so a peer's write whose header
passed the receiver's address check just before the unregister does not land in freed memory; a receiver that
knows every write into the buffer completed says ``free(settled=True)`` and the memory goes back at once.
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from types import ModuleType

import numpy as np

from kvtide.extras import MissingExtra, require
from kvtide.log import get_logger

from .base import (BufferFreed, LocalBuffer, PeerUnreachable, RemoteBuffer, Transport, TransportError,
                   TransportTimeout, check_alloc_size, register_kind)

log = get_logger("transfer.transport")

INSTALL = "mooncake-transfer-engine-non-cuda, or mooncake-transfer-engine on GPU hosts; " \
          "its native library also needs: apt-get install libibverbs1"
_POLL_MIN_S, _POLL_MAX_S = 20e-6, 1e-3  # status polling backoff: fast for small writes, cheap for long ones


def load_engine_module() -> ModuleType:
    """``mooncake.engine``, or `MissingExtra` naming the pip and apt commands that bring it."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # the engine logs every connection at INFO otherwise
    try:
        return require("mooncake.engine", "pd", "the Mooncake transport")
    except MissingExtra as e:
        raise _missing("") from e
    except ImportError as e:  # the package is there but its native library does not load (libibverbs)
        raise _missing(f"; importing it failed: {e}") from e


def _missing(detail: str) -> MissingExtra:
    e = MissingExtra("mooncake", "pd", "the Mooncake transport")
    e.msg = f"{e.msg} ({INSTALL}){detail}"
    e.args = (e.msg,)
    return e


def mooncake_available() -> tuple[bool, str]:
    """Whether the engine imports here, and why not."""
    try:
        load_engine_module()
    except ImportError as e:
        return False, str(e)
    return True, ""


class MooncakeTransport(Transport):
    """One Mooncake Transfer Engine endpoint; thread-safe."""

    kind = "mooncake"

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device: str = "",
                 free_grace_s: float = 60.0):
        engine_mod = load_engine_module()
        t0 = time.perf_counter()
        self._engine = engine_mod.TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransportError(f"Mooncake initialize({host!r}, P2PHANDSHAKE, {protocol!r}, {device!r}) "
                                 f"returned {rc}")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self.protocol = protocol
        self.free_grace_s = free_grace_s
        self._lock = threading.Lock()
        self._buffers: dict[int, LocalBuffer] = {}
        self._parked: list[tuple[int, np.ndarray]] = []  # (batch id, source memory) of writes given up on
        self._quarantine: deque[tuple[float, np.ndarray]] = deque()  # (release time, memory) of freed buffers
        self._closed = False
        log.debug("mooncake %s up (%s) in %.1f ms", self.session, protocol, (time.perf_counter() - t0) * 1e3)

    # -- buffers ---------------------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> LocalBuffer:
        n = check_alloc_size(nbytes)
        buf = LocalBuffer(self, np.zeros(n, dtype=np.uint8))
        with self._lock:
            if self._closed:
                raise BufferFreed(f"{self.session} is closed")
            rc = self._engine.register_memory(buf.addr, n)
            if rc != 0:
                raise TransportError(f"Mooncake register_memory of {n} bytes returned {rc}")
            self._buffers[buf.addr] = buf
        self._reap()
        return buf

    def _release(self, buf: LocalBuffer, settled: bool) -> None:
        with self._lock:
            if self._buffers.pop(buf.addr, None) is None:
                return
            if not self._closed:
                rc = self._engine.unregister_memory(buf.addr)
                if rc != 0:
                    log.warning("mooncake %s: unregister_memory(%#x) returned %d", self.session, buf.addr, rc)
                if not settled:
                    self._quarantine.append((time.monotonic() + self.free_grace_s, buf.array))
        self._reap()

    def held_bytes(self) -> int:
        """Bytes of freed buffers and given-up writes still held back from release (see the module doc)."""
        with self._lock:
            return sum(a.nbytes for _, a in self._quarantine) + sum(a.nbytes for _, a in self._parked)

    # -- writes ----------------------------------------------------------------------------------------------
    def _write(self, src: LocalBuffer, src_offset: int, dst: RemoteBuffer, dst_offset: int, nbytes: int,
               timeout_s: float) -> None:
        self._reap()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._closed:
                raise BufferFreed(f"{self.session} is closed")
            engine = self._engine  # a close() meanwhile drops self._engine; this reference keeps it alive
        batch = engine.transfer_submit_write(dst.session, src.addr + src_offset, dst.addr + dst_offset,
                                                   nbytes)
        if batch == 0:
            raise PeerUnreachable(f"Mooncake could not submit a write to {dst.session} (handshake failed: "
                                  "peer gone or not listening)")
        pause = _POLL_MIN_S
        while True:
            status = engine.transfer_check_status(batch)  # 1 and -1 free the batch id: ask no more
            if status == 1:
                return
            if status == -1:
                raise TransportError(f"Mooncake write of {nbytes} bytes to {dst.session} failed "
                                     "(peer closed the connection or rejected the address)")
            if status == -2:
                raise TransportTimeout(f"Mooncake timed out the write of {nbytes} bytes to {dst.session}")
            now = time.monotonic()
            if now >= deadline:
                with self._lock:
                    if self._closed:  # closed under this write: keep the engine as close() does
                        _ABANDONED.append((engine, [(batch, src.array)]))
                    else:
                        self._parked.append((batch, src.array))
                raise TransportTimeout(f"write of {nbytes} bytes to {dst.session} not done after {timeout_s:g} s "
                                       "(the native transfer is left to finish or fail on its own)")
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, _POLL_MAX_S)

    def _reap(self) -> None:
        """Free the batch ids of parked writes that ended, and the memory whose grace has passed."""
        with self._lock:
            if self._parked and not self._closed:
                still = []
                for batch, mem in self._parked:
                    status = self._engine.transfer_check_status(batch)
                    if status == 0:
                        still.append((batch, mem))
                    # 1 / -1: the engine freed the batch; -2: it gave up (the id is leaked, never asked again)
                self._parked = still
            now = time.monotonic()
            while self._quarantine and self._quarantine[0][0] <= now:
                self._quarantine.popleft()

    # -- lifetime --------------------------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            buffers = list(self._buffers.values())
        for buf in buffers:
            buf.free()
        self._reap()
        with self._lock:
            self._closed = True
            if self._parked:
                # destroying the engine under a live native transfer is not safe: keep it (and the memory)
                log.warning("mooncake %s closed with %d write(s) still in flight; the engine is kept until exit",
                            self.session, len(self._parked))
                _ABANDONED.append((self._engine, self._parked, self._quarantine))
            self._engine = None
            self._parked, self._quarantine = [], deque()


_ABANDONED: list[object] = []  # engines closed while a native write was still in flight (see close)

register_kind("mooncake", lambda host, protocol, device: MooncakeTransport(host, protocol, device))
