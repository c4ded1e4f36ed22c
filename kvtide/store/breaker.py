"""Circuit breaker for a remote tier (Redis, disk): a tier that keeps failing is skipped, not waited on.

States: *closed* (operations run; consecutive tier failures counted), *open* (after ``failures`` consecutive
failures: every operation fails at once with ``TierSkipped``, no I/O, for ``backoff_s``), *half-open* (the back-off
is over: one operation runs as a probe while the others are still skipped; its success closes the breaker, its
failure opens it for another back-off). Opens, probes and skipped operations are counted; "tier down" and "tier up"
are logged (rate-limited).

A tier failure is a raw operation raising ``StoreUnavailable`` (connection refused, timeout, authentication, I/O
error). Any other ``StoreError`` (a missing, corrupt or oversized entry) is an answer from a live tier and counts
as a success, so bad entries never take a tier down.

``GuardedTier`` is the mixin that puts a tier's raw operations behind its breaker; ``guarded(DiskStore)`` is that
tier class with it (``open_tier`` builds remote tiers so). ``present`` is ``contains`` for callers that must tell
"not stored" from "no answer" (the restorer's lookup sends a request whose lookup got no answer to plain prefill).
"""
from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, TypeVar

from kvtide.log import get_logger, warn_limited
from kvtide.store.base import KVStore, StoreError, StoreUnavailable
from kvtide.store.keys import ChunkKey

log = get_logger("store")
T = TypeVar("T")


class TierSkipped(StoreUnavailable):
    """The tier was not asked: its circuit breaker is open."""


@dataclass
class BreakerStats:
    failures: int = 0  # tier failures seen (consecutive or not)
    opens: int = 0  # closed/half-open -> open
    closes: int = 0  # open/half-open -> closed (tier up again)
    probes: int = 0  # operations let through after a back-off
    skipped: int = 0  # operations refused while open
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


class CircuitBreaker:
    """Per-tier breaker; thread-safe. ``failures`` consecutive tier failures open it for ``backoff_s`` seconds."""

    def __init__(self, name: str, failures: int = 3, backoff_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(failures, int) or isinstance(failures, bool) or failures < 1:
            raise ValueError(f"breaker failures must be an int >= 1, got {failures!r}")
        if not backoff_s > 0:
            raise ValueError(f"breaker backoff_s must be > 0 seconds, got {backoff_s!r}")
        self.name = name
        self.failures = failures
        self.backoff_s = float(backoff_s)
        self.stats = BreakerStats()
        self._clock = clock
        self._lock = threading.Lock()
        self._consecutive = 0
        self._open_until: float | None = None  # None: closed
        self._probing = False  # a probe is in flight (half-open)
        self._local = threading.local()  # depth of guarded calls on this thread (nested ones pass through)

    @property
    def state(self) -> str:
        """``closed``, ``open`` (skipping) or ``half-open`` (back-off over: the next operation probes)."""
        with self._lock:
            if self._open_until is None:
                return "closed"
            return "half-open" if self._probing or self._clock() >= self._open_until else "open"

    def allow(self) -> bool:
        """Whether an operation may run now (False: skip it, counted). After the back-off, one caller probes."""
        with self._lock:
            if self._open_until is None:
                return True
            if not self._probing and self._clock() >= self._open_until:
                self._probing = True
                self._bump(probes=1)
                return True
            self._bump(skipped=1)
            return False

    def success(self) -> None:
        with self._lock:
            self._consecutive = 0
            was_open = self._open_until is not None
            self._open_until, self._probing = None, False
            if was_open:
                self._bump(closes=1)
        if was_open:
            warn_limited(log, f"tier-up:{self.name}", "store tier %s answers again: circuit closed", self.name)

    def failure(self, why: object = "") -> None:
        with self._lock:
            self._consecutive += 1
            self._bump(failures=1)
            probe_failed = self._probing
            opened = probe_failed or (self._open_until is None and self._consecutive >= self.failures)
            if opened:
                self._open(why)
        if opened and not probe_failed:
            warn_limited(log, f"tier-down:{self.name}",
                         "store tier %s is down after %d consecutive failures (%s): skipping it for %.1f s, then "
                         "probing; requests recompute meanwhile", self.name, self._consecutive, why, self.backoff_s)

    def trip(self, why: object = "") -> None:
        """Open now (a startup check that got no answer): skip the tier for one back-off, then probe."""
        with self._lock:
            if self._open_until is None:
                self._open(why)

    def release(self) -> None:
        """A probe that ended in neither a tier failure nor an answer (a bug, an interrupt): let another probe."""
        with self._lock:
            self._probing = False

    def call(self, op: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``op`` under the breaker: ``TierSkipped`` without running it when open; its outcome recorded.
        A guarded call made inside another on the same thread (a tier's ``_read_many`` looping ``_read``) runs as
        part of the outer one."""
        depth = getattr(self._local, "depth", 0)
        if depth:
            return op(*args, **kwargs)
        if not self.allow():
            raise TierSkipped(f"store tier {self.name} skipped: circuit open after repeated failures")
        self._local.depth = 1
        try:
            out = op(*args, **kwargs)
        except StoreUnavailable as e:
            self.failure(e)
            raise
        except StoreError:
            self.success()  # the tier answered: this entry is missing or bad
            raise
        except BaseException:
            self.release()
            raise
        finally:
            self._local.depth = 0
        self.success()
        return out

    def _open(self, why: object) -> None:
        # caller holds the lock
        self._open_until = self._clock() + self.backoff_s
        self._probing = False
        self._bump(opens=1)

    def _bump(self, **counts: int) -> None:
        with self.stats._lock:
            for k, v in counts.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)


class GuardedTier:
    """Mixin for a ``KVStore`` tier class: its raw operations run under ``self.breaker`` (None: unguarded).

    Use as ``class X(GuardedTier, DiskStore)`` (or ``guarded(DiskStore)``); the constructor takes ``breaker=`` and
    passes everything else to the tier."""

    breaker: CircuitBreaker | None = None

    def __init__(self, *args: Any, breaker: CircuitBreaker | None = None, **kwargs: Any) -> None:
        self.breaker = breaker  # first: a tier's constructor may already use the tier (a sweep at open)
        super().__init__(*args, **kwargs)

    def _guard(self, op: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        b = self.breaker
        return op(*args, **kwargs) if b is None else b.call(op, *args, **kwargs)

    def _write(self, *args: Any, **kwargs: Any) -> Any:
        return self._guard(super()._write, *args, **kwargs)  # type: ignore[misc]

    def _read(self, *args: Any, **kwargs: Any) -> Any:
        return self._guard(super()._read, *args, **kwargs)  # type: ignore[misc]

    def _read_many(self, *args: Any, **kwargs: Any) -> Any:
        return self._guard(super()._read_many, *args, **kwargs)  # type: ignore[misc]

    def _delete(self, *args: Any, **kwargs: Any) -> Any:
        return self._guard(super()._delete, *args, **kwargs)  # type: ignore[misc]

    def _exists(self, *args: Any, **kwargs: Any) -> Any:
        return self._guard(super()._exists, *args, **kwargs)  # type: ignore[misc]


@functools.cache
def guarded(tier: type) -> type:
    """``tier`` (a ``KVStore`` subclass) with its raw operations behind a breaker (``GuardedTier``)."""
    if not (isinstance(tier, type) and issubclass(tier, KVStore)):
        raise TypeError(f"guarded() takes a KVStore subclass, got {tier!r}")
    return type(f"Guarded{tier.__name__}", (GuardedTier, tier),
                {"__doc__": f"{tier.__name__} behind a circuit breaker (kvtide.store.breaker).",
                 "__module__": tier.__module__})


def _tier(store: Any) -> Any:
    """The tier under wrappers that keep it as ``inner`` (``BandwidthLimitedStore``)."""
    seen = 0
    while not isinstance(store, KVStore) and hasattr(store, "inner") and seen < 8:
        store, seen = store.inner, seen + 1
    return store


def breaker_of(store: Any) -> CircuitBreaker | None:
    """The breaker of ``store``'s tier (through wrappers), or None."""
    return getattr(_tier(store), "breaker", None)


def present(store: Any, key: ChunkKey, layer: int) -> bool:
    """``store.contains(key, layer)``, except that a tier that gives no answer (down, timed out, skipped by its
    breaker) raises ``StoreUnavailable`` (counted in the tier's stats) instead of answering False."""
    tier = _tier(store)
    if not isinstance(tier, KVStore):
        return bool(store.contains(key, layer))
    try:
        return bool(tier._exists(key.entry_name(layer)))
    except StoreUnavailable:
        tier.stats.add(unavailable=1)
        raise
