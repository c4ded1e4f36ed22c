"""Background writes of finished requests' KV chunks, so serialising and checksumming stay off the step loop.

The caller copies the KV out of its pages first (pages may be reused at once); the writer only encodes and
stores. A tier that fails (Redis down, disk full) costs the write, counted, never the request. Until an entry
is written a lookup simply misses it, which means recompute: correct, only slower. A lookup that wants chunks
still queued can have them written first (:meth:`StoreWriter.wait_for`) instead of waiting for the whole queue.

Deadlines: ``flush(timeout)`` and ``close(timeout)`` (default ``flush_timeout``) wait at most that long; chunks still
queued then are dropped (``WriterStats.dropped``, logged), the one being written finishes or fails on its own (the
tier's timeout bounds it). A chunk counts as written (``WriterStats.chunks``, ``on_chunk(key, True)``) only when
the tier stored every layer entry; a failed or declined write never counts.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from kvtide.log import get_logger, warn_limited
from kvtide.store.keys import ChunkKey

log = get_logger("store")


def _held(x: Any) -> int:
    """Host bytes a queued layer holds: a KV tensor, or a ``ZipEntry`` (its descriptors and slot)."""
    held = getattr(x, "held_nbytes", None)
    return held if held is not None else x.numel() * x.element_size()


@dataclass
class WriterStats:
    entries: int = 0  # layer entries the tier stored
    bytes: int = 0
    chunks: int = 0  # chunks with every layer entry stored
    failures: int = 0  # chunks whose write failed (tier down, bad copy)
    declined: int = 0  # layer entries the tier turned away (larger than it holds); their chunk is not written
    dropped: int = 0  # chunks never written: still queued at a flush/close deadline, or submitted after close
    refused: int = 0  # admit() calls turned away by max_bytes
    zip_entries: int = 0  # of entries, those given as ZipEntry (stored in the ZipFusion format), and their bytes
    zip_bytes: int = 0
    # entries stored under a KVServe profile (``PendingProfileEntry``), and their record bytes, by profile spec
    profile_entries: dict[str, int] = field(default_factory=dict)
    profile_bytes: dict[str, int] = field(default_factory=dict)


class StoreWriter:
    """One daemon thread draining a queue of (key, tokens, [per-layer KV]) chunks in layer order."""

    def __init__(self, store: Any, max_queue: int = 1024, max_bytes: int | None = None,
                 flush_timeout: float | None = None, on_chunk: Callable[[ChunkKey, bool], None] | None = None) -> None:
        """``flush_timeout``: ``close``'s deadline in seconds (None: wait for everything). ``on_chunk(key, written)``
        is called (on the writer's thread, or the dropping caller's) once per submitted chunk when it is written
        (True) or failed, was declined or dropped (False)."""
        if flush_timeout is not None and not flush_timeout >= 0:
            raise ValueError(f"flush_timeout must be None or >= 0 seconds, got {flush_timeout!r}")
        self.store = store
        self.max_queue = max_queue
        self.max_bytes = max_bytes
        self.flush_timeout = flush_timeout
        self.on_chunk = on_chunk
        self._closed = False
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
        ``ready``: an event (``.synchronize()``) after which ``layers`` hold the data (an asynchronous copy).
        After ``close`` the chunk is dropped (counted)."""
        with self._cv:
            closed = self._closed
            if closed:
                self.stats.dropped += 1
                self._queued_bytes = max(0, self._queued_bytes - sum(_held(x) for x in layers))
        if closed:
            self._report(key, False)
            return
        with self._cv:
            while len(self._items) >= self.max_queue:
                self._cv.wait()
            self._pending.add(key.hex)
            self._items.append((key, list(tokens), layers, ready))
            self._unfinished += 1
            self._cv.notify_all()

    def wait_for(self, keys: Sequence[ChunkKey], timeout: float | None = None) -> bool:
        """Write these chunks first (moved to the head of the queue, in the order given) and wait until they are
        written: a lookup needs them now, and the rest of the queue (gigabytes after a burst of finished requests)
        can wait. Keys not pending return at once. ``timeout``: wait at most that long (they stay queued); returns
        whether none of them is pending any more."""
        if not self._open.is_set():
            raise RuntimeError("StoreWriter.wait_for() inside held() would never return")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            want = {k.hex for k in keys} & self._pending
            if not want:
                return True
            rank = {k.hex: i for i, k in reversed(list(enumerate(keys)))}  # first mention wins
            first = sorted((it for it in self._items if it is not None and it[0].hex in want),
                           key=lambda it: rank[it[0].hex])
            if first:
                rest = [it for it in self._items if it is None or it[0].hex not in want]
                self._items.clear()
                self._items.extend(first + rest)
                self._cv.notify_all()
            while want & self._pending:
                if not self._wait(deadline):
                    return False
            return True

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
            written = False
            try:
                if ready is not None:
                    ready.synchronize()
                # Layer order matters: a reader that sees the last layer knows the whole chunk is there.
                # A declined entry (larger than the tier holds) ends the chunk: its later layers, the last one above
                # all, must not claim a whole chunk.
                written = True
                for i, kv in enumerate(layers):
                    self._open.wait()
                    materialize = getattr(kv, "materialize", None)  # a profile's entry, encoded here
                    if materialize is not None:
                        kv = materialize()
                    n = self.store.put(key, i, tokens, kv)
                    if not n:
                        self.stats.declined += 1
                        written = False
                        break
                    self.stats.bytes += n
                    self.stats.entries += 1
                    profile = getattr(kv, "profile", None)
                    if profile is not None:
                        st = self.stats
                        st.profile_entries[profile] = st.profile_entries.get(profile, 0) + 1
                        st.profile_bytes[profile] = st.profile_bytes.get(profile, 0) + n
                    elif hasattr(kv, "held_nbytes"):
                        self.stats.zip_entries += 1
                        self.stats.zip_bytes += n
                if written:
                    self.stats.chunks += 1
            except Exception as e:  # noqa: BLE001 - a failed write costs the chunk, not the thread
                written = False
                self.stats.failures += 1
                warn_limited(log, "writer-failed", "store write of chunk %s failed (%s: %s); it will be recomputed "
                             "when needed", key.hex[:16], type(e).__name__, e)
            finally:
                with self._cv:
                    self._pending.discard(key.hex)
                    self._queued_bytes = max(0, self._queued_bytes - sum(_held(x) for x in layers))
                    self._unfinished -= 1
                    self._cv.notify_all()
                self._report(key, written)

    def _report(self, key: ChunkKey, written: bool) -> None:
        if self.on_chunk is not None:
            try:
                self.on_chunk(key, written)
            except Exception:  # noqa: BLE001 - a bookkeeping callback must not stop the writer
                log.exception("store writer: on_chunk callback failed")

    def _wait(self, deadline: float | None) -> bool:
        """One wait on the condition (lock held) until ``deadline`` (monotonic; None: no limit); False once past it."""
        if deadline is None:
            self._cv.wait()
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        self._cv.wait(left)
        return True

    def _drop_queued(self) -> list[ChunkKey]:
        """Take every queued (not yet started) chunk off the queue, counted as dropped (lock held)."""
        dropped = [it for it in self._items if it is not None]
        if not dropped:
            return []
        rest = [it for it in self._items if it is None]
        self._items.clear()
        self._items.extend(rest)
        for key, _, layers, _ in dropped:
            self._pending.discard(key.hex)
            self._queued_bytes = max(0, self._queued_bytes - sum(_held(x) for x in layers))
            self._unfinished -= 1
        self.stats.dropped += len(dropped)
        self._cv.notify_all()
        return [it[0] for it in dropped]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is written (or failed); returns True then. ``timeout`` (seconds): at that
        deadline the chunks still queued are dropped (counted, logged) and False is returned; a chunk being
        written then is left to finish on its own."""
        if not self._open.is_set():
            raise RuntimeError("StoreWriter.flush() inside held() would never return")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._unfinished:
                if not self._wait(deadline):
                    dropped = self._drop_queued()
                    break
            else:
                return True
        for key in dropped:
            self._report(key, False)
        if dropped:
            warn_limited(log, "writer-deadline", "store writer: %d queued chunks dropped at the %g s deadline (the "
                         "tier is slow or down); they will be recomputed when needed", len(dropped), timeout)
        return False

    def close(self, timeout: float | None = None) -> bool:
        """Flush (at most ``timeout`` seconds; default ``flush_timeout``) and stop the thread; later submits are
        dropped. Returns whether everything was written."""
        timeout = self.flush_timeout if timeout is None else timeout
        with self._cv:
            self._closed = True
        if not self._thread.is_alive():
            return True
        self._open.set()
        t0 = time.monotonic()
        done = self.flush(timeout)
        with self._cv:
            self._items.append(None)
            self._cv.notify_all()
        left = 5.0 if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
        self._thread.join(timeout=left)
        return done
