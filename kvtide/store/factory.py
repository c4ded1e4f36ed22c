"""Open a store from a one-line spec, so configs and command lines name tiers the same way everywhere.

    memory            in-process LRU (``memory_bytes`` bound)
    pinned            the same in page-locked host memory (CUDA): loads go to the GPU by DMA, no staging copy
    disk:PATH         one file per entry under PATH (persists across runs)
    redis://HOST:PORT[/DB]   a Redis server (shared by several engines)

``bandwidth_gbps`` wraps the tier in a token bucket on the load path (link emulation).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from kvtide.store.bandwidth import BandwidthLimitedStore
from kvtide.store.base import KVStore
from kvtide.store.disk import DiskStore
from kvtide.store.memory import MemoryStore
from kvtide.store.pinned import PinnedMemoryStore


def check_spec(spec: str) -> None:
    """Raise ValueError for a spec ``open_store`` would not understand (no connection is made)."""
    if spec in ("memory", "pinned"):
        return
    if spec.startswith("disk:"):
        if not spec[5:]:
            raise ValueError("store 'disk:PATH' needs a path")
        return
    if spec.startswith("redis://"):
        u = urlparse(spec)
        if not u.hostname:
            raise ValueError(f"store {spec!r}: redis URL needs a host")
        _ = u.port  # raises ValueError on a bad port
        db = u.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"store {spec!r}: redis database must be a number")
        return
    raise ValueError(f"unknown store {spec!r}: use 'memory', 'pinned', 'disk:PATH' or 'redis://host:port[/db]'")


def open_tier(spec: str, memory_bytes: int = 1 << 30) -> KVStore:
    """The raw tier named by ``spec``."""
    check_spec(spec)
    if spec == "memory":
        return MemoryStore(memory_bytes)
    if spec == "pinned":
        return PinnedMemoryStore(memory_bytes)
    if spec.startswith("disk:"):
        return DiskStore(spec[5:])
    from kvtide.store.redis_store import RedisStore

    u = urlparse(spec)
    db = u.path.strip("/")
    return RedisStore(host=u.hostname or "127.0.0.1", port=u.port or 6379, db=int(db) if db else 0)


def open_store(spec: str, memory_bytes: int = 1 << 30, bandwidth_gbps: float | None = None) -> Any:
    """The tier, behind an emulated link when ``bandwidth_gbps`` is set."""
    tier = open_tier(spec, memory_bytes)
    if bandwidth_gbps is None:
        return tier
    return BandwidthLimitedStore.at_gbps(tier, bandwidth_gbps)
