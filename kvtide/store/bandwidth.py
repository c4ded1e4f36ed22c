"""Link emulation: a token bucket on a store's load path, so 10/40/80 Gbps can be measured on one machine.

The wrapped store does the real read (and its checks); the wrapper then holds the caller until the bytes
could have crossed a link of the given rate. All users of one ``TokenBucket`` share the link, as
concurrent loads share a NIC.

With ``burst_bytes = 0`` the bucket is a FIFO timeline of the link: ``reserve`` books the bytes behind everything
booked before and says when they will have arrived. ``get_entry`` books and waits at once (the link idles
while the caller verifies and places the entry); ``fetch`` only books, so a caller that fetches the next batch
before it verifies this one keeps the link busy, as a NIC that DMAs into a receive buffer does.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from kvtide.store.base import Entry, Fetched, KVStore, StoreError, StoreStats
from kvtide.store.keys import ChunkKey


def gbps(x: float) -> float:
    """Gigabits per second -> bytes per second."""
    return x * 1e9 / 8


class TokenBucket:
    """Bytes/s limiter. ``burst_bytes`` may pass at once after idle time; beyond that, callers wait."""

    def __init__(self, rate_bytes_per_s: float, burst_bytes: float = 0.0) -> None:
        if not rate_bytes_per_s > 0:
            raise ValueError(f"rate_bytes_per_s must be > 0, got {rate_bytes_per_s!r}")
        if burst_bytes < 0:
            raise ValueError(f"burst_bytes must be >= 0, got {burst_bytes!r}")
        self.rate = float(rate_bytes_per_s)
        self.burst = float(burst_bytes)
        self._tokens = self.burst
        self._last = time.perf_counter()
        self._lock = threading.Lock()
        self.bytes_total = 0
        self.wait_seconds = 0.0

    def reserve(self, nbytes: int) -> float:
        """Take ``nbytes`` from the bucket; returns how long the caller must wait for them."""
        with self._lock:
            now = time.perf_counter()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes
            self.bytes_total += nbytes
            wait = max(0.0, -self._tokens / self.rate)
            self.wait_seconds += wait
            return wait

    def consume(self, nbytes: int) -> float:
        """Block until ``nbytes`` have passed the link; returns the seconds waited."""
        wait = self.reserve(nbytes)
        if wait > 0:
            time.sleep(wait)
        return wait


class BandwidthLimitedStore:
    """Wraps a store: loads are charged to a token bucket by their record size; writes pass unless asked."""

    def __init__(self, inner: KVStore, bucket: TokenBucket, throttle_writes: bool = False) -> None:
        self.inner = inner
        self.bucket = bucket
        self.throttle_writes = throttle_writes

    @classmethod
    def at_gbps(cls, inner: KVStore, gigabits_per_s: float, burst_bytes: float = 0.0) -> "BandwidthLimitedStore":
        return cls(inner, TokenBucket(gbps(gigabits_per_s), burst_bytes))

    @property
    def stats(self) -> StoreStats:
        return self.inner.stats

    def configure_records(self, secret: str | bytes | None = None, store_token_ids: bool = True) -> None:
        self.inner.configure_records(secret, store_token_ids)

    def put(self, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, kv: torch.Tensor) -> int:
        n = self.inner.put(key, layer, tokens, kv)
        if self.throttle_writes:
            self.bucket.consume(n)
        return n

    def get_entry(self, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, **kw: Any) -> Entry:
        e = self.inner.get_entry(key, layer, tokens, **kw)
        self.bucket.consume(e.nbytes)
        return e

    def get(self, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, **kw: Any) -> torch.Tensor:
        return self.get_entry(key, layer, tokens, **kw).tensor

    def get_layers(
        self, key: ChunkKey, layers: Iterable[int], tokens: Sequence[int] | np.ndarray, **kw: Any
    ) -> dict[int, torch.Tensor | StoreError]:
        entries = self.inner.get_layer_entries(key, layers, tokens, **kw)
        n = sum(e.nbytes for e in entries.values() if isinstance(e, Entry))
        if n:
            self.bucket.consume(n)
        return {i: (e.tensor if isinstance(e, Entry) else e) for i, e in entries.items()}

    def fetch(self, items: Sequence[tuple[ChunkKey, int]], max_bytes: int | None = None) -> Fetched:
        """The inner tier's bytes, with ``ready_at`` when they are across the link (booked now, not waited for)."""
        f = self.inner.fetch(items, max_bytes=max_bytes)
        if f.nbytes:
            f.ready_at = time.perf_counter() + self.bucket.reserve(f.nbytes)
        return f

    def open(
        self, blob: bytes, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, *, copy: bool = True,
        decode: bool = True, **kw: Any,
    ) -> Entry:
        return self.inner.open(blob, key, layer, tokens, copy=copy, decode=decode, **kw)

    def contains(self, key: ChunkKey, layer: int) -> bool:
        return self.inner.contains(key, layer)

    def delete(self, key: ChunkKey, layer: int) -> None:
        self.inner.delete(key, layer)

    def close(self) -> None:
        self.inner.close()
