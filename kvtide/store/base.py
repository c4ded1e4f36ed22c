"""Store interface and counters: tiers move bytes, this class formats, verifies, counts and logs.

Granularity: one entry per (chunk, layer block), so a plan's loads of layers [i, L) are plain GETs on every tier
and a corrupt layer costs only that layer's recompute (why: docs/design/store.md). The record format is
:mod:`kvtide.store.record` (names re-exported here); errors :mod:`kvtide.store.errors`.

Loads in bulk: ``fetch`` reads the raw bytes of many entries in one round trip (one lock, one MGET) and says when
they are across the link (``ready_at``; a ``BandwidthLimitedStore`` reserves the link then, so the next fetch
travels while the caller verifies this one); ``open`` verifies and decodes one of them, optionally without a copy.

Tier contract: ``_read(name, max_bytes=None)`` and ``_read_many(names, max_bytes=None)`` refuse an entry larger
than ``max_bytes`` with ``ChunkOversize`` before reading its bytes (a file's stat, Redis STRLEN); ``_read_many``
returns per name the bytes, None (missing) or that entry's own ``StoreError``, and raises only ``StoreUnavailable``,
when the tier as a whole cannot be reached. A failed entry is counted (``StoreStats``), logged (rate-limited) and,
when it failed a check, deleted (``drop_bad``) so it is rewritten rather than re-failed.

Trust: with a secret (``secret=`` / ``configure_records``, else ``$KVTIDE_STORE_SECRET``) only records carrying
this secret's MAC are used; without one a tier other processes can write (``shared_tier``: disk, Redis) is trusted,
and the store logs that once.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from kvtide.log import get_logger, warn_limited
from kvtide.store.auth import RecordAuth, resolve_secret
from kvtide.store.errors import (  # noqa: F401 - re-exported
    ChunkCorrupt,
    ChunkForged,
    ChunkMissing,
    ChunkOversize,
    ChunkTruncated,
    EntryUnreadable,
    StoreError,
    StoreFull,
    StoreUnavailable,
    TokenMismatch,
)
from kvtide.store.keys import ChunkKey
from kvtide.store.record import (  # noqa: F401 - re-exported
    _HEADER,
    DTYPES,
    FLAG_KEYED,
    FLAG_TOKEN_HASH,
    HEADER_BYTES,
    META_MAX_BYTES,
    PAYLOAD_ALIGN,
    READ_VERSIONS,
    RECORD_MAGIC,
    RECORD_VERSION,
    _token_bytes_fast,
    decode_record,
    encode_record,
    record_bytes_bound,
    token_array,
)
from kvtide.store.zip_entry import ZipEntry

log = get_logger("store")


@dataclass
class StoreStats:
    """Counters of what a store did; every fallback cause is counted separately."""

    puts: int = 0
    put_failures: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    truncated: int = 0
    token_mismatch: int = 0
    forged: int = 0  # records that failed authentication (no MAC, another secret's, altered)
    oversize: int = 0  # entries larger than the caller's bound, refused unread
    read_errors: int = 0  # entries whose own read failed (EntryUnreadable) while the tier was up
    unavailable: int = 0
    evictions: int = 0
    rejected: int = 0  # entries larger than the whole store
    swept: int = 0  # files removed when the tier opened (temporary files, chunks missing layers)
    bytes_written: int = 0
    bytes_read: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    @property
    def fallbacks(self) -> int:
        return (self.misses + self.corrupt + self.truncated + self.token_mismatch + self.forged + self.oversize
                + self.read_errors + self.unavailable)


@dataclass(frozen=True)
class Entry:
    """A verified entry: the KV tensor (or, opened with ``decode=False``, its ``ZipEntry``) and the record's size on
    the wire."""

    tensor: "torch.Tensor | ZipEntry"
    nbytes: int


@dataclass
class Fetched:
    """Raw bytes of several entries read in one round trip (or the error of each that could not be read).

    ``ready_at`` (``time.perf_counter()`` clock) is when the bytes are across the link: a caller that waits for
    it before ``open`` lets the next fetch travel while it verifies and places this one.
    """

    names: list[str]
    blobs: list[bytes | StoreError]
    nbytes: int
    ready_at: float = 0.0
    # Blobs that are views of a tier's own memory (``PinnedMemoryStore``) stay valid until ``release``; ``pinned``:
    # that memory is page-locked, so a device may copy straight out of it (DMA) before the release.
    lease: Any = None
    pinned: bool = False

    def release(self, after: Any = None) -> None:
        """Hand the tier its memory back, at once or once ``after.query()`` is true (a device copy still reading
        it, e.g. a ``torch.cuda.Event`` recorded behind that copy). Idempotent; a no-op for tiers of plain bytes."""
        if self.lease is not None:
            self.lease.release(after)

    def wait(self) -> float:
        """Sleep until the bytes have arrived; returns the seconds slept."""
        dt = self.ready_at - time.perf_counter()
        if dt > 0:
            time.sleep(dt)
            return dt
        return 0.0


class KVStore(ABC):
    """A tier of (chunk, layer) entries. Subclasses move bytes; this class formats, verifies and counts."""

    shared_tier: bool = True  # other processes may write it (disk, Redis); in-process tiers say False

    def __init__(self, drop_bad: bool = True, secret: str | bytes | None = None, store_token_ids: bool = True) -> None:
        self.stats = StoreStats()
        self.drop_bad = drop_bad  # delete an entry that failed a check so it is rewritten, not re-failed
        self.configure_records(secret, store_token_ids)

    def configure_records(self, secret: str | bytes | None = None, store_token_ids: bool = True) -> None:
        """How records are written and which are accepted: ``secret`` (None: ``$KVTIDE_STORE_SECRET``, if set) signs
        every record written and rejects every record without its MAC; ``store_token_ids=False`` writes a hash of a
        chunk's token ids instead of the ids (records of either kind are read)."""
        key = resolve_secret(secret)
        self.auth: RecordAuth | None = RecordAuth(key) if key is not None else None
        self.store_token_ids = bool(store_token_ids)
        self._trust_noted = False

    @property
    def authenticated(self) -> bool:
        return self.auth is not None

    # ---- raw byte storage, per tier
    @abstractmethod
    def _write(self, name: str, blob: bytes) -> bool | None:
        """Store the bytes; return False if the tier declined them (too large), else None/True. Raises
        StoreUnavailable (tier down) or StoreFull (no room)."""

    @abstractmethod
    def _read(self, name: str, max_bytes: int | None = None) -> bytes:
        """The stored bytes. ChunkMissing if absent; ChunkOversize, without reading them, if there are more than
        ``max_bytes``; EntryUnreadable if this entry alone cannot be read; StoreUnavailable if the tier cannot be
        reached."""

    @abstractmethod
    def _delete(self, name: str) -> None: ...

    @abstractmethod
    def _exists(self, name: str) -> bool: ...

    def _read_many(self, names: Sequence[str], max_bytes: int | None = None) -> list[bytes | StoreError | None]:
        """Per name: the bytes, None where missing, or that entry's own StoreError (oversize, unreadable). Raises
        StoreUnavailable only for the tier as a whole (tiers with batched reads override)."""
        out: list[bytes | StoreError | None] = []
        for n in names:
            try:
                out.append(self._read(n, max_bytes))
            except ChunkMissing:
                out.append(None)
            except StoreUnavailable:
                raise
            except StoreError as e:
                out.append(e)
        return out

    # ---- public API
    def put(self, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, kv: torch.Tensor) -> int:
        """Store one entry; returns its size in bytes (0: the tier declined it). Raises StoreUnavailable if the tier
        is down, StoreFull if it has no room; both counted as failed writes, never as written."""
        self._note_trust()
        blob = encode_record(key, layer, tokens, kv, auth=self.auth, store_token_ids=self.store_token_ids)
        try:
            stored = self._write(key.entry_name(layer), blob)
        except StoreError as e:
            self.stats.add(put_failures=1, unavailable=int(isinstance(e, StoreUnavailable)))
            warn_limited(log, f"store.write.{type(self).__name__}", "%s: write failed, entry dropped: %s",
                         self.describe(), e)
            raise
        if stored is False:
            return 0
        self.stats.add(puts=1, bytes_written=len(blob))
        return len(blob)

    def get_entry(self, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, *,
                  max_bytes: int | None = None, dtype: torch.dtype | None = None) -> Entry:
        """Load and verify one entry (raises a StoreError subclass, counted, on any failure). ``max_bytes``: refuse a
        larger entry unread (``record_bytes_bound``); ``dtype``: the KV dtype the caller expects."""
        name = key.entry_name(layer)
        try:
            blob = self._read(name, max_bytes)
        except StoreError as e:
            self._failed(name, e)
            raise
        return self._verify(blob, key, layer, tokens, name, dtype=dtype, max_bytes=max_bytes)

    def get(self, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, **kw: Any) -> torch.Tensor:
        return self.get_entry(key, layer, tokens, **kw).tensor

    def get_layers(
        self, key: ChunkKey, layers: Iterable[int], tokens: Sequence[int] | np.ndarray, **kw: Any
    ) -> dict[int, torch.Tensor | StoreError]:
        """Several layers of one chunk; each value is the tensor or the (counted) error for that layer."""
        return {
            i: (e.tensor if isinstance(e, Entry) else e)
            for i, e in self.get_layer_entries(key, layers, tokens, **kw).items()
        }

    def get_layer_entries(
        self, key: ChunkKey, layers: Iterable[int], tokens: Sequence[int] | np.ndarray, *,
        max_bytes: int | None = None, dtype: torch.dtype | None = None,
    ) -> dict[int, Entry | StoreError]:
        """Like ``get_layers`` with record sizes (what a link would carry)."""
        layers = list(layers)
        names = [key.entry_name(i) for i in layers]
        try:
            raw = self._read_many(names, max_bytes)  # copies on every tier (not ``fetch``: no leased views)
        except StoreUnavailable as e:
            self.stats.add(unavailable=len(layers))
            return {i: e for i in layers}
        f = self._fetched(names, raw, max_bytes)
        out: dict[int, Entry | StoreError] = {}
        for i, n, blob in zip(layers, f.names, f.blobs):
            if isinstance(blob, StoreError):
                out[i] = blob
                continue
            try:
                out[i] = self._verify(blob, key, i, tokens, n, dtype=dtype, max_bytes=max_bytes)
            except StoreError as e:
                out[i] = e
        return out

    def fetch(self, items: Sequence[tuple[ChunkKey, int]], max_bytes: int | None = None) -> Fetched:
        """Raw bytes of the (key, layer) entries in one round trip; missing, oversize, unreadable or unreachable
        ones as (counted) errors. ``max_bytes``: the most bytes an entry may have (larger: refused unread)."""
        names = [k.entry_name(layer) for k, layer in items]
        try:
            raw = self._read_many(names, max_bytes)
        except StoreUnavailable as e:
            self.stats.add(unavailable=len(names))
            warn_limited(log, f"store.unavailable.{type(self).__name__}", "%s: unreachable, %d entries recomputed: %s",
                         self.describe(), len(names), e)
            return Fetched(names, [e] * len(names), 0, time.perf_counter())
        return self._fetched(names, raw, max_bytes)

    def _fetched(self, names: list[str], raw: Sequence[bytes | StoreError | None], max_bytes: int | None = None,
                 **kw: Any) -> Fetched:
        """A ``Fetched`` of read bytes; each missing one (None) a counted ``ChunkMissing``, each failed one counted
        (a tier that ignored ``max_bytes`` has its oversize entries refused here)."""
        blobs: list[bytes | StoreError] = []
        nbytes = 0
        for n, b in zip(names, raw):
            if b is None:
                b = ChunkMissing(f"{n}: not in store", n)
            elif not isinstance(b, StoreError) and max_bytes is not None and len(b) > max_bytes:
                b = ChunkOversize(f"{n}: {len(b)} bytes, more than the {max_bytes} a record of this shape takes", n)
            if isinstance(b, StoreError):
                self._failed(n, b)
            else:
                nbytes += len(b)
            blobs.append(b)
        return Fetched(names, blobs, nbytes, time.perf_counter(), **kw)

    def open(
        self, blob: bytes, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, *, copy: bool = True,
        decode: bool = True, dtype: torch.dtype | None = None, max_bytes: int | None = None,
    ) -> Entry:
        """Verify and decode one fetched entry (counted like ``get_entry``); ``copy=False``: a view of ``blob``;
        ``decode=False``: an entry stored in the ZipFusion format stays a ``ZipEntry`` (``decode_record``);
        ``dtype``: the KV dtype the caller expects (another is ``ChunkCorrupt``)."""
        return self._verify(blob, key, layer, tokens, key.entry_name(layer), copy=copy, decode=decode, dtype=dtype,
                            max_bytes=max_bytes)

    def contains(self, key: ChunkKey, layer: int) -> bool:
        try:
            return self._exists(key.entry_name(layer))
        except StoreUnavailable:
            self.stats.add(unavailable=1)
            return False

    def delete(self, key: ChunkKey, layer: int) -> None:
        self._delete(key.entry_name(layer))

    def close(self) -> None:
        """Release connections/handles (no-op by default)."""

    def describe(self) -> str:
        """The tier in a log line."""
        return type(self).__name__

    # ---- helpers
    def _verify(
        self, blob: bytes, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, name: str, copy: bool = True,
        decode: bool = True, dtype: torch.dtype | None = None, max_bytes: int | None = None,
    ) -> Entry:
        if not self._trust_noted:
            self._note_trust()
        try:
            t = decode_record(blob, key, layer, tokens, name, copy=copy, decode=decode, auth=self.auth, dtype=dtype,
                              max_bytes=max_bytes)
        except StoreError as e:
            self._failed(name, e)
            raise
        self.stats.add(hits=1, bytes_read=len(blob))
        return Entry(t, len(blob))

    def _failed(self, name: str, e: StoreError) -> None:
        """Count a failed entry; log it (rate-limited) unless merely missing; delete it if it failed a check."""
        self._count(e)
        if isinstance(e, ChunkMissing):
            return
        warn_limited(log, f"store.{type(e).__name__}.{type(self).__name__}", "%s: entry %s not used (%s: %s)",
                     self.describe(), name, type(e).__name__, e)
        if isinstance(e, ChunkCorrupt) and self.drop_bad and name:
            try:
                self._delete(name)
            except StoreError:
                pass

    def _note_trust(self) -> None:
        """Once per store: say that a tier others can write is trusted when no secret authenticates its records."""
        if self._trust_noted:
            return
        self._trust_noted = True
        if self.auth is None and self.shared_tier:
            log.warning("%s: no store secret (RestoreConfig.secret / KVTIDE_STORE_SECRET): records are checked for "
                        "damage only, and anyone who can write this tier can feed KV to the engine", self.describe())

    def _count(self, e: StoreError) -> None:
        if isinstance(e, ChunkMissing):
            self.stats.add(misses=1)
        elif isinstance(e, TokenMismatch):
            self.stats.add(token_mismatch=1)
        elif isinstance(e, ChunkTruncated):
            self.stats.add(truncated=1)
        elif isinstance(e, ChunkForged):
            self.stats.add(forged=1)
        elif isinstance(e, ChunkOversize):
            self.stats.add(oversize=1)
        elif isinstance(e, ChunkCorrupt):
            self.stats.add(corrupt=1)
        elif isinstance(e, EntryUnreadable):
            self.stats.add(read_errors=1)
        elif isinstance(e, StoreUnavailable):
            self.stats.add(unavailable=1)

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
