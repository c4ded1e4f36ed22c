"""The executor's model interface over the engine's runner: run one layer over row segments, place loaded K/V.

Works with both KV layouts the runner has: fixed per-layer tensors, and the compressed pool (compress=True),
where writes go through the pool's own ``write`` and reads through ``read_pages``.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..kernels.paged_attention_ref import write_kv
from ..restore.executor import Segment
from ..store.zip_entry import ZipEntry, encode_entries
from .attention import BatchLayout
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
        if self.runner.store is None and start % p == 0 and n % p == 0:
            cache = self.runner.kv_caches[layer]
            pages = self._pages[request][start // p:(start + n) // p]
            src = kv.unflatten(1, (n // p, p)).transpose(0, 1)  # [pages, 2, page_size, kv_heads, head_dim]
            cache.index_copy_(0, pages, src.to(device=cache.device, dtype=cache.dtype, non_blocking=True))
            return
        slots = self.slots(request, start, start + n)
        if self.runner.store is not None:
            self.runner.store.write(layer, kv[0], kv[1], slots)
        else:
            write_kv(self.runner.kv_caches[layer], kv[0], kv[1], slots)

    def write_kv_chunks(self, layer: int, request: int, start: int, chunks: torch.Tensor) -> None:
        """Place k consecutive whole chunks ``chunks`` [k, 2, C, kv_heads, head_dim] at positions [start, start + kC).

        One indexed copy for all k in the fixed layout (``write_kv`` would take k of them, each a few torch calls on the
        I/O thread, which shares the GIL with the compute thread). H200, 8B shape, one device session: loads alone 4.68
        vs 4.22 GB/s, beside a replay 3.68 vs 3.27, CacheFlow's batch-1 restorations 10-12% shorter."""
        k, _, n = chunks.shape[:3]
        p = self.page_size
        if self.runner.store is not None or start % p or n % p:
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


def _gather(runner: ModelRunner, layer: int, idx: torch.Tensor) -> torch.Tensor:
    """[2, pages * page_size, kv_heads, head_dim] of one layer, on the KV's device: a new tensor (the gather and
    the permute copy), never a view of the cache."""
    if runner.store is not None:
        pages = runner.store.read_pages(layer, idx)
    else:
        pages = runner.kv_caches[layer].index_select(0, idx)
    n, _, p, hk, d = pages.shape
    return pages.permute(1, 0, 2, 3, 4).reshape(2, n * p, hk, d)


class ChunkReader:
    """Copies chunks out of their pages for the store writer without stalling the step loop.

    The gather runs on the compute stream, so it reads the pages before any later step can reuse them. On CUDA the
    copy to host memory then runs on a side stream into pinned buffers and the writer waits on its event: a plain
    ``.to("cpu")`` blocks the engine thread for the whole transfer through pageable memory (an 8K-token request of
    an 8B model is 1 GiB), time every queued request would wait. On the CPU the gather is the copy.
    """

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.stream = torch.cuda.Stream(runner.device) if runner.device.type == "cuda" else None

    def read(self, page_ids: list[int]) -> tuple[list[torch.Tensor], "torch.cuda.Event | None"]:
        """Per layer [2, len(page_ids) * page_size, kv_heads, head_dim] on the CPU, and the event after which they
        hold the data (None: they already do)."""
        r = self.runner
        idx = torch.tensor(page_ids, dtype=torch.long, device=r.device)
        layers = range(r.model.args.num_layers)
        if self.stream is None:
            return [_gather(r, i, idx) for i in layers], None  # new tensors already
        on_device = [_gather(r, i, idx) for i in layers]
        self.stream.wait_stream(torch.cuda.current_stream(r.device))
        host = []
        with torch.cuda.stream(self.stream):
            for x in on_device:
                h = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                h.copy_(x, non_blocking=True)
                x.record_stream(self.stream)  # the compute stream may reuse x's memory only after this copy
                host.append(h)
            done = torch.cuda.Event()
            done.record(self.stream)
        return host, done

    def read_zip(self, page_ids: list[int], chunk: int) -> tuple[list[list[ZipEntry]], "torch.cuda.Event | None"]:
        """Like ``read``, each chunk's layer encoded in the ZipFusion format (``RestoreConfig.store_codec``):
        ``entries[layer][k]`` is chunk k's. On CUDA the encode runs on the side stream on the device (Triton, fixed
        slots, no host sync) and only descriptors and slots cross to pinned host memory."""
        r = self.runner
        idx = torch.tensor(page_ids, dtype=torch.long, device=r.device)
        layers = range(r.model.args.num_layers)
        out: list[list[ZipEntry]] = []

        def split(desc: torch.Tensor, slots: torch.Tensor, shape: tuple[int, ...]) -> list[ZipEntry]:
            return [ZipEntry(desc[k], slots[k], shape) for k in range(desc.shape[0])]

        if self.stream is None:
            for i in layers:
                x = _gather(r, i, idx)
                groups, shape = _chunk_groups(x, chunk)
                desc, slots = encode_entries(groups, shape)
                out.append(split(desc, slots, shape))
            return out, None
        on_device = [_gather(r, i, idx) for i in layers]
        self.stream.wait_stream(torch.cuda.current_stream(r.device))
        with torch.cuda.stream(self.stream):
            for x in on_device:
                x.record_stream(self.stream)  # the compute stream may reuse x's memory only after this stream's use
                groups, shape = _chunk_groups(x, chunk)
                desc, slots = encode_entries(groups, shape)
                desc_h = torch.empty(desc.shape, dtype=desc.dtype, pin_memory=True)
                slots_h = torch.empty(slots.shape, dtype=slots.dtype, pin_memory=True)
                desc_h.copy_(desc, non_blocking=True)
                slots_h.copy_(slots, non_blocking=True)
                out.append(split(desc_h, slots_h, shape))
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done


def _chunk_groups(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """[2, K * chunk, heads, dim] -> [K, 2 * chunk * heads * dim] (chunk k's entry in C order) and the entry shape."""
    two, n, hk, d = x.shape
    k = n // chunk
    if k * chunk != n:
        raise ValueError(f"{n} tokens are not whole chunks of {chunk}")
    groups = x.view(two, k, chunk, hk, d).transpose(0, 1).reshape(k, -1)
    return groups, (two, chunk, hk, d)
