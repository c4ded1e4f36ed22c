"""Copies a finished request's chunks out of their pages for the store writer, without stalling the step loop."""
from __future__ import annotations

import math

import torch

from ..store.zip_entry import ZipEntry, encode_entries
from .model_runner import ModelRunner


def gather_layer(runner: ModelRunner, layer: int, idx: torch.Tensor) -> torch.Tensor:
    """[2, pages * page_size, kv_heads, head_dim] of one layer, on the KV's device: a new tensor (the gather and
    the permute copy), never a view of the cache."""
    if runner.pool is not None:
        pages = runner.pool.read_pages(layer, idx)
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
    """Reads chunks out of their pages for the store writer: ``read`` and ``read_zip`` return ``per_chunk[c][l]``,
    chunk c's entry of layer l, and the event after which those hold the data (None: they already do).

    Every layer is gathered on the compute stream (one ``index_select`` each), so the pages are read before any
    later step can reuse them. On CUDA the rest runs on a side stream: each chunk's layers cross to host memory in
    one pinned buffer of their own, and the writer waits on the event. A plain ``.to("cpu")`` would block the engine
    thread for the whole transfer through pageable memory (an 8K-token request of an 8B model is 1 GiB), time every
    queued request waits. One buffer per chunk, not per request or per layer: every buffer is the same size, so torch's
    pinned cache (which rounds sizes up to powers of two and reuses a block for its own size only) serves them from
    blocks freed by earlier chunks instead of growing (``cudaHostAlloc``, on the step loop), and the writer frees
    each one as soon as that chunk is written (docs/design/engine.md has the measurements). On the CPU the gather is
    the copy.

    ``encode_bytes``: how much KV is handled per side-stream pass (bounds the device buffers it holds at once).
    """

    def __init__(self, runner: ModelRunner, encode_bytes: int = 256 << 20):
        if encode_bytes <= 0:
            raise ValueError(f"encode_bytes must be positive, got {encode_bytes}")
        self.runner = runner
        self.encode_bytes = encode_bytes
        self.stream = torch.cuda.Stream(runner.device) if runner.device.type == "cuda" else None

    def read(self, page_ids: list[int], chunk: int) -> tuple[list[list[torch.Tensor]], "torch.cuda.Event | None"]:
        """``per_chunk[c][l]``: [2, chunk, kv_heads, head_dim] on the CPU."""
        k, shape, n = self._geometry(page_ids, chunk)
        L = self.runner.model.args.num_layers
        groups = self._gather_groups(page_ids, chunk, k, n)
        if self.stream is None:  # the gather made new tensors already: views of it, no chunk-major copy
            return [[groups[i * k + c].view(shape) for i in range(L)] for c in range(k)], None
        out = []

        def to_host(part: torch.Tensor) -> None:
            for c in range(part.shape[0]):
                out.append([x.view(shape) for x in self._host(part[c]).unbind(0)])

        return out, self._passes(groups, k, L * n, to_host)

    def read_zip(self, page_ids: list[int], chunk: int) -> tuple[list[list[ZipEntry]], "torch.cuda.Event | None"]:
        """Like ``read``, each entry encoded in the ZipFusion format (``RestoreConfig.store_codec``).

        Encoded a few chunks per launch pair (on CUDA the Triton analyse and pack kernels, fixed slots, no host
        sync): layer by layer, each layer's ~25 torch calls and two launches would be step-loop host time."""
        k, shape, n = self._geometry(page_ids, chunk)
        L = self.runner.model.args.num_layers
        out = []

        def to_host(part: torch.Tensor) -> None:
            d, s = encode_entries(part.view(-1, n), shape)
            for c in range(part.shape[0]):
                dh, sh = self._host(d[c * L:(c + 1) * L]), self._host(s[c * L:(c + 1) * L])
                out.append([ZipEntry(x, y, shape) for x, y in zip(dh.unbind(0), sh.unbind(0))])

        return out, self._passes(self._gather_groups(page_ids, chunk, k, n), k, L * n, to_host)

    def _geometry(self, page_ids: list[int], chunk: int) -> tuple[int, tuple[int, ...], int]:
        """(chunks, entry shape, values per entry) of a read; refuses pages that are not whole chunks."""
        a, p = self.runner.model.args, self.runner.page_size
        if not page_ids:
            raise ValueError("no pages to read")
        if chunk % p or (len(page_ids) * p) % chunk:
            raise ValueError(f"{len(page_ids)} pages of {p} tokens are not whole chunks of {chunk}")
        shape = (2, chunk, a.num_kv_heads, a.head_dim)
        return len(page_ids) * p // chunk, shape, math.prod(shape)

    def _host(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in host memory: a pinned copy on CUDA (on the side stream, asynchronous); on the CPU ``x`` is a
        new tensor already."""
        if self.stream is None:
            return x
        h = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        h.copy_(x, non_blocking=True)
        return h

    def _passes(self, groups: torch.Tensor, k: int, chunk_values: int, to_host) -> "torch.cuda.Event | None":
        """``to_host(part)`` for chunk-major parts [m, layers, n] of the chunks in order (one transposing copy of
        layer-major ``groups`` each, ``encode_bytes`` at most); on CUDA on the side stream after the gather, and
        the event after its last copy."""
        L = self.runner.model.args.num_layers
        by_layer = groups.view(L, k, -1)
        per = max(1, self.encode_bytes // max(1, chunk_values * groups.element_size()))  # chunks per pass
        if self.stream is None:
            for c0 in range(0, k, per):
                to_host(by_layer[:, c0:c0 + per].transpose(0, 1).contiguous())
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(self.stream):
            groups.record_stream(self.stream)  # the compute stream may reuse it only after this stream's use
            for c0 in range(0, k, per):
                to_host(by_layer[:, c0:c0 + per].transpose(0, 1).contiguous())
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def _gather_groups(self, page_ids: list[int], chunk: int, k: int, n: int) -> torch.Tensor:
        """Every layer's chunks as entries [layers * k, n] on the KV's device (row l * k + c: layer l, chunk c),
        gathered on the current stream.

        Dense caches: one ``index_select`` per layer straight into the buffer, over the cache viewed as
        [pages * 2, page_size * heads * dim] half-pages (entry c = K then V of its chunk's pages in order)."""
        r = self.runner
        L, p = r.model.args.num_layers, r.page_size
        idx = torch.tensor(page_ids, dtype=torch.long, device=r.device)
        if r.pool is not None:  # the compressed pool: its own read path
            return torch.cat([chunk_groups(gather_layer(r, i, idx), chunk) for i in range(L)])
        caches = r.kv_caches
        half = caches[0][0, 0].numel()
        out = torch.empty(L * k, n, dtype=caches[0].dtype, device=r.device)
        two = torch.arange(2, device=r.device).view(1, 2, 1)
        rows = (idx.view(k, 1, chunk // p) * 2 + two).reshape(-1)  # (chunk, K/V, page) -> half-page row
        for i, cache in enumerate(caches):
            torch.index_select(cache.view(-1, half), 0, rows, out=out[i * k:(i + 1) * k].view(-1, half))
        return out
