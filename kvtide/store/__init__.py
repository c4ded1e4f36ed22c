"""KV tiers keyed by prefix-chunk hash: memory (LRU; pinned: page-locked, DMA loads), disk (persistent), Redis (shared), link emulation."""

from kvtide.store.bandwidth import BandwidthLimitedStore, TokenBucket, gbps
from kvtide.store.base import (
    ChunkCorrupt,
    ChunkForged,
    ChunkMissing,
    ChunkOversize,
    ChunkTruncated,
    EntryUnreadable,
    StoreFull,
    Entry,
    KVStore,
    StoreError,
    StoreStats,
    StoreUnavailable,
    TokenMismatch,
    decode_record,
    encode_record,
    record_bytes_bound,
)
from kvtide.store.disk import DiskStore
from kvtide.store.keys import ChunkKey, KeySpace, chunk_keys, chunk_tokens
from kvtide.store.memory import MemoryStore
from kvtide.store.pinned import PinnedMemoryStore

__all__ = [
    "BandwidthLimitedStore",
    "ChunkCorrupt",
    "ChunkForged",
    "ChunkKey",
    "ChunkMissing",
    "ChunkOversize",
    "ChunkTruncated",
    "EntryUnreadable",
    "StoreFull",
    "DiskStore",
    "Entry",
    "KVStore",
    "KeySpace",
    "MemoryStore",
    "PinnedMemoryStore",
    "StoreError",
    "StoreStats",
    "StoreUnavailable",
    "TokenBucket",
    "TokenMismatch",
    "chunk_keys",
    "chunk_tokens",
    "decode_record",
    "encode_record",
    "record_bytes_bound",
    "gbps",
]


def __getattr__(name: str):  # RedisStore imports the optional `redis` client only when asked for
    if name == "RedisStore":
        from kvtide.store.redis_store import RedisStore

        return RedisStore
    raise AttributeError(name)
