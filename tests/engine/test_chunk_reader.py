"""ChunkReader: the chunks it hands the store writer are exactly the pages' KV, plain and ZipFusion-encoded."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvtide.engine.chunk_reader import ChunkReader, chunk_groups, gather_layer
from kvtide.store.zip_entry import from_tensor

PAGE = 4


class _PagesAsPool:
    """Stands in for the compressed pool: ``read_pages`` returns the dense pages (the reader's other gather path)."""

    def __init__(self, caches: list[torch.Tensor]):
        self.caches = caches

    def read_pages(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        return self.caches[layer].index_select(0, idx)


def _runner(layers: int = 3, pages: int = 12, heads: int = 2, dim: int = 64, pool: bool = False) -> SimpleNamespace:
    g = torch.Generator().manual_seed(layers * 100 + pages)
    caches = []
    for i in range(layers):
        x = torch.randn(pages, 2, PAGE, heads, dim, generator=g) * (i + 1)
        x[i % pages] = float("nan") if i % 2 else float("-inf")  # special values ride along bit for bit
        caches.append(x.to(torch.bfloat16))
    return SimpleNamespace(
        model=SimpleNamespace(args=SimpleNamespace(num_layers=layers, num_kv_heads=heads, head_dim=dim)),
        page_size=PAGE, device=torch.device("cpu"), kv_caches=[] if pool else caches,
        pool=_PagesAsPool(caches) if pool else None, dense=caches,
    )


def _want(r: SimpleNamespace, page_ids: list[int], chunk: int) -> list[torch.Tensor]:
    """Per layer [K, n]: each chunk's KV in C order of [2, chunk, heads, dim], straight from the dense pages."""
    out = []
    for cache in r.dense:
        pages = cache[torch.tensor(page_ids)]  # [np, 2, p, h, d]
        kv = pages.permute(1, 0, 2, 3, 4).reshape(2, -1, *pages.shape[3:])
        out.append(torch.stack([kv[:, c * chunk:(c + 1) * chunk].reshape(-1) for c in range(kv.shape[1] // chunk)]))
    return out


@pytest.mark.parametrize("pool", [False, True], ids=["dense", "pool"])
@pytest.mark.parametrize("encode_bytes", [1, 256 << 20], ids=["chunk-per-pass", "all-at-once"])
def test_read_zip_entries_are_the_pages_kv(pool: bool, encode_bytes: int) -> None:
    r = _runner(pool=pool)
    page_ids = [7, 2, 9, 0, 11, 4]  # any order: chunks follow the request's pages, not the pool's
    chunk = 2 * PAGE
    per_chunk, ready = ChunkReader(r, encode_bytes=encode_bytes).read_zip(page_ids, chunk)
    assert ready is None
    want = _want(r, page_ids, chunk)
    assert len(per_chunk) == 3 and all(len(layers) == 3 for layers in per_chunk)
    for c, layers in enumerate(per_chunk):
        for i, e in enumerate(layers):
            assert e.shape == (2, chunk, 2, 64)
            got = e.decode().reshape(-1).view(torch.int16)
            assert torch.equal(got, want[i][c].view(torch.int16)), (i, c)
            ref = from_tensor(want[i][c].view(2, chunk, 2, 64))
            assert torch.equal(e.desc, ref.desc), (i, c)  # the same encoding as one entry encoded alone
            assert torch.equal(e.data[:e.packed_nbytes()], ref.data[:ref.packed_nbytes()]), (i, c)


@pytest.mark.parametrize("pool", [False, True], ids=["dense", "pool"])
@pytest.mark.parametrize("encode_bytes", [1, 256 << 20], ids=["chunk-per-pass", "all-at-once"])
def test_read_gives_each_chunks_layers_in_request_order(pool: bool, encode_bytes: int) -> None:
    r = _runner(pool=pool)
    page_ids = [3, 1, 10, 5, 0, 8]
    per_chunk, ready = ChunkReader(r, encode_bytes=encode_bytes).read(page_ids, 3 * PAGE)
    assert ready is None and len(per_chunk) == 2
    want = _want(r, page_ids, 3 * PAGE)
    for c, layers in enumerate(per_chunk):
        assert len(layers) == 3
        for i, x in enumerate(layers):
            assert x.shape == (2, 3 * PAGE, 2, 64)
            assert torch.equal(x.reshape(-1).view(torch.int16), want[i][c].view(torch.int16)), (c, i)
    got = chunk_groups(gather_layer(r, 1, torch.tensor(page_ids)), PAGE)[4]
    assert torch.equal(got.view(torch.int16), _want(r, page_ids, PAGE)[1][4].view(torch.int16))


def test_read_zip_refuses_pages_that_are_not_whole_chunks() -> None:
    r = _runner()
    with pytest.raises(ValueError, match="not whole chunks"):
        ChunkReader(r).read([0, 1, 2], 2 * PAGE)
    with pytest.raises(ValueError, match="no pages"):
        ChunkReader(r).read_zip([], 2 * PAGE)
    with pytest.raises(ValueError, match="not whole chunks"):
        ChunkReader(r).read_zip([0, 1], PAGE + 2)
    with pytest.raises(ValueError, match="encode_bytes"):
        ChunkReader(r, encode_bytes=0)
