"""The connector's counters: per interval for vLLM's stats (``get_kv_connector_stats``, Prometheus), and per
process for whoever runs vLLM in process (tests, benches: ``process_totals``).

Every fallback is counted by its cause, so "the tokens were right" can be told apart from "nothing was loaded".
Scheduler-side facts (lookups, hits, the planned split) travel to the worker in the step's metadata and are
counted there, so one stats object carries them all to vLLM's logger.
"""
from __future__ import annotations

import threading
from typing import Iterable

# name -> what it counts (the Prometheus help text)
COUNTERS: dict[str, str] = {
    "lookups": "requests looked up in the store",
    "lookup_unavailable": "lookups the store tier did not answer (counted as misses)",
    "hit_tokens": "prompt tokens found in the store beyond vLLM's own prefix cache",
    "planned_load_tokens": "matched tokens the connector chose to load",
    "planned_recompute_tokens": "matched tokens the planned split left to vLLM to recompute",
    "split_requests": "requests whose match was split between load and recompute",
    "load_requests": "requests that loaded KV",
    "loaded_tokens": "tokens whose KV was placed in vLLM's cache (all layers)",
    "loaded_chunks": "chunk entries (one layer of one chunk) verified and placed",
    "loaded_bytes": "bytes of the entries loaded",
    "load_seconds": "seconds the loader worked (fetch, checks, decode, placing)",
    "load_errors": "chunk entries that could not be used (every cause below)",
    "load_missing": "entries not in the store any more",
    "load_corrupt": "entries failing their checksum, length or metadata checks",
    "load_truncated": "entries shorter than their header",
    "load_forged": "entries failing authentication (no or another secret's MAC)",
    "load_token_mismatch": "entries holding other token ids than the request",
    "load_oversize": "entries larger than a record of their shape, refused unread",
    "load_unavailable": "entries of a tier that did not answer",
    "load_late": "layers not in place by the load deadline",
    "load_failed_requests": "requests with a failed load (vLLM recomputed from the first bad block)",
    "invalid_blocks": "blocks reported to vLLM through get_block_ids_with_load_errors",
    "saved_chunks": "chunks written to the store (every layer)",
    "saved_bytes": "bytes written to the store",
    "save_failures": "chunks whose write failed, was declined or dropped",
    "saves_skipped": "chunks not saved because their step's load failed",
}


class Counters:
    """Thread-safe counters; ``take`` returns and clears the interval's values, ``totals`` never clears."""

    def __init__(self, parent: "Counters | None" = None) -> None:
        self._lock = threading.Lock()
        self._interval: dict[str, float] = {}
        self._totals: dict[str, float] = {}
        self._parent = parent

    def add(self, **counts: float) -> None:
        for k in counts:
            if k not in COUNTERS:
                raise KeyError(f"unknown connector counter {k!r}")
        with self._lock:
            for k, v in counts.items():
                if v:
                    self._interval[k] = self._interval.get(k, 0) + v
                    self._totals[k] = self._totals.get(k, 0) + v
        if self._parent is not None:
            self._parent.add(**counts)

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self._interval = self._interval, {}
        return out

    def totals(self) -> dict[str, float]:
        with self._lock:
            return {k: self._totals.get(k, 0) for k in COUNTERS}


PROCESS = Counters()  # every connector of this process (both sides) adds here too


def process_totals() -> dict[str, float]:
    """Counters of every kvtide connector in this process since it started (vLLM in process:
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or read inside the engine-core process)."""
    return PROCESS.totals()


def aggregate(parts: Iterable[dict[str, float]]) -> dict[str, float]:
    """Sum of several intervals' counters."""
    out: dict[str, float] = {}
    for d in parts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def summary(data: dict[str, float]) -> dict[str, float]:
    """The counters of an interval plus the derived figures a log line wants (the effective load rate)."""
    out = {k: v for k, v in data.items() if v}
    if data.get("load_seconds"):
        out["load_MBps"] = round(data.get("loaded_bytes", 0) / data["load_seconds"] / 1e6, 1)
    return out
