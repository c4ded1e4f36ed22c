"""Why a store could not produce a verified entry. Every one is a ``StoreError``: the caller recomputes.

Two scopes: an entry's own failure (missing, corrupt, forged, oversize, unreadable) costs that entry only; a
``StoreUnavailable`` says the tier as a whole cannot be reached, and a loader may stop asking it for the rest of
a restoration. A tier's ``_read_many`` puts per-entry failures in its result list and raises only the tier's.
"""
from __future__ import annotations


class StoreError(Exception):
    """Any failure to produce a verified entry; callers fall back to recompute."""

    def __init__(self, message: str, name: str = "") -> None:
        super().__init__(message)
        self.name = name


class ChunkMissing(StoreError):
    """The entry is not in this store."""


class ChunkCorrupt(StoreError):
    """The entry exists but fails a check (magic, version, length, checksum, metadata, shape, dtype, key)."""


class ChunkTruncated(ChunkCorrupt):
    """The entry is shorter than its header says."""


class TokenMismatch(ChunkCorrupt):
    """The entry is intact but holds other token ids than the caller's prefix (collision or mix-up)."""


class ChunkForged(ChunkCorrupt):
    """The entry fails authentication: a store with a secret met a record without a MAC (versions 1-3, or 4
    unkeyed) or with another secret's, or a store without one met a keyed record it cannot check."""


class ChunkOversize(ChunkCorrupt):
    """The entry is larger than any record the caller can expect; refused before its bytes were read."""


class EntryUnreadable(StoreError):
    """This entry alone could not be read (an I/O error on its file); the tier itself is up."""


class StoreUnavailable(StoreError):
    """The tier cannot be reached (server down, store directory gone): a tier-level failure."""


class StoreFull(StoreError):
    """A write found no room (disk full even after eviction): the entry is not stored, the tier stays up."""
