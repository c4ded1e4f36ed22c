"""What every attention backend shares: the step's batch layout, the block-table arrays, the backend interface.

A backend bridges the model's per-layer attention call and the paged KV: planned once per step from a
``BatchLayout``, then called per layer (store the layer's new K/V, attend). This module knows no concrete backend;
``registry`` picks one by name.
"""
from __future__ import annotations

import itertools
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class BatchLayout:
    """One step's flat batch: sequence i owns query rows [q_starts[i], q_starts[i] + q_lens[i])."""

    q_lens: list[int]
    kv_lens: list[int]  # context length after this step's tokens are written
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [T] page * page_size + offset for each new token
    page_size: int
    page_arrays: list[np.ndarray] | None = None  # block_tables as int32 arrays (PageArrays), when the caller has them

    @property
    def q_starts(self) -> list[int]:
        out, s = [], 0
        for n in self.q_lens:
            out.append(s)
            s += n
        return out

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.q_lens)

    def page_table(self, rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FlashInfer-style CPU int32 (indptr [n + 1], indices [pages used], last_page_len [n]) of sequences
        ``rows`` (default all). Built through numpy: a large batch's page table is on every step's host path, and
        ``torch.tensor`` over a Python list of page ids is several times slower."""
        rows = range(len(self.kv_lens)) if rows is None else rows
        p = self.page_size
        kv = np.fromiter((self.kv_lens[i] for i in rows), dtype=np.int64)
        used = -(-kv // p)
        indptr = np.zeros(used.size + 1, dtype=np.int32)
        np.cumsum(used, out=indptr[1:])
        if self.page_arrays is not None:
            parts = [self.page_arrays[i][:n] for i, n in zip(rows, used.tolist())]
            indices = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        else:
            tables = (self.block_tables[i][:n] for i, n in zip(rows, used.tolist()))
            indices = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(indptr[-1]))
        last = (kv - (used - 1) * p).astype(np.int32)
        return torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last)


class PageArrays:
    """int32 copies of block tables, kept between steps and extended as the lists grow: a decode step's page table
    is then one concatenate instead of a walk over every page id.

    Relies on the engine's block tables being append-only lists (``Sequence.pages`` only grows; a sequence that
    loses its pages gets a new list): an entry is reused only for the same list object, and only its first
    ``len(array)`` ids, which such a list never changes."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[list[int], np.ndarray]] = {}

    def __call__(self, tables: list[list[int]]) -> list[np.ndarray]:
        cache, out = {}, []
        for t in tables:
            hit = self._cache.get(id(t))
            if hit is None or hit[0] is not t or len(hit[1]) > len(t):
                arr = np.array(t, dtype=np.int32)
            elif len(hit[1]) < len(t):
                arr = np.concatenate([hit[1], np.array(t[len(hit[1]):], dtype=np.int32)])
            else:
                arr = hit[1]
            cache[id(t)] = (t, arr)  # holding the list keeps its id from being reused by another
            out.append(arr)
        self._cache = cache  # only this step's tables: finished sequences' lists are let go
        return out


class AttentionBackend:
    name = "base"
    whole_step_graphs = False  # captured whole by default (EngineConfig.full_cuda_graphs=None) where plan_graph can

    def __init__(self, kv_caches: list[torch.Tensor], num_heads: int, head_dim: int):
        self.kv_caches = kv_caches
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def plan(self, layout: BatchLayout) -> None:
        raise NotImplementedError

    def plan_graph(self, layout: BatchLayout) -> Hashable | None:
        """Plan a decode-only step that will run inside a CUDA graph capturing the whole step, attention included
        (``EngineConfig.full_cuda_graphs``): the plan goes into fixed buffers, and the key returned names what the
        captured graph bakes in (a later step with the same key replays it). None: this backend cannot be captured
        (the step is planned as usual, and attention runs eagerly between graph pieces)."""
        self.plan(layout)
        return None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError
