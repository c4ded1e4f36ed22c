"""The KVServe profiles a restorer stores entries under (``RestoreConfig.store_profiles``), and what each costs.

Each profile's entries have their own keys (``kvtide.store.keys.profile_key``). Per profile this keeps what the planner needs:
stored bytes per token per layer (mean of the records written or loaded) and decode seconds per token per layer
(timed on the writer's first encodings of it, then learnt from the restorations that loaded it). Which requests a
profile may serve: a lossless pipeline any; a lossy one only requests whose ``kv_min_quality`` is below 1 and at
most its quality (so a lossless request never gets a lossy entry).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..store.keys import ChunkKey, profile_key
from ..store.profile_entry import PendingProfileEntry, check_profile_name
from ..transfer.errors import SpecError
from ..transfer.pipeline import Pipeline
from ..transfer.store_codec import pipeline  # registers the pipelines as the store's profile codec

PROBES = 4  # encodings of a profile also decoded on the writer's thread, to time its decode before it is used
_EWMA = 0.3  # weight of a restoration's measured decode rate


class LookupBudgetSpent(Exception):
    """A profile's lookups ran out of the step's ``lookup_budget_s`` before every chunk was checked."""


@dataclass
class _Cost:
    """What is known of one profile's entries: record bytes and count, decode seconds and decoded entries."""

    bytes: float = 0.0
    entries: int = 0
    decode_seconds_per_entry: float | None = None
    probes: int = 0


@dataclass(frozen=True)
class StoredProfile:
    spec: str
    quality: float
    lossless: bool

    def serves(self, min_quality: float) -> bool:
        """Whether a request needing ``min_quality`` may be restored from this profile's entries."""
        return self.lossless or (min_quality < 1.0 and self.quality >= min_quality)


class StoredProfiles:
    """The configured profiles of one restorer: their keys, their costs, and the lookups of their entries."""

    def __init__(self, profiles: Sequence[tuple[str, float]], chunk: int, num_layers: int, device: Any = None) -> None:
        self.profiles = []
        for spec, q in profiles:
            try:
                p = Pipeline(spec)
            except (SpecError, TypeError) as e:
                raise ValueError(f"RestoreConfig.store_profiles entry {spec!r} is not a pipeline spec: {e}") from None
            why = check_profile_name(p.to_spec())
            if why is not None:
                raise ValueError(f"RestoreConfig.store_profiles entry {spec!r}: {why}")
            if any(x.spec == p.to_spec() for x in self.profiles):
                raise ValueError(f"RestoreConfig.store_profiles names {p.to_spec()!r} twice")
            self.profiles.append(StoredProfile(p.to_spec(), q, p.lossless))
        self.chunk, self.num_layers, self.device = chunk, num_layers, device
        self._costs = {p.spec: _Cost() for p in self.profiles}
        self._lock = threading.Lock()
        self.pending: set[str] = set()  # key hexes of profile chunks handed to the writer (its reports tell them)

    def __bool__(self) -> bool:
        return bool(self.profiles)

    @staticmethod
    def canonical(spec: str) -> str:
        return pipeline(spec).to_spec()

    def get(self, spec: str) -> StoredProfile:
        return next(p for p in self.profiles if p.spec == spec)

    @staticmethod
    def keys(spec: str, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """The profile's keys of these (lossless) chunk keys."""
        return [profile_key(k, spec) for k in keys]

    # ---- writing ---------------------------------------------------------------------------------------------
    def pending_layers(self, spec: str, layers: list[Any]) -> list[PendingProfileEntry]:
        """One chunk's layers (plain KV tensors) to be encoded by ``spec`` on the writer's thread; the first
        ``PROBES`` encodings of a profile are decode-timed too."""
        with self._lock:
            c = self._costs[spec]
            probe = c.probes < PROBES
            c.probes += probe
        out = []
        for i, kv in enumerate(layers):
            out.append(PendingProfileEntry(kv, spec, probe=probe and i == 0, probe_device=self.device,
                                           on_encoded=self._on_encoded))
        return out

    def _on_encoded(self, spec: str, encode_s: float, decode_s: float | None, tokens: int) -> None:
        if decode_s is None:
            return
        with self._lock:
            c = self._costs[spec]
            c.decode_seconds_per_entry = decode_s if c.decode_seconds_per_entry is None else \
                (1 - _EWMA) * c.decode_seconds_per_entry + _EWMA * decode_s

    def observe_written(self, spec: str, nbytes: int, entries: int) -> None:
        """Records of ``spec`` written (the writer's count): the bytes per token the planner charges."""
        with self._lock:
            c = self._costs[spec]
            c.bytes, c.entries = c.bytes + nbytes, c.entries + entries

    def observe_loaded(self, spec: str, nbytes: int, entries: int, decode_seconds: float, decoded: int) -> None:
        """A restoration that loaded ``entries`` records of ``spec`` (``nbytes``) and decoded ``decoded`` of them in
        ``decode_seconds``."""
        with self._lock:
            c = self._costs[spec]
            if entries and not c.entries:  # nothing written here (another process's entries): learn the size
                c.bytes, c.entries = float(nbytes), entries
            if decoded:
                per = decode_seconds / decoded
                c.decode_seconds_per_entry = per if c.decode_seconds_per_entry is None else \
                    (1 - _EWMA) * c.decode_seconds_per_entry + _EWMA * per

    # ---- planning --------------------------------------------------------------------------------------------
    def bytes_per_token(self, spec: str, written: tuple[int, int], fallback: float) -> float:
        """s of ``spec``: the mean record bytes per token of its entries (``written``: the live writer's (bytes,
        entries) of it, not yet folded in), else ``fallback`` (the plain size: no ratio is assumed unseen)."""
        with self._lock:
            c = self._costs[spec]
            nbytes, entries = c.bytes + written[0], c.entries + written[1]
        return nbytes / (entries * self.chunk) if entries and nbytes else fallback

    def decode_seconds_per_token(self, spec: str) -> float:
        with self._lock:
            per = self._costs[spec].decode_seconds_per_entry
        return 0.0 if per is None else per / self.chunk

    def eligible(self, min_quality: float) -> list[StoredProfile]:
        return [p for p in self.profiles if p.serves(min_quality)]

    def held(self, present: Callable[[ChunkKey], bool], spec: str, jobs: Sequence[tuple[Sequence[ChunkKey], int, int]],
             spent: Callable[[], bool] | None = None) -> list[list[ChunkKey]] | None:
        """The profile's chunk keys of each (lossless keys, start, cached) when the store holds every chunk of
        [start, cached) under ``spec``, else None (also when the tier gives no answer).

        ``present(key)``: whether the store holds the key's last layer (the writer stores layers in order); the
        restorer's lookup, whose time counts against the step's ``lookup_budget_s``. ``spent()`` is asked before
        every lookup: once the budget is gone, ``LookupBudgetSpent`` is raised (the profile is not used now), so a
        slow tier stalls the step no longer on profile lookups than on lossless ones."""
        C, out = self.chunk, []
        for lossless, start, cached in jobs:
            keys = self.keys(spec, lossless)
            for k in keys[start // C:cached // C]:
                if spent is not None and spent():
                    raise LookupBudgetSpent(spec)
                try:
                    if not present(k):
                        return None
                except Exception:  # noqa: BLE001 - StoreUnavailable or a tier's error: this profile is not used now
                    return None
            out.append(keys)
        return out
