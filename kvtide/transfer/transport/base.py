"""The KV transport interface: registered host buffers and one-sided, blocking writes into a peer's buffer.

A receiver allocates a `LocalBuffer` and advertises it as a `RemoteBuffer` (JSON over HTTP); a sender writes
slices of its own buffers into it. Every write is bounds-checked on both sides before any I/O (`ValueError`), and
every failure of the transfer itself (dead peer, rejected address, timeout) is a `TransportError`, so the caller
can fall back to recomputing instead of waiting or reading garbage.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

_ADDR_LIMIT = 1 << 64  # addresses and lengths are 64-bit on every transport we run


class TransportError(Exception):
    """A transfer did not complete: the bytes at the destination must not be trusted."""


class TransportTimeout(TransportError):
    """A write did not complete within its ``timeout_s``."""


class PeerUnreachable(TransportError):
    """The destination session could not be reached (no such peer, connection refused, handshake failed)."""


class BufferFreed(TransportError):
    """A write named a local buffer that was already freed, or the transport was closed."""


@dataclass(frozen=True)
class RemoteBuffer:
    """A buffer a peer registered and advertises: where to write (``session``, ``addr``) and how much fits."""

    session: str
    addr: int
    nbytes: int

    def __post_init__(self) -> None:
        _check_fields(self.session, self.addr, self.nbytes)

    def to_dict(self) -> dict[str, Any]:
        return {"session": self.session, "addr": self.addr, "nbytes": self.nbytes}

    @classmethod
    def from_dict(cls, d: Any) -> RemoteBuffer:
        """Parse what `to_dict` wrote (after a JSON round trip); `ValueError` names the first bad field.

        Unknown keys are ignored, so a newer sender may add fields."""
        if not isinstance(d, dict):
            raise ValueError(f"RemoteBuffer: expected a dict, got {type(d).__name__}")
        for field in ("session", "addr", "nbytes"):
            if field not in d:
                raise ValueError(f"RemoteBuffer.{field}: missing")
        return cls(d["session"], d["addr"], d["nbytes"])


def _check_fields(session: Any, addr: Any, nbytes: Any) -> None:
    if not isinstance(session, str) or not session or len(session) > 1024:
        raise ValueError(f"RemoteBuffer.session: expected a non-empty string, got {session!r:.80}")
    for name, v in (("addr", addr), ("nbytes", nbytes)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"RemoteBuffer.{name}: expected an int, got {type(v).__name__}")
        if not 0 <= v < _ADDR_LIMIT:
            raise ValueError(f"RemoteBuffer.{name}: {v} is out of range [0, 2**64)")
    if addr + nbytes > _ADDR_LIMIT:
        raise ValueError(f"RemoteBuffer.nbytes: addr + nbytes = {addr + nbytes} passes 2**64")


class LocalBuffer:
    """Host memory registered with one `Transport`: ``array`` (uint8, writable) at address ``addr``.

    `free` unregisters it (peers' later writes into it fail) and is idempotent; the owner decides when the memory
    itself is released (it may hold it a while so a late native write never lands in freed memory, unless the
    caller says the buffer is settled)."""

    def __init__(self, owner: Transport, array: np.ndarray):
        if array.dtype != np.uint8 or array.ndim != 1 or not array.flags.writeable or not array.flags.c_contiguous:
            raise ValueError("LocalBuffer: array must be a writable, contiguous 1-D uint8 array")
        self._owner = owner
        self.array = array
        self.nbytes = int(array.nbytes)
        self.addr = int(array.ctypes.data)
        self._freed = False
        self._lock = threading.Lock()

    @property
    def freed(self) -> bool:
        return self._freed

    @property
    def owner(self) -> Transport:
        return self._owner

    def remote(self) -> RemoteBuffer:
        """What a peer needs to write into this buffer."""
        if self._freed:
            raise BufferFreed(f"buffer at {self.addr:#x} was freed")
        return RemoteBuffer(self._owner.session, self.addr, self.nbytes)

    def free(self, settled: bool = False) -> None:
        """Unregister the buffer; idempotent. ``settled=True`` says no peer's write into it can still be in
        flight (every write the receiver waited for has completed), so its memory may go back at once."""
        with self._lock:
            if self._freed:
                return
            self._freed = True
        self._owner._release(self, settled)

    def __repr__(self) -> str:
        state = "freed" if self._freed else "live"
        return f"LocalBuffer({self._owner.session}, addr={self.addr:#x}, nbytes={self.nbytes}, {state})"


def _check_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name}: expected an int, got {type(v).__name__}")
    if v < 0:
        raise ValueError(f"{name}: {v} is negative")
    return int(v)


class Transport(ABC):
    """One endpoint: allocates registered buffers and writes into peers' buffers. Thread-safe.

    Subclasses implement `alloc`, `_write` (called after the checks of `write`), `_release` and `close`."""

    session: str  # this endpoint's address for peers, e.g. "127.0.0.1:15123" or "inproc:3"

    @abstractmethod
    def alloc(self, nbytes: int) -> LocalBuffer:
        """A zeroed, registered buffer of ``nbytes`` (> 0) bytes."""

    def write(self, src: LocalBuffer, src_offset: int, dst: RemoteBuffer, dst_offset: int, nbytes: int,
              timeout_s: float = 10.0) -> None:
        """Copy ``src[src_offset:+nbytes]`` into ``dst`` at ``dst_offset``; returns once the bytes are there.

        `ValueError` for a bad argument or a range outside either buffer (checked before any I/O);
        `TransportError` (`TransportTimeout` past ``timeout_s``) when the transfer itself fails."""
        self.check_write(src, src_offset, dst, dst_offset, nbytes, timeout_s)
        if nbytes == 0:
            return
        self._write(src, int(src_offset), dst, int(dst_offset), int(nbytes), float(timeout_s))

    def check_write(self, src: LocalBuffer, src_offset: int, dst: RemoteBuffer, dst_offset: int, nbytes: int,
                    timeout_s: float) -> None:
        """The checks `write` makes before any I/O (wrappers call it too)."""
        if not isinstance(src, LocalBuffer) or not self.owns(src):
            raise ValueError(f"src: not a buffer of this transport ({self.session})")
        if not isinstance(dst, RemoteBuffer):
            raise ValueError(f"dst: expected a RemoteBuffer, got {type(dst).__name__}")
        src_offset, dst_offset = _check_int("src_offset", src_offset), _check_int("dst_offset", dst_offset)
        nbytes = _check_int("nbytes", nbytes)
        if src_offset + nbytes > src.nbytes:
            raise ValueError(f"src: range [{src_offset}, {src_offset + nbytes}) passes its {src.nbytes} bytes")
        if dst_offset + nbytes > dst.nbytes:
            raise ValueError(f"dst: range [{dst_offset}, {dst_offset + nbytes}) passes its {dst.nbytes} bytes")
        if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and timeout_s > 0):
            raise ValueError(f"timeout_s: expected a positive number, got {timeout_s!r}")
        if src.freed:
            raise BufferFreed(f"src: buffer at {src.addr:#x} was freed")

    def owns(self, buf: LocalBuffer) -> bool:
        """Whether ``buf`` was allocated by this transport (a wrapper answers for its inner transport)."""
        return buf.owner is self

    @abstractmethod
    def _write(self, src: LocalBuffer, src_offset: int, dst: RemoteBuffer, dst_offset: int, nbytes: int,
               timeout_s: float) -> None:
        """The transfer, arguments already checked and ``nbytes > 0``."""

    @abstractmethod
    def _release(self, buf: LocalBuffer, settled: bool) -> None:
        """Unregister ``buf`` (called once, by `LocalBuffer.free`; ``settled`` as there)."""

    @abstractmethod
    def close(self) -> None:
        """Free every buffer and stop serving peers; idempotent."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_alloc_size(nbytes: Any) -> int:
    """`alloc`'s argument check, shared by the transports."""
    n = _check_int("nbytes", nbytes)
    if n == 0:
        raise ValueError("nbytes: must be positive")
    return n


# kind -> constructor(host, protocol, device); each transport module registers itself (the package imports them)
_KINDS: dict[str, Callable[[str, str, str], Transport]] = {}


def register_kind(kind: str, factory: Callable[[str, str, str], Transport]) -> None:
    _KINDS[kind] = factory


def open_transport(kind: str = "mooncake", host: str = "127.0.0.1", protocol: str = "tcp",
                   device: str = "") -> Transport:
    """A transport endpoint: ``"mooncake"`` (listening on ``host``; ``protocol`` tcp or rdma, ``device`` the NICs
    to use, empty for all) or ``"inproc"`` (this process only; the other arguments are ignored)."""
    factory = _KINDS.get(kind)
    if factory is None:
        raise ValueError(f"kind: unknown transport {kind!r} (known: {', '.join(sorted(_KINDS))})")
    return factory(host, protocol, device)
