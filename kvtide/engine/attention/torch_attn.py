"""The torch reference backend over the fixed paged cache: works on every device, no optional package."""
from __future__ import annotations

import torch

from ...kernels.paged_attention_ref import decode_attention_ref, prefill_attention_ref, write_kv
from .base import AttentionBackend, BatchLayout


class TorchAttention(AttentionBackend):
    """Reference backend: decodes batched through one padded SDPA, prefill chunks one sequence at a time."""

    name = "torch"

    def plan(self, layout: BatchLayout) -> None:
        dev = self.kv_caches[0].device
        p = layout.page_size
        self.slot_mapping = layout.slot_mapping
        dec = [i for i, n in enumerate(layout.q_lens) if n == 1]
        starts = layout.q_starts
        self.dec_rows = torch.tensor([starts[i] for i in dec], dtype=torch.long, device=dev)
        if dec:
            used = [-(-layout.kv_lens[i] // p) for i in dec]
            width = max(used)
            # Pad each table by repeating its first page: read but masked, so any valid page id will do.
            tables = [layout.block_tables[i][:n] + [layout.block_tables[i][0]] * (width - n) for i, n in zip(dec, used)]
            self.dec_tables = torch.tensor(tables, dtype=torch.long, device=dev)
            self.dec_kv_lens = torch.tensor([layout.kv_lens[i] for i in dec], device=dev)
        self.prefills = [
            (starts[i], n, torch.tensor(layout.block_tables[i], dtype=torch.long, device=dev), layout.kv_lens[i])
            for i, n in enumerate(layout.q_lens) if n > 1
        ]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.kv_caches[layer]
        write_kv(cache, k, v, self.slot_mapping)
        if not self.prefills:  # pure decode step: no scatter needed
            return decode_attention_ref(q, cache, self.dec_tables, self.dec_kv_lens, self.scale)
        out = torch.empty_like(q)
        if len(self.dec_rows):
            out[self.dec_rows] = decode_attention_ref(
                q[self.dec_rows], cache, self.dec_tables, self.dec_kv_lens, self.scale)
        for start, n, pages, kv_len in self.prefills:
            out[start:start + n] = prefill_attention_ref(q[start:start + n], cache, pages, kv_len, self.scale)
        return out
