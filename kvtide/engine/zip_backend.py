"""Attention over the compressed pool (compress=True): decompress-then-attend, the paper's baseline (Figure 1).

Per layer: write the new tokens' K/V into their raw pages in the pool, rebuild the BF16 values of every page
the step reads into a scratch buffer laid out like the fixed cache ([n, 2, page_size, kv_heads, head_dim]),
then run an unchanged dense backend (torch reference, or FlashInfer) on the scratch with page ids renumbered
0..n-1. Correct by construction (the scratch holds the bits the fixed cache would), and slow on purpose: it is
what the fused kernel (attention reading the pool directly) is measured against.
"""
from __future__ import annotations

import torch

from ..cache.zip_pages import ZipPagedKV
from .attention import AttentionBackend, BatchLayout, TorchAttention


class DecompressThenAttend(AttentionBackend):
    def __init__(self, store: ZipPagedKV, inner: AttentionBackend):
        super().__init__(inner.kv_caches, inner.num_heads, inner.head_dim)
        self.name = f"decompress+{inner.name}"
        self.store = store
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
        dev = self.store.device
        self.pages = torch.tensor(pages, dtype=torch.long, device=dev)
        self.slot_mapping = layout.slot_mapping
        # once per step, for every layer's write (the fused write on a GPU places each value itself)
        self.write_rows = None if self.store.fused_write else self.store.write_rows(layout.slot_mapping)
        self.scratch = self._scratch(len(pages))
        self.inner.plan(BatchLayout(layout.q_lens, layout.kv_lens, tables,
                                    torch.tensor(slots, dtype=torch.long, device=dev), p))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.store.write(layer, k, v, self.slot_mapping, self.write_rows)
        return self.attend(layer, q, k, v)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention once the new K/V are in the pool (the fused backend writes them for all rows itself)."""
        self.store.read_pages(layer, self.pages, out=self.scratch[: self.pages.numel()])
        return self.inner(0, q, k, v)  # its own write of k, v into the scratch stores the same bits again


def _flashinfer_serves(store: ZipPagedKV, head_dim: int) -> bool:
    from .flashinfer_backend import flashinfer_unsupported

    return store.device.type == "cuda" and flashinfer_unsupported(head_dim) is None


def make_zip_backend(name: str, store: ZipPagedKV, num_heads: int, num_kv_heads: int, head_dim: int,
                     page_size: int) -> AttentionBackend:
    """Backends over the pool: zip (fused Triton kernel for decodes), torch and flashinfer (decompress-then-attend).

    auto on CUDA picks zip when the kernel can serve this store (zip_fused_backend.fused_unsupported), else
    flashinfer when importable; on CPU torch (the Triton interpreter is for tests only)."""
    if name in ("auto", "zip"):
        from .zip_fused_backend import ZipFusedAttention, fused_unsupported

        why = fused_unsupported(store, num_heads, num_kv_heads, head_dim, page_size)
        if name == "zip" and why is not None:
            raise ValueError(why)
        if name == "zip" or (store.device.type == "cuda" and why is None):
            fallback = make_zip_backend("flashinfer" if _flashinfer_serves(store, head_dim) else "torch",
                                        store, num_heads, num_kv_heads, head_dim, page_size)
            return ZipFusedAttention(store, num_heads, num_kv_heads, head_dim, fallback)
        name = "flashinfer" if _flashinfer_serves(store, head_dim) else "torch"
    scratch = [torch.zeros(1, 2, page_size, num_kv_heads, head_dim, dtype=torch.bfloat16, device=store.device)]
    if name == "torch":
        return DecompressThenAttend(store, TorchAttention(scratch, num_heads, head_dim))
    if name == "flashinfer":
        from .flashinfer_backend import FlashInferAttention, flashinfer_unsupported

        if store.device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        why = flashinfer_unsupported(head_dim)
        if why is not None:
            raise ValueError(f"attention backend 'flashinfer': {why}; choose auto, zip or torch")

        return DecompressThenAttend(store, FlashInferAttention(scratch, num_heads, num_kv_heads, head_dim, page_size))
    raise ValueError(f"unknown attention backend '{name}' for the compressed cache (choose auto, zip, torch or flashinfer)")
