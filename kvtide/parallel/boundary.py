"""Boundary activations in the KV store: the input hidden states of a shard's first layer, per prefix chunk.

Key: a namespace of its own, derived from the chunk key and the boundary layer,
``H("boundary" || chunk key || layer)``, so a boundary entry can never be read as KV (or KV as a boundary), and
two layouts with different cut points keep separate entries. Its store entry is ``<that hex>.<layer>``.

Record: the store's own (kvtide.store.base, version 1): header, blake2b-128 checksum over metadata and body,
the chunk's token ids (checked on every read), then the tensor. The record format wants ``[2, tokens, ...]``
(K and V); the ``[tokens, hidden]`` activation is stored as ``[2, tokens, hidden/2]`` (its two halves), which is
a view change only. Every check of a KV entry (missing, truncated, checksum, token ids, shape) therefore also
holds for boundary entries, and every tier (memory, disk, Redis, emulated link) stores them unchanged.

Dtype: the compute dtype by default, so a shard replaying from it computes exactly what a full prefill computes
(a BF16 copy of an FP32 activation would not be bit-exact); bytes per token h = hidden * itemsize.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from kvtide.store.base import ChunkCorrupt, StoreError
from kvtide.store.keys import ChunkKey

__all__ = ["boundary_key", "from_record", "iter_boundaries", "load_boundary", "save_boundary", "to_record"]


def boundary_key(key: ChunkKey, layer: int) -> ChunkKey:
    """The key under which chunk ``key``'s boundary activation at ``layer`` (a shard's first layer) is stored."""
    if layer <= 0:
        raise ValueError(f"a boundary layer is the first layer of a shard after the first, got {layer}")
    h = hashlib.blake2b(digest_size=16, person=b"kvtide-bnd-v1")
    h.update(key.hex.encode())
    h.update(int(layer).to_bytes(4, "little"))
    return ChunkKey(h.hexdigest(), key.index)


def to_record(h: torch.Tensor) -> torch.Tensor:
    """[tokens, hidden] -> [2, tokens, hidden/2] (the store's K/V-shaped record)."""
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"boundary activation must be [tokens, even hidden], got {list(h.shape)}")
    t, d = h.shape
    return h.reshape(t, 2, d // 2).transpose(0, 1)


def from_record(x: torch.Tensor, hidden: int) -> torch.Tensor:
    """Inverse of ``to_record``; a record of another shape is corrupt."""
    if x.dim() != 3 or x.shape[0] != 2 or x.shape[2] * 2 != hidden:
        raise ChunkCorrupt(f"boundary record has shape {list(x.shape)}, expected [2, tokens, {hidden // 2}]")
    return x.transpose(0, 1).reshape(x.shape[1], hidden)


def save_boundary(store: Any, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, h: torch.Tensor) -> int:
    """Store one chunk's boundary activation ``h`` [chunk tokens, hidden]; returns the record's bytes."""
    return store.put(boundary_key(key, layer), layer, tokens, to_record(h.detach().to("cpu")))


def load_boundary(store: Any, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray, hidden: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A verified boundary activation [chunk tokens, hidden] and its record size; raises a ``StoreError``."""
    e = store.get_entry(boundary_key(key, layer), layer, tokens)
    h = from_record(e.tensor, hidden)
    if h.shape[0] != len(tokens) or h.dtype != dtype:
        raise ChunkCorrupt(f"boundary record holds {h.shape[0]} tokens of {h.dtype}, expected {len(tokens)} of {dtype}")
    return h, e.nbytes


def iter_boundaries(store: Any, items: Sequence[tuple[ChunkKey, Sequence[int] | np.ndarray]], layer: int, hidden: int,
                    dtype: torch.dtype, *, batch_bytes: int = 16 << 20, pool: ThreadPoolExecutor | None = None
                    ) -> Iterator[tuple[int, torch.Tensor | StoreError, int]]:
    """Many chunks' boundary activations at ``layer``, at the link's rate: yields (item index, verified
    [chunk tokens, hidden] tensor or the ``StoreError`` of that chunk, bytes that crossed the link), in order.

    A store with a batched read path (``fetch`` + ``open``: every tier, and ``BandwidthLimitedStore``, which
    books the bytes on its link when ``fetch`` is called) gets every batch booked up front, in order, so the link
    never idles while earlier batches are verified and placed by the caller (``pool``: threads that verify a
    batch's records in parallel). Entry by entry (``get_entry``), a throttled link waits out each record only
    *after* reading and verifying it, and the caller places it before the next is read: nearly twice the link
    time when checking and placing a record costs about as much as its transfer.
    """
    if not items:
        return
    if not (hasattr(store, "fetch") and hasattr(store, "open")):
        for i, (key, toks) in enumerate(items):
            try:
                h, nb = load_boundary(store, key, layer, toks, hidden, dtype)
            except StoreError as e:
                yield i, e, 0
                continue
            yield i, h, nb
        return
    item_bytes = max(1, len(items[0][1]) * hidden * torch.empty((), dtype=dtype).element_size())
    per = max(1, min(batch_bytes // item_bytes, -(-len(items) // 4)))  # >= 4 batches: little left after the link
    bkeys = [boundary_key(k, layer) for k, _ in items]
    batches = [list(range(a, min(a + per, len(items)))) for a in range(0, len(items), per)]
    fetched = [store.fetch([(bkeys[i], layer) for i in idx]) for idx in batches]  # all booked now, in order

    def open_one(i: int, blob: Any) -> torch.Tensor | StoreError:
        if isinstance(blob, BaseException):
            return blob if isinstance(blob, StoreError) else ChunkCorrupt(f"{type(blob).__name__}: {blob}")
        try:
            e = store.open(blob, bkeys[i], layer, items[i][1], copy=False)
            h = from_record(e.tensor, hidden)  # a contiguous copy (the record holds the two halves apart)
            if h.shape[0] != len(items[i][1]) or h.dtype != dtype:
                raise ChunkCorrupt(f"boundary record holds {h.shape[0]} tokens of {h.dtype}, "
                                   f"expected {len(items[i][1])} of {dtype}")
            return h
        except StoreError as e:
            return e

    for idx, f in zip(batches, fetched):
        f.wait()
        args = [(i, f.blobs[k]) for k, i in enumerate(idx)]
        res = list(pool.map(lambda a: open_one(*a), args)) if pool is not None else [open_one(*a) for a in args]
        for k, (i, r) in enumerate(zip(idx, res)):
            blob = f.blobs[k]
            yield i, r, (0 if isinstance(blob, BaseException) else len(blob))
