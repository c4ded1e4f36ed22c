"""Copies a finished request's chunks out of their pages for the store writer, without stalling the step loop."""
from __future__ import annotations

import math

import torch

from ..store.zip_entry import BLOCK_SIZE, ZipEntry, encode_entries
from .model_runner import ModelRunner


def gather_layer(runner: ModelRunner, layer: int, idx: torch.Tensor) -> torch.Tensor:
    """[2, pages * page_size, kv_heads, head_dim] of one layer, on the KV's device: a new tensor (the gather and
    the permute copy), never a view of the cache."""
    if runner.store is not None:
        pages = runner.store.read_pages(layer, idx)
    else:
        pages = runner.kv_caches[layer].index_select(0, idx)
    n, _, p, hk, d = pages.shape
    return pages.permute(1, 0, 2, 3, 4).reshape(2, n * p, hk, d)


def chunk_groups(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """[2, K * chunk, heads, dim] -> [K, 2 * chunk * heads * dim]: chunk k's entry in C order of [2, chunk, heads,
    dim] (a copy)."""
    two, n, hk, d = x.shape
    k = n // chunk
    if k * chunk != n:
        raise ValueError(f"{n} tokens are not whole chunks of {chunk}")
    return x.view(two, k, chunk, hk, d).transpose(0, 1).reshape(k, -1)


class ChunkReader:
    """Reads chunks out of their pages for the store writer.

    The gather runs on the compute stream, so it reads the pages before any later step can reuse them. On CUDA the
    copy to host memory then runs on a side stream into pinned buffers and the writer waits on its event: a plain
    ``.to("cpu")`` blocks the engine thread for the whole transfer through pageable memory (an 8K-token request of
    an 8B model is 1 GiB), time every queued request would wait. On the CPU the gather is the copy.

    ``encode_bytes``: how much KV ``read_zip`` encodes per launch pair (bounds the device slots it holds at once).
    """

    def __init__(self, runner: ModelRunner, encode_bytes: int = 256 << 20):
        if encode_bytes <= 0:
            raise ValueError(f"encode_bytes must be positive, got {encode_bytes}")
        self.runner = runner
        self.encode_bytes = encode_bytes
        self.stream = torch.cuda.Stream(runner.device) if runner.device.type == "cuda" else None

    def read(self, page_ids: list[int]) -> tuple[list[torch.Tensor], "torch.cuda.Event | None"]:
        """Per layer [2, len(page_ids) * page_size, kv_heads, head_dim] on the CPU, and the event after which they
        hold the data (None: they already do)."""
        r = self.runner
        idx = torch.tensor(page_ids, dtype=torch.long, device=r.device)
        layers = range(r.model.args.num_layers)
        if self.stream is None:
            return [gather_layer(r, i, idx) for i in layers], None  # new tensors already
        on_device = [gather_layer(r, i, idx) for i in layers]
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
        ``entries[layer][k]`` is chunk k's, and the event after which their host buffers hold the data.

        All layers are gathered into one chunk-major buffer and encoded a few layers per launch pair (on CUDA:
        the Triton analyse and pack kernels on the side stream, fixed slots, no host sync), then cross to one
        pinned buffer. Encoding layer by layer cost the step loop ~20 ms of host time per 8K-token request of the
        8B shape (H200 trace replay, 2026-11-30): ~25 torch calls and two Triton launches per layer."""
        r = self.runner
        a = r.model.args
        p = r.page_size
        if chunk % p or (len(page_ids) * p) % chunk:
            raise ValueError(f"{len(page_ids)} pages of {p} tokens are not whole chunks of {chunk}")
        k = len(page_ids) * p // chunk
        shape = (2, chunk, a.num_kv_heads, a.head_dim)
        n = math.prod(shape)
        groups = self._gather_groups(page_ids, chunk, k, n)  # [layers * k, n], row l * k + c: layer l, chunk c
        per = max(1, self.encode_bytes // max(1, k * n * groups.element_size()))  # layers per encode
        rows = [(lo * k, min(lo + per, a.num_layers) * k) for lo in range(0, a.num_layers, per)]
        if self.stream is None:
            coded = [encode_entries(groups[lo:hi], shape) for lo, hi in rows]
            desc = [d for dl, _ in coded for d in dl.unbind(0)]
            slots = [s for _, sl in coded for s in sl.unbind(0)]
            done = None
        else:
            self.stream.wait_stream(torch.cuda.current_stream(r.device))
            nb = n // BLOCK_SIZE
            desc_h = torch.empty(groups.shape[0], nb, dtype=torch.uint8, pin_memory=True)
            slots_h = torch.empty(groups.shape[0], 2 * n, dtype=torch.uint8, pin_memory=True)
            with torch.cuda.stream(self.stream):
                groups.record_stream(self.stream)  # the compute stream may reuse it only after this stream's use
                for lo, hi in rows:
                    d, s = encode_entries(groups[lo:hi], shape)
                    desc_h[lo:hi].copy_(d, non_blocking=True)
                    slots_h[lo:hi].copy_(s, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
            desc, slots = desc_h.unbind(0), slots_h.unbind(0)
        return [[ZipEntry(desc[i * k + c], slots[i * k + c], shape) for c in range(k)]
                for i in range(a.num_layers)], done

    def _gather_groups(self, page_ids: list[int], chunk: int, k: int, n: int) -> torch.Tensor:
        """Every layer's chunks as entries [layers * k, n] on the KV's device, gathered on the current stream.

        Dense caches: one ``index_select`` per layer straight into the buffer, over the cache viewed as
        [pages * 2, page_size * heads * dim] half-pages (entry c = K then V of its chunk's pages in order)."""
        r = self.runner
        L, p = r.model.args.num_layers, r.page_size
        idx = torch.tensor(page_ids, dtype=torch.long, device=r.device)
        if r.store is not None:  # the compressed pool: its own read path
            return torch.cat([chunk_groups(gather_layer(r, i, idx), chunk) for i in range(L)])
        caches = r.kv_caches
        half = caches[0][0, 0].numel()
        out = torch.empty(L * k, n, dtype=caches[0].dtype, device=r.device)
        two = torch.arange(2, device=r.device).view(1, 2, 1)
        rows = (idx.view(k, 1, chunk // p) * 2 + two).reshape(-1)  # (chunk, K/V, page) -> half-page row
        for i, cache in enumerate(caches):
            torch.index_select(cache.view(-1, half), 0, rows, out=out[i * k:(i + 1) * k].view(-1, half))
        return out
