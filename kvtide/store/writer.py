"""Background writes of finished requests' KV chunks, so serialising and checksumming stay off the step loop.

The caller copies the KV out of its pages first (pages may be reused at once); the writer only encodes and
stores. A tier that fails (Redis down, disk full) costs the write, counted, never the request. Until an entry
is written a lookup simply misses it, which means recompute: correct, only slower. A lookup that wants chunks
still queued can have them written first (:meth:`StoreWriter.wait_for`) instead of waiting for the whole queue.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvtide.store.keys import ChunkKey


def _held(x: Any) -> int:
    """Host bytes a queued layer holds: a KV tensor, or a ``ZipEntry`` (its descriptors and slot)."""
    held = getattr(x, "held_nbytes", None)
    return held if held is not None else x.numel() * x.element_size()


@dataclass
class WriterStats:
    entries: int = 0
    bytes: int = 0
    failures: int = 0
    refused: int = 0  # admit() calls turned away by max_bytes
    zip_entries: int = 0  # of entries, those given as ZipEntry (stored in the ZipFusion format), and their bytes
    zip_bytes: int = 0


class StoreWriter:
    """One daemon thread draining a queue of (key, tokens, [per-layer KV]) chunks in layer order."""

    def __init__(self, store: Any, max_queue: int = 1024, max_bytes: int | None = None) -> None:
        self.store = store
        self.max_queue = max_queue
        self.max_bytes = max_bytes
        self._queued_bytes = 0  # admitted and not yet written (KV bytes held for the writer)
        self.stats = WriterStats()
        self._items: deque[tuple[ChunkKey, list[int], list[torch.Tensor], Any] | None] = deque()
        self._unfinished = 0  # submitted and not yet written (queued or in progress)
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)  # any change of the queue or of what is pending
        self._open = threading.Event()  # cleared while held(): writes wait
        self._open.set()
        self._thread = threading.Thread(target=self._run, name="kvtide-store-writer", daemon=True)
        self._thread.start()
        # Stop the thread before interpreter teardown (a daemon thread inside torch at exit can abort the process).
        ref = weakref.ref(self)
        atexit.register(lambda: (w := ref()) is not None and w.close())

    def pending(self, key: ChunkKey) -> bool:
        with self._lock:
            return key.hex in self._pending

    def has_pending(self) -> bool:
        """Whether anything is queued or being written (a lookup's fast path: nothing to wait for)."""
        with self._lock:
            return bool(self._pending)

    def admit(self, nbytes: int) -> bool:
        """Reserve room for ``nbytes`` of chunks about to be submitted (each submitted chunk's KV bytes are
        released once written); False when that would pass ``max_bytes``. An empty queue admits anything, so a
        batch larger than the bound is still written, alone."""
        with self._lock:
            if self.max_bytes is not None and self._queued_bytes and self._queued_bytes + nbytes > self.max_bytes:
                self.stats.refused += 1
                return False
            self._queued_bytes += nbytes
            return True

    @property
    def queued_bytes(self) -> int:
        with self._lock:
            return self._queued_bytes

    def submit(self, key: ChunkKey, tokens: Sequence[int], layers: list[torch.Tensor], ready: Any = None) -> None:
        """Queue one chunk (``layers[i]`` = [2, C, kv_heads, head_dim] of layer i). Blocks when the queue is full.
        ``ready``: an event (``.synchronize()``) after which ``layers`` hold the data (an asynchronous copy)."""
        with self._cv:
            while len(self._items) >= self.max_queue:
                self._cv.wait()
            self._pending.add(key.hex)
            self._items.append((key, list(tokens), layers, ready))
            self._unfinished += 1
            self._cv.notify_all()

    def wait_for(self, keys: Sequence[ChunkKey]) -> None:
        """Write these chunks first (moved to the head of the queue, in the order given) and wait until they are
        written: a lookup needs them now, and the rest of the queue (gigabytes after a burst of finished requests)
        can wait. Keys not pending return at once."""
        if not self._open.is_set():
            raise RuntimeError("StoreWriter.wait_for() inside held() would never return")
        with self._cv:
            want = {k.hex for k in keys} & self._pending
            if not want:
                return
            rank = {k.hex: i for i, k in reversed(list(enumerate(keys)))}  # first mention wins
            first = sorted((it for it in self._items if it is not None and it[0].hex in want),
                           key=lambda it: rank[it[0].hex])
            if first:
                rest = [it for it in self._items if it is None or it[0].hex not in want]
                self._items.clear()
                self._items.extend(first + rest)
                self._cv.notify_all()
            while want & self._pending:
                self._cv.wait()

    @contextlib.contextmanager
    def held(self):
        """Writes wait (between layer entries) while the caller runs latency-critical host work, such as a
        restoration's compute and I/O threads: encoding an entry holds the GIL for part of its copies and hash,
        which those threads would otherwise wait for. Writing is background work; it resumes on exit."""
        self._open.clear()
        try:
            yield
        finally:
            self._open.set()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._items:
                    self._cv.wait()
                item = self._items.popleft()
                self._cv.notify_all()  # room for a blocked submit
            if item is None:
                return
            key, tokens, layers, ready = item
            try:
                if ready is not None:
                    ready.synchronize()
                # Layer order matters: a reader that sees the last layer knows the whole chunk is there.
                for i, kv in enumerate(layers):
                    self._open.wait()
                    n = self.store.put(key, i, tokens, kv)
                    self.stats.bytes += n
                    self.stats.entries += 1
                    if n and hasattr(kv, "held_nbytes"):
                        self.stats.zip_entries += 1
                        self.stats.zip_bytes += n
            except Exception:  # noqa: BLE001 - a failed write (tier down, bad copy) costs the entry, never the thread
                self.stats.failures += 1
            finally:
                with self._cv:
                    self._pending.discard(key.hex)
                    self._queued_bytes = max(0, self._queued_bytes - sum(_held(x) for x in layers))
                    self._unfinished -= 1
                    self._cv.notify_all()

    def flush(self) -> None:
        """Wait until everything queued so far is written (or failed)."""
        if not self._open.is_set():
            raise RuntimeError("StoreWriter.flush() inside held() would never return")
        with self._cv:
            while self._unfinished:
                self._cv.wait()

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._open.set()
        self.flush()
        with self._cv:
            self._items.append(None)
            self._cv.notify_all()
        self._thread.join(timeout=5)
