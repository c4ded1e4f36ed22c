"""The store each side of the connector talks to, opened from the config.

vLLM builds two connector objects, one in its scheduler and one in each worker (with one worker, both live in the
engine-core process). Disk and Redis tiers are opened by each side on its own; an in-process tier (``memory``,
``pinned``) is shared by the two through a per-process registry, or the scheduler would look up a store the worker
never wrote. ``bandwidth_gbps`` puts an emulated link on the worker's loads (``BandwidthLimitedStore``); lookups
only ask whether an entry exists and pass. With ``store_codec="zip"`` the writer's store encodes each entry in the
ZipFusion format on its own thread (``ZipWrites``), off vLLM's step.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np
import torch

from kvtide.config import RestoreConfig
from kvtide.store import zip_entry
from kvtide.store.factory import open_store, open_tier
from kvtide.store.bandwidth import BandwidthLimitedStore
from kvtide.store.keys import ChunkKey

_SHARED: dict[tuple[str, int], Any] = {}
_LOCK = threading.Lock()


def _tier(cfg: RestoreConfig) -> Any:
    opts = dict(timeout_s=cfg.store_timeout_s, breaker_failures=cfg.breaker_failures,
                breaker_backoff_s=cfg.breaker_backoff_s)
    if cfg.store not in ("memory", "pinned"):
        return open_tier(cfg.store, cfg.memory_bytes, **opts)
    with _LOCK:
        key = (cfg.store, cfg.memory_bytes)
        if key not in _SHARED:
            _SHARED[key] = open_store(cfg.store, cfg.memory_bytes, **opts)
        return _SHARED[key]


def open_connector_store(cfg: RestoreConfig, num_layers: int, *, loads: bool) -> Any:
    """The tier of ``cfg.store`` with the config's record settings; ``loads``: the worker's handle (behind the
    emulated link when ``bandwidth_gbps`` is set; a disk tier drops chunks that miss layers)."""
    tier = _tier(cfg)
    tier.configure_records(cfg.secret, cfg.store_token_ids)
    if not loads:
        return tier
    prune = getattr(tier, "prune_incomplete", None)
    if prune is not None:
        prune(num_layers)
    if cfg.bandwidth_gbps is not None:
        return BandwidthLimitedStore.at_gbps(tier, cfg.bandwidth_gbps)
    return tier


def close_shared() -> None:
    """Close and forget the in-process tiers (tests)."""
    with _LOCK:
        for s in _SHARED.values():
            s.close()
        _SHARED.clear()


class ZipWrites:
    """A store whose ``put`` keeps bfloat16 KV in the ZipFusion format (encoded here, on the writer's thread)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def put(self, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, kv: torch.Tensor) -> int:
        return self.inner.put(key, layer, tokens, zip_entry.from_tensor(kv) if isinstance(kv, torch.Tensor) else kv)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
