"""FlashInfer attention over the fixed paged cache (CUDA only): decode wrapper for pure-decode steps (tensor-core
path, the strong GQA baseline), prefill wrapper for steps that carry prefill chunks. Planned once per step."""
from __future__ import annotations

import math

import torch

from ...kernels.h2d import to_device
from ...kernels.kv_write import write_paged
from .base import AttentionBackend, BatchLayout

WORKSPACE_BYTES = 256 << 20
HEAD_DIMS = (64, 128, 256)  # the head dims FlashInfer 0.6.12 serves here (see flashinfer_unsupported)
KV_DTYPES = (torch.float16, torch.bfloat16)


def flashinfer_unsupported(head_dim: int, kv_dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why this backend cannot serve a model (None when it can): flashinfer missing, a head_dim its prefill kernels
    lack, or float32 KV (its kernels take 16-bit KV; 0.6.12 fails with a KeyError on float32 in its module lookup).
    At head_dim 32 neither FlashInfer build serves sm_90 (see docs/design/engine.md), so the engine picks torch
    attention there instead."""
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return "the flashinfer package is not installed"
    if head_dim not in HEAD_DIMS:
        return f"FlashInfer's prefill kernels take head_dim {'/'.join(map(str, HEAD_DIMS))}, this model's is {head_dim}"
    if kv_dtype not in KV_DTYPES:
        return f"FlashInfer's kernels take float16/bfloat16 KV, this engine's is {str(kv_dtype).removeprefix('torch.')}"
    return None


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"

    def __init__(self, kv_caches: list[torch.Tensor], num_heads: int, num_kv_heads: int, head_dim: int, page_size: int):
        super().__init__(kv_caches, num_heads, head_dim)
        import flashinfer

        dev = kv_caches[0].device
        self.num_kv_heads = num_kv_heads
        self.page_size = page_size
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev), "NHD", use_tensor_cores=True)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev), "NHD")
        self.wrapper = None
        self._planned: torch.cuda.Event | None = None  # recorded after the latest plan's copies were enqueued
        self._graph_wrappers: dict[int, tuple] = {}  # batch -> (CUDA-graph decode wrapper, slot buffer, generation)
        self.build_kernels()

    def build_kernels(self) -> None:
        """Plan a one-token decode and a two-token prefill now, so that FlashInfer builds (JIT, or loads from its
        disk cache) the modules every later plan of this model's shape uses while the engine starts, not inside
        the first step that needs them: on a fresh host that build takes many seconds, and whichever request
        decoded first would pay for it."""
        dev = self.kv_caches[0].device
        for n in (1, 2):  # 1: decode wrapper, 2: prefill wrapper (only page 0 is named; nothing is run)
            self.plan(BatchLayout([n], [n], [[0]], torch.zeros(n, dtype=torch.long, device=dev), self.page_size))
        self.wrapper = None

    def _graph_wrapper(self, batch: int, nnz: int):
        """The CUDA-graph decode wrapper of ``batch`` sequences (fixed page-table buffers: FlashInfer's
        ``use_cuda_graph`` mode, whose plans keep the kernel's grid fixed); replaced, with a new generation, when the
        page ids outgrow its buffer."""
        import flashinfer

        have = self._graph_wrappers.get(batch)
        if have is not None and have[0]._paged_kv_indices_buf.numel() >= nnz:
            return have
        dev = self.kv_caches[0].device
        gen = 0 if have is None else have[2] + 1
        cap = 1 << max(10, math.ceil(math.log2(nnz * 1.25)))
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.decode._float_workspace_buffer, "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.zeros(cap, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=dev))
        self._graph_wrappers[batch] = have = (w, torch.zeros(batch, dtype=torch.long, device=dev), gen)
        return have

    def plan_graph(self, layout: BatchLayout):
        """A decode step for a whole-step CUDA graph: planned into this batch size's CUDA-graph wrapper, the slot
        mapping copied into a fixed buffer."""
        if not layout.is_decode_only or self.kv_caches[0].device.type != "cuda":
            self.plan(layout)
            return None
        kv_indptr, kv_indices, kv_last = layout.page_table()
        n = len(layout.q_lens)
        w, slots, gen = self._graph_wrapper(n, kv_indices.numel())
        if self._planned is not None:  # see plan: the wrapper's pinned plan buffer
            self._planned.synchronize()
        dev, dtype = self.kv_caches[0].device, self.kv_caches[0].dtype
        # pinned sources: FlashInfer copies them into its fixed buffers without a wait; the page ids go to the device
        # first (FlashInfer copies host page ids blocking)
        w.plan(kv_indptr.pin_memory(), to_device(kv_indices, dev), kv_last.pin_memory(), self.num_heads,
               self.num_kv_heads, self.head_dim, layout.page_size, pos_encoding_mode="NONE", q_data_type=dtype,
               kv_data_type=dtype, sm_scale=self.scale, non_blocking=True)
        self._planned = torch.cuda.Event()
        self._planned.record()
        self.wrapper = w
        self.slot_mapping = slots.copy_(layout.slot_mapping, non_blocking=True)
        return ("flashinfer", n, gen)

    def plan(self, layout: BatchLayout) -> None:
        p = layout.page_size
        dev = self.kv_caches[0].device
        i32 = dict(dtype=torch.int32)
        kv_indptr, kv_indices, kv_last = layout.page_table()
        # FlashInfer's plan writes its host-side plan into one pinned buffer and copies it to the device
        # asynchronously, so a second plan made while the device is still behind (a restoration re-plans between
        # layers; async scheduling plans step N+1 while step N runs) would overwrite the first one's bytes before
        # their copy ran (an illegal memory access on the device). So the next plan waits for the event
        # recorded after the last one, i.e. until that copy has run, which under async scheduling is long done
        # (it precedes the step the host has just waited for). The page ids themselves go without a wait.
        if self._planned is not None:
            self._planned.synchronize()
        kv_indices = to_device(kv_indices, dev)
        dtype = self.kv_caches[0].dtype
        self.slot_mapping = layout.slot_mapping
        if layout.is_decode_only:
            self.decode.plan(kv_indptr, kv_indices, kv_last, self.num_heads, self.num_kv_heads, self.head_dim, p,
                             pos_encoding_mode="NONE", q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scale)
            self.wrapper = self.decode
        else:
            qo = [0]
            for n in layout.q_lens:
                qo.append(qo[-1] + n)
            self.prefill.plan(torch.tensor(qo, **i32), kv_indptr, kv_indices, kv_last, self.num_heads,
                              self.num_kv_heads, self.head_dim, p, causal=True, q_data_type=dtype,
                              kv_data_type=dtype, sm_scale=self.scale)
            self.wrapper = self.prefill
        if dev.type == "cuda":
            self._planned = torch.cuda.Event()
            self._planned.record()

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.kv_caches[layer]
        write_paged(cache, k, v, self.slot_mapping)  # one launch (reference: paged_attention_ref.write_kv)
        return self.wrapper.run(q.to(cache.dtype), cache).to(q.dtype)
