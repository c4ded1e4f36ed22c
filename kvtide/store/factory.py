"""Open a store from a one-line spec, so configs and command lines name tiers the same way everywhere.

    memory            in-process LRU (``memory_bytes`` bound)
    pinned            the same in page-locked host memory (CUDA): loads go to the GPU by DMA, no staging copy
    disk:PATH[?capacity=SIZE]   one file per entry under PATH (persists across runs); SIZE (e.g. 10G): LRU bound
    redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?ttl=S&prefix=P]   a Redis server (shared by several engines);
    rediss://...      the same over TLS (``kvtide/store/redis_store.py`` has the URL's parameters)

Remote tiers (disk, Redis) sit behind a circuit breaker (``kvtide/store/breaker.py``: ``breaker_failures``
consecutive failures skip the tier for ``breaker_backoff_s``; 0 failures: no breaker); Redis operations time out
after ``timeout_s``, and a Redis that does not answer a ping at open is logged (once) and skipped for a back-off,
never raised: the engine runs without it. ``bandwidth_gbps`` wraps the tier in a token bucket on the load path
(link emulation).
"""

from __future__ import annotations

from typing import Any

from kvtide.log import get_logger, warn_limited
from kvtide.store.bandwidth import BandwidthLimitedStore
from kvtide.store.base import KVStore
from kvtide.store.breaker import CircuitBreaker, guarded
from kvtide.store.disk import DiskStore, parse_disk_spec
from kvtide.store.memory import MemoryStore
from kvtide.store.pinned import PinnedMemoryStore

log = get_logger("store")


def check_spec(spec: str) -> None:
    """Raise ValueError for a spec ``open_store`` would not understand (no connection is made)."""
    if spec in ("memory", "pinned"):
        return
    if spec.startswith("disk:"):
        parse_disk_spec(spec[5:])  # raises for a missing path or a bad option
        return
    if spec.startswith(("redis://", "rediss://")):
        from kvtide.store.redis_store import parse_spec

        parse_spec(spec)
        return
    shown = spec if "@" not in spec else "...@" + spec.rsplit("@", 1)[1]  # never echo credentials
    raise ValueError(f"unknown store {shown!r}: use 'memory', 'pinned', 'disk:PATH' or "
                     "'redis[s]://[user:password@]host[:port][/db][?ttl=S&prefix=P]'")


def open_tier(spec: str, memory_bytes: int = 1 << 30, *, timeout_s: float = 0.5, breaker_failures: int = 3,
              breaker_backoff_s: float = 5.0) -> KVStore:
    """The tier named by ``spec``; a remote one (disk, Redis) behind its circuit breaker unless
    ``breaker_failures`` is 0. A Redis that does not answer at open gets one warning and starts skipped."""
    check_spec(spec)
    if spec == "memory":
        return MemoryStore(memory_bytes)
    if spec == "pinned":
        return PinnedMemoryStore(memory_bytes)
    if breaker_failures < 0:
        raise ValueError(f"breaker_failures must be >= 0 (0: no breaker), got {breaker_failures!r}")

    def breaker(name: str) -> CircuitBreaker | None:
        return CircuitBreaker(name, breaker_failures, breaker_backoff_s) if breaker_failures else None

    if spec.startswith("disk:"):
        path, capacity = parse_disk_spec(spec[5:])
        return guarded(DiskStore)(path, capacity_bytes=capacity, breaker=breaker(spec))
    from kvtide.store.redis_store import RedisStore, parse_spec, redact

    url, ttl, prefix = parse_spec(spec)
    tier = guarded(RedisStore)(prefix=prefix, ttl_seconds=ttl, socket_timeout=timeout_s, url=url,
                               breaker=breaker(redact(spec)))
    why = tier.check()
    if why is not None:
        warn_limited(log, f"tier-unreachable:{tier.where}",
                     "store tier %s does not answer at start (%s); the engine runs without it (lookups miss, writes "
                     "are dropped) and tries it again %s", tier.where, why,
                     f"in {breaker_backoff_s:g} s" if tier.breaker is not None else "on every operation")
        if tier.breaker is not None:
            tier.breaker.trip(why)
    return tier


def open_store(spec: str, memory_bytes: int = 1 << 30, bandwidth_gbps: float | None = None, **tier_options: Any
               ) -> Any:
    """The tier (``open_tier``, which takes ``tier_options``), behind an emulated link when ``bandwidth_gbps`` is
    set."""
    tier = open_tier(spec, memory_bytes, **tier_options)
    if bandwidth_gbps is None:
        return tier
    return BandwidthLimitedStore.at_gbps(tier, bandwidth_gbps)
