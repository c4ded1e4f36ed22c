"""Fused attention over the compressed pool (compress=True, backend 'zip'): the ZipFusion paper's design.

Decode rows (sequences with one query this step) run a fused kernel straight over the pool: the CUDA one
(:mod:`kvtide.kernels.zip_attention_cuda`) when the pool keeps the "mma" value order, else the Triton one
(:mod:`kvtide.kernels.zip_attention`, "token" order). Either reads the pool and the layer's group tables:
compressed blocks are rebuilt in registers, the page being written is a raw group (descriptors 0xFF) read as it
is, and no decompressed copy of the cache is ever made. Rows the kernel does not do (prefill chunks: more than
one query) go through decompress-then-attend (:mod:`.decompress_attend`) for just those sequences. The step's new K/V
are written into the pool first, for all rows, so both paths read the same bytes. The kernel is planned once per
step and run once per layer.
"""
from __future__ import annotations

import torch
from torch.profiler import record_function

from ...cache.zip_pages import ZipPagedKV
from ...kernels.interpret import triton_interpret
from .base import AttentionBackend, BatchLayout
from .decompress_attend import DecompressThenAttend


def fused_unsupported(pool: ZipPagedKV, num_heads: int, num_kv_heads: int, head_dim: int,
                      page_size: int) -> str | None:
    """Why the fused kernel cannot serve this pool here, with the fix; None when it can.

    Checked when the backend is built, so 'auto' can fall back and an explicit 'zip' fails before any step."""
    if pool.geo.value_order == "mma":
        from ...kernels import zip_attention_cuda as zc

        why = zc.store_unsupported(pool.device, num_heads, num_kv_heads, head_dim, page_size, pool.block_size,
                                   pool.pool.numel())
        return None if why is None else (f"attention_backend 'zip' over a pool in the 'mma' value order runs the "
                                         f"CUDA kernel: {why}; use CacheConfig.value_order='token' (Triton kernel) "
                                         f"or attention_backend='torch'")
    if pool.device.type != "cuda" and not triton_interpret():
        return ("attention_backend 'zip' runs a Triton kernel: it needs a CUDA device, or TRITON_INTERPRET=1 set "
                "before kvtide's kernels are first used to run it on CPU (slow: tests only); otherwise use "
                "attention_backend='torch' (decompress-then-attend)")
    try:
        from ...kernels import zip_attention as za
    except ImportError as e:
        return f"attention_backend 'zip' needs triton ({e}); install triton or use attention_backend='torch'"
    try:  # the kernel's own shape checks, on a one-page dummy batch (host only, nothing launched)
        one = torch.tensor([0, 1], dtype=torch.int32)
        za.plan(one, one[:1], torch.tensor([page_size], dtype=torch.int32), num_heads, num_kv_heads, head_dim,
                page_size, block_size=pool.block_size, version=pool.format_version, num_splits=1, device="cpu")
    except ValueError as e:
        return f"attention_backend 'zip' cannot run this model's shape: {e}; use attention_backend='torch'"
    return None


class ZipFusedAttention(AttentionBackend):
    """Decodes through the fused kernel over the pool; prefill chunks through ``fallback`` (decompress-then-attend)."""

    name = "zip"
    whole_step_graphs = True

    def __init__(self, pool: ZipPagedKV, num_heads: int, num_kv_heads: int, head_dim: int,
                 fallback: DecompressThenAttend):
        super().__init__([], num_heads, head_dim)
        if pool.geo.value_order == "mma":
            from ...kernels import zip_attention_cuda as kernel

            self._run = kernel.run
            if pool.device.type == "cuda":  # NVRTC now, while the engine starts, not in the first decode step
                kernel.build(pool.device, head_dim, pool.format_version)
        else:
            from ...kernels import zip_attention as kernel

            self._run = kernel.run_zip
        self.kernel = kernel
        self.pool = pool
        self.num_kv_heads = num_kv_heads
        self.fallback = fallback
        self.kplan = None
        # Sequences planned through each path, and steps that used both: benches and tests check the routing.
        self.counts = {"kernel_seqs": 0, "fallback_seqs": 0, "mixed_steps": 0}
        self._graph_bufs: dict[int, tuple] = {}  # batch -> (kernel PlanBuffers, slot buffer, last split count)

    def plan_graph(self, layout: BatchLayout):
        """A decode step for a whole-step CUDA graph: the CUDA kernel's plan and the slot mapping go into fixed
        buffers of this batch size (the fused write and the kernel then read only fixed addresses). The Triton
        kernel and the torch write path are not captured (None)."""
        graphable = (self.pool.geo.value_order == "mma" and self.pool.fused_write and layout.is_decode_only
                     and self.pool.device.type == "cuda")
        if not graphable:
            self.plan(layout)
            return None
        n = len(layout.q_lens)
        if n not in self._graph_bufs:
            self._graph_bufs[n] = (self.kernel.PlanBuffers(n, self.pool.device),
                                   torch.zeros(n, dtype=torch.long, device=self.pool.device), None)
        bufs, slots, splits = self._graph_bufs[n]
        self.slot_mapping = slots.copy_(layout.slot_mapping, non_blocking=True)
        self.write_rows = None
        self.mixed = False
        self.kplan = self._kernel_plan(layout, None, buffers=bufs, splits_hint=splits)
        self._graph_bufs[n] = (bufs, slots, self.kplan.num_splits)  # kept while nearly as fast: no new capture
        self.counts["kernel_seqs"] += n
        return ("zip", self.kernel.graph_key(self.kplan))

    def _kernel_plan(self, layout: BatchLayout, rows: list[int] | None, **extra):
        """The decode kernel's plan of sequences ``rows`` (None: all) of ``layout``."""
        return self.kernel.plan(*layout.page_table(rows), self.num_heads, self.num_kv_heads, self.head_dim,
                                layout.page_size, block_size=self.pool.block_size,
                                version=self.pool.format_version, sm_scale=self.scale, device=self.pool.device,
                                **extra)

    def plan(self, layout: BatchLayout) -> None:
        p = layout.page_size
        starts = layout.q_starts
        dec = [i for i, n in enumerate(layout.q_lens) if n == 1]
        rest = [i for i, n in enumerate(layout.q_lens) if n != 1]
        dev = self.pool.device
        self.slot_mapping = layout.slot_mapping
        # once per step, for every layer's write (the fused write on a GPU places each value itself)
        self.write_rows = None if self.pool.fused_write else self.pool.write_rows(layout.slot_mapping)
        self.kplan = self._kernel_plan(layout, dec) if dec else None
        self.counts["kernel_seqs"] += len(dec)
        self.counts["fallback_seqs"] += len(rest)
        self.counts["mixed_steps"] += bool(dec and rest)
        self.mixed = bool(rest)
        if not rest:
            return
        self.dec_rows = torch.tensor([starts[i] for i in dec], dtype=torch.long, device=dev)
        rows = [r for i in rest for r in range(starts[i], starts[i] + layout.q_lens[i])]
        self.rest_rows = torch.tensor(rows, dtype=torch.long, device=dev)
        self.fallback.plan(BatchLayout([layout.q_lens[i] for i in rest], [layout.kv_lens[i] for i in rest],
                                       [layout.block_tables[i] for i in rest], layout.slot_mapping[self.rest_rows], p))

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The kernel takes contiguous bf16 [B, Hq, D]; the model may compute in fp32 (CPU)."""
        dtype, q = q.dtype, q.to(torch.bfloat16).contiguous()
        pool = self.pool
        return self._run(self.kplan, q, pool.pool, pool.group_start[layer], pool.group_desc[layer]).to(dtype)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with record_function("kvtide.zip_write"):
            self.pool.write(layer, k, v, self.slot_mapping, self.write_rows)
        if not self.mixed:
            with record_function("kvtide.zip_decode"):
                return self._decode(layer, q)
        out = torch.empty_like(q)
        if self.kplan is not None:
            out[self.dec_rows] = self._decode(layer, q[self.dec_rows])
        r = self.rest_rows
        out[r] = self.fallback.attend(layer, q[r], k[r], v[r])
        return out
