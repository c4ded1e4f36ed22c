"""The executor's model interface over the engine's runner: run one layer over row segments, place loaded K/V.

Works with both KV layouts the runner has: fixed per-layer tensors, and the compressed pool (compress=True),
where writes go through the pool's own ``write`` and reads through ``read_pages``.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..kernels.paged_attention_ref import write_kv
from ..restore.executor import Segment
from .attention.base import BatchLayout
from .model_runner import ModelRunner
from .sequence import Sequence as Seq


class EnginePort:
    """``ModelPort`` for a batch of sequences whose pages are already allocated for all their tokens."""

    def __init__(self, runner: ModelRunner, seqs: Sequence[Seq]):
        self.runner = runner
        self.model = runner.model
        self.num_layers = runner.model.args.num_layers
        self.device = runner.device
        self.page_size = runner.page_size
        self.seqs = list(seqs)
        self._pages = [torch.tensor(s.pages, dtype=torch.long, device=self.device) for s in self.seqs]
        self._ids = [torch.tensor(s.token_ids, dtype=torch.long, device=self.device) for s in self.seqs]
        # The runner's attention backend is planned by this port alone while it lives (a restoration runs between
        # engine steps, on the caller's thread): the last plan stays valid until the segments change.
        self._planned: tuple | None = None
        self._positions = self._rows = torch.empty(0)
        self._graph_rows: tuple | None = None  # (layer graph, segments) whose positions its buffer holds

    def reset_plan(self) -> None:
        """Forget the attention plan: engine steps ran (and planned the backend) since the last layer call of an
        interleaved restoration (``RestoreRun.advance``)."""
        self._planned = None

    def slots(self, r: int, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end, device=self.device)
        return self._pages[r][pos // self.page_size] * self.page_size + pos % self.page_size

    def run_layer(self, layer: int, h: torch.Tensor | None, segments: Sequence[Segment]) -> torch.Tensor:
        """Plans only when the segments change: a staircase has a few distinct boundaries and the suffix one set of
        rows for every layer, so a restoration plans a handful of times, not once per layer (FlashInfer's prefill
        plan is host work the compute thread would otherwise pay per layer while the I/O thread competes for it).

        With the runner's layer graphs (CUDA graphs on), calls of up to ``max_rows`` rows (the suffix, short
        staircase layers) replay the layer's two halves around an eager attention call; the returned h is then
        a view of the graph's buffer, which the next call of the same bucket reads in place."""
        key = tuple((s.request, s.start, s.end) for s in segments)
        if key != self._planned:
            segs = list(segments)
            layout = BatchLayout(
                q_lens=[s.length for s in segs],
                kv_lens=[s.end for s in segs],
                block_tables=[self.seqs[s.request].pages for s in segs],
                slot_mapping=torch.cat([self.slots(s.request, s.start, s.end) for s in segs]),
                page_size=self.page_size,
            )
            self._positions = torch.cat([torch.arange(s.start, s.end, device=self.device) for s in segs])
            self._rows = torch.cat([self._ids[s.request][s.start:s.end] for s in segs])
            self.runner.attention.plan(layout)
            self._planned = key
        t = self._rows.shape[0]
        graphs = self.runner.layer_graphs
        if graphs is None or t > graphs.max_rows:
            return self.model.hidden_states(self._rows, self._positions, self.runner.attention,
                                            layers=range(layer, layer + 1), h=h)
        g = graphs.get(t)
        if self._graph_rows != (g, key):
            g.positions[:t].copy_(self._positions)
            g.positions[t:].zero_()  # padding rows: any valid position
            self._graph_rows = (g, key)
        if h is None:
            g.h[:t].copy_(self.model.embed(self._rows))
        elif h.data_ptr() != g.h.data_ptr() or h.shape[0] != t:  # else h is g.h[:t]: the last call's output or
            g.h[:t].copy_(h)                                         # its first rows, already in place
        return g.layer(layer, t, self.runner.attention)

    def write_kv(self, layer: int, request: int, start: int, kv: torch.Tensor) -> None:
        """Place loaded K/V [2, T, kv_heads, head_dim] at positions [start, start + T) of ``layer``.

        Loads are chunk-aligned, so in the fixed layout whole pages are copied (one index per page, one copy
        of every byte) instead of two per-token scatters; the compressed pool takes tokens through its ``write``.
        Called on the I/O thread (on CUDA inside its stream): only index math and copies, no host syncs.
        """
        p, n = self.page_size, kv.shape[1]
        if self.runner.pool is None and start % p == 0 and n % p == 0:
            cache = self.runner.kv_caches[layer]
            pages = self._pages[request][start // p:(start + n) // p]
            src = kv.unflatten(1, (n // p, p)).transpose(0, 1)  # [pages, 2, page_size, kv_heads, head_dim]
            cache.index_copy_(0, pages, src.to(device=cache.device, dtype=cache.dtype, non_blocking=True))
            return
        slots = self.slots(request, start, start + n)
        if self.runner.pool is not None:
            self.runner.pool.write(layer, kv[0], kv[1], slots)
        else:
            write_kv(self.runner.kv_caches[layer], kv[0], kv[1], slots)

    def write_kv_chunks(self, layer: int, request: int, start: int, chunks: torch.Tensor) -> None:
        """Place k consecutive whole chunks ``chunks`` [k, 2, C, kv_heads, head_dim] at positions [start, start + kC).

        One indexed copy for all k in the fixed layout (``write_kv`` would take k of them, each a few torch calls on the
        I/O thread, which shares the GIL with the compute thread): faster loads, and shorter restorations where the
        loads are the longer side."""
        k, _, n = chunks.shape[:3]
        p = self.page_size
        if self.runner.pool is not None or start % p or n % p:
            for i in range(k):
                self.write_kv(layer, request, start + i * n, chunks[i])
            return
        cache = self.runner.kv_caches[layer]
        pages = self._pages[request][start // p:(start + k * n) // p].view(k, n // p)
        src = chunks.unflatten(2, (n // p, p)).transpose(1, 2)  # [k, pages per chunk, 2, page_size, heads, dim]
        cache.index_put_((pages,), src.to(dtype=cache.dtype))

    def kv_entry_shape(self) -> tuple[int, int]:
        a = self.model.args
        return a.num_kv_heads, a.head_dim

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.logits(h)
