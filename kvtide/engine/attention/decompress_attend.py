"""Attention over the compressed pool (compress=True): decompress-then-attend, the paper's baseline (Figure 1).

Per layer: write the new tokens' K/V into their raw pages in the pool, rebuild the BF16 values of every page
the step reads into a scratch buffer laid out like the fixed cache ([n, 2, page_size, kv_heads, head_dim]),
then run an unchanged dense backend (torch reference, or FlashInfer) on the scratch with page ids renumbered
0..n-1. Correct by construction (the scratch holds the bits the fixed cache would), and slow on purpose: it is
what the fused kernel (attention reading the pool directly) is measured against.
"""
from __future__ import annotations

import torch

from ...cache.zip_pages import ZipPagedKV
from .base import AttentionBackend, BatchLayout


class DecompressThenAttend(AttentionBackend):
    def __init__(self, pool: ZipPagedKV, inner: AttentionBackend):
        super().__init__(inner.kv_caches, inner.num_heads, inner.head_dim)
        self.name = f"decompress+{inner.name}"
        self.pool = pool
        self.inner = inner

    def _scratch(self, n: int) -> torch.Tensor:
        s = self.inner.kv_caches[0]
        if s.shape[0] < n:  # grow geometrically; one buffer serves every layer in turn
            s = torch.empty((max(n, 2 * s.shape[0]),) + tuple(s.shape[1:]), dtype=s.dtype, device=s.device)
            self.inner.kv_caches[0] = s
        return s

    def plan(self, layout: BatchLayout) -> None:
        p = layout.page_size
        used = [table[:-(-kv // p)] for table, kv in zip(layout.block_tables, layout.kv_lens)]
        pages = list(dict.fromkeys(pid for table in used for pid in table))  # first-seen order, unique
        local = {pid: i for i, pid in enumerate(pages)}
        tables = [[local[pid] for pid in table] for table in used]
        slots = [tables[i][pos // p] * p + pos % p
                 for i, (q, kv) in enumerate(zip(layout.q_lens, layout.kv_lens)) for pos in range(kv - q, kv)]
        dev = self.pool.device
        self.pages = torch.tensor(pages, dtype=torch.long, device=dev)
        self.slot_mapping = layout.slot_mapping
        # once per step, for every layer's write (the fused write on a GPU places each value itself)
        self.write_rows = None if self.pool.fused_write else self.pool.write_rows(layout.slot_mapping)
        self.scratch = self._scratch(len(pages))
        self.inner.plan(BatchLayout(layout.q_lens, layout.kv_lens, tables,
                                    torch.tensor(slots, dtype=torch.long, device=dev), p))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.write(layer, k, v, self.slot_mapping, self.write_rows)
        return self.attend(layer, q, k, v)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention once the new K/V are in the pool (the fused backend writes them for all rows itself)."""
        self.pool.read_pages(layer, self.pages, out=self.scratch[: self.pages.numel()])
        return self.inner(0, q, k, v)  # its own write of k, v into the scratch stores the same bits again
