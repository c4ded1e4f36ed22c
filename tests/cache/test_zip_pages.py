"""Compressed paged storage without a model: bit-exact round trips, in-place compression, chunk sharing, capacity."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtide.cache import zip_blocks as zb
from kvtide.cache.pool import ChunkPool, PoolGeometry
from kvtide.cache.zip_pages import COMPRESSED, ZipGeometry, ZipPagedKV
from kvtide.cache.zip_pages import RAW as PAGE_RAW
from kvtide.config import CacheConfig

GEO = ZipGeometry(num_layers=3, num_kv_heads=2, head_dim=64, page_size=16)


def kv_like(t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K: first page with an all-zero channel (v1 refuses it, v2 escapes it), last page with an outlier
    channel (incompressible), the rest narrow; V narrow (always compressible)."""
    shape = (t, GEO.num_kv_heads, GEO.head_dim)
    k = narrow(shape, gen).float()
    k[: GEO.page_size, :, 5] = 0.0
    k[-GEO.page_size:, :, 3] *= 1e6
    return k.to(torch.bfloat16), narrow(shape, gen)


def narrow(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Values whose exponents span less than 16 in every block: always compressible."""
    x = (torch.rand(shape, generator=gen) * 0.9 + 0.1) * (torch.randint(0, 2, shape, generator=gen) * 2 - 1)
    return x.to(torch.bfloat16)


def fill(store: ZipPagedKV, pids: list[int], seed: int = 0) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    store.alloc_pages(pids)
    slots = torch.tensor([p * GEO.page_size + o for p in pids for o in range(GEO.page_size)])
    written = {}
    for layer in range(GEO.num_layers):
        k, v = kv_like(len(slots), gen)
        for chunk in torch.arange(len(slots)).split(5):  # a few tokens per write, like decode steps
            store.write(layer, k[chunk], v[chunk], slots[chunk])
        written[layer] = (k, v)
    return written


def assert_exact(store: ZipPagedKV, pids: list[int], written) -> None:
    for layer, (k, v) in written.items():
        got = store.read_pages(layer, torch.tensor(pids))  # [n, 2, P, H, D]
        assert torch.equal(got[:, 0].reshape(k.shape).view(torch.int16), k.view(torch.int16))
        assert torch.equal(got[:, 1].reshape(v.shape).view(torch.int16), v.view(torch.int16))


@pytest.mark.parametrize("version", [1, 2])
def test_write_compress_read_is_bit_exact_and_frees_raw_bytes(version):
    geo = ZipGeometry(3, 2, 64, 16, format_version=version)
    store = ZipPagedKV(geo, budget_bytes=40 * geo.raw_page_bytes)
    pids = [0, 5, 7, 9]
    empty = store.free_pages(reserve=False)
    assert empty >= store.raw_capacity_pages - 1  # chunk granularity may cost one page
    written = fill(store, pids)
    assert_exact(store, pids, written)
    before = store.alloc.stats()["chunks_owned"]
    store.compress(pids)
    assert (store.state[pids] == COMPRESSED).all()
    assert_exact(store, pids, written)
    desc = store.group_desc_all[:, pids]
    assert (desc == zb.RAW).any() and (desc != zb.RAW).any(), "expect mixed raw and compressed blocks"
    if version == 2:
        assert ((desc & zb.ESCAPE != 0) & (desc != zb.RAW)).any(), "v2 should code the zero-laden key blocks"
    s = store.stats()
    assert s["v_ratio"] == pytest.approx(0.75) and 0.75 < s["k_ratio"] < 1.0
    # no uncompressed copy remains: every held group's bytes are accounted for by its class slot
    assert store.alloc.stats()["chunks_owned"] <= before + geo.num_layers * geo.blocks_per_group
    store.release_pages(pids)
    assert store.alloc.stats()["chunks_owned"] == 0, "emptied chunks must go back"
    assert store.free_pages(reserve=False) == empty


def test_group_tables_follow_the_contract():
    """A kernel that only knows pool, group_start and group_desc finds every block (zip_format's decoder)."""
    store = ZipPagedKV(GEO, budget_bytes=20 * GEO.raw_page_bytes)
    pids = [2, 3]
    written = fill(store, pids, seed=4)
    store.compress(pids)
    for layer, (k, _) in written.items():
        start = store.group_start[layer][pids][:, :, 0].reshape(-1)  # K groups of both pages, both heads
        desc = store.group_desc[layer][pids][:, :, 0].reshape(-1, GEO.blocks_per_group)
        assert (start % zb.ALIGN == 0).all()
        offsets = zb.offsets_from_starts(start, desc, GEO.block_size)
        vals = zb.unpack(store.pool, desc, offsets, GEO.block_size).view(2, GEO.num_kv_heads, GEO.page_size, GEO.head_dim)
        expect = k.view(2, GEO.page_size, GEO.num_kv_heads, GEO.head_dim).transpose(1, 2)  # [page, head, token, dim]
        assert torch.equal(vals.view(torch.int16), expect.contiguous().view(torch.int16))


def in_place_from_tables(store: ZipPagedKV) -> tuple[int, int]:
    """Groups held compressed in raw-class chunks (in place), and the bytes that wastes, read off the tables."""
    held = store.state == COMPRESSED
    starts, cls = store._starts_host[:, held], store._class_host[:, held]
    chunk_class = store.alloc.klass[starts // store.alloc.geo.chunk_bytes]
    inside = (cls > 0) & (chunk_class == 0)
    waste = store.geo.raw_group_bytes - store.alloc.slot_bytes_by_class[cls[inside]]
    return int(inside.sum()), int(waste.sum())


def test_compression_finishes_in_place_when_no_destination_is_free():
    chunk = GEO.raw_group_bytes * 4
    budget = GEO.num_layers * chunk * 2  # room for 8 raw groups per layer = 2 pages, nothing spare
    store = ZipPagedKV(GEO, budget, chunk_bytes=chunk, private_chunks=2)
    assert store.free_pages(reserve=False) == 2
    written = fill(store, [0, 1])
    store.compress([0, 1])
    assert store.counters["groups_in_place"] > 0
    assert (store.state[[0, 1]] == COMPRESSED).all()
    assert_exact(store, [0, 1], written)
    st = store.stats()
    assert (st["groups_in_place_held"], st["in_place_waste_bytes_held"]) == in_place_from_tables(store)
    assert st["groups_in_place_held"] == store.counters["groups_in_place"] > 0
    store.release_pages([0])
    assert (store.stats()["groups_in_place_held"], store.stats()["in_place_waste_bytes_held"]) == \
        in_place_from_tables(store)
    store.release_pages([1])
    assert store.free_pages(reserve=False) == 2
    assert store.stats()["groups_in_place_held"] == store.stats()["in_place_waste_bytes_held"] == 0
    assert store.counters["groups_in_place"] > 0  # the counter keeps every group ever placed so


@pytest.mark.parametrize("shared", [False, True], ids=["layer-slabs", "shared-slabs"])
def test_compression_short_of_slots_evicts_cached_pages_before_compressing_in_place(shared):
    """The tight pool of the test above, with the first two pages standing for cached pages an evictor may drop
    (as BlockManager.evict_lru does). Without it the last page compresses in place; with it the compression
    evicts cached pages first, never the pages it is compressing, and nothing is compressed in place while
    cached pages are left. Bytes of the pages kept stay exact."""
    chunk = GEO.raw_group_bytes * 4
    runs = {}
    for evict in (False, True):
        store = ZipPagedKV(GEO, GEO.num_layers * chunk * 6, chunk_bytes=chunk, private_chunks=0, shared_slabs=shared)
        cached, calls = [0, 1], []

        def evictor(n, keep, store=store, cached=cached, calls=calls):
            victims = [p for p in cached if p not in keep][:n]
            calls.append((n, set(keep), victims))
            for p in victims:
                cached.remove(p)
            store.release_pages(victims)
            return len(victims)

        store.evictor = evictor if evict else None
        pids = list(range(store.free_pages(reserve=False)))
        written = {}
        for first in range(0, len(pids), 2):
            batch = pids[first:first + 2]
            written[first] = (batch, fill(store, batch, seed=first))
            store.compress(batch)
        runs[evict] = (store, calls, cached)
        for batch, w in written.values():
            if all(store.state[p] == COMPRESSED for p in batch):
                assert_exact(store, batch, w)
        assert (store.stats()["groups_in_place_held"], store.stats()["in_place_waste_bytes_held"]) == \
            in_place_from_tables(store)
    plain = runs[False][0]
    assert plain.stats()["groups_in_place_held"] > 0 and plain.counters["evictions_for_compression"] == 0
    store, calls, cached = runs[True]
    assert calls and store.counters["evictions_for_compression"] > 0
    assert all(not set(v) & keep for _, keep, v in calls), "evicted a page being compressed"
    evicted = [p for _, _, v in calls for p in v]
    assert evicted and set(evicted) <= {0, 1} and all(store.state[p] == -1 for p in evicted)
    if cached:  # pages left to evict: then nothing had to go in place
        assert store.stats()["groups_in_place_held"] == 0
    assert store.stats()["groups_in_place_held"] < plain.stats()["groups_in_place_held"]


def stored_bytes_from_descriptors(store: ZipPagedKV, pids: list[int]) -> list[int]:
    """K and V bytes the held groups take, read from the device descriptors (what the counters must equal)."""
    sizes = zb.block_sizes(store.group_desc_all[:, torch.tensor(pids)], store.block_size)
    return sizes.sum(dim=(0, 1, 2, 4)).tolist()


@pytest.mark.parametrize("shared", [False, True], ids=["layer-slabs", "shared-slabs"])
@pytest.mark.parametrize("tail", [0, 768], ids=["raw-aligned-chunks", "chunks-with-a-tail"])
@pytest.mark.parametrize("spare_chunks", [0, 1, 3, 12])
def test_compress_in_a_tight_pool_is_exact_and_counts_what_it_stores(spare_chunks, tail, shared):
    """From no room at all (in place) through partly short (one allocation per class falls short, the rest go
    chunk by chunk) to roomy: bytes exact, the stored-byte counters equal the descriptors, nothing leaks. Chunks
    with a tail (not a whole number of raw groups) take the per-value path for zeroing and staging raw groups.
    With shared slabs the layers' groups share chunks of a class."""
    chunk = GEO.raw_group_bytes * 4 + tail
    store = ZipPagedKV(GEO, GEO.num_layers * chunk * 4 + spare_chunks * chunk, chunk_bytes=chunk, private_chunks=2,
                       shared_slabs=shared)
    assert (store._raw_rows is None) == bool(tail)
    pids = list(range(store.free_pages(reserve=False)))
    written = {}
    for first in range(0, len(pids), 2):  # two pages per round, as filled pages arrive in decode
        batch = pids[first:first + 2]
        written[first] = (batch, fill(store, batch, seed=first))
        store.compress(batch)
    for batch, w in written.values():
        assert_exact(store, batch, w)
    k, v = stored_bytes_from_descriptors(store, pids)
    assert (store.counters["k_stored_bytes"], store.counters["v_stored_bytes"]) == (k, v)
    held = lambda: (store.stats()["groups_in_place_held"], store.stats()["in_place_waste_bytes_held"])  # noqa: E731
    assert held() == in_place_from_tables(store)
    assert held()[0] <= store.counters["groups_in_place"]
    store.release_pages(pids[::2])
    k, v = stored_bytes_from_descriptors(store, pids[1::2])
    assert (store.counters["k_stored_bytes"], store.counters["v_stored_bytes"]) == (k, v)
    assert held() == in_place_from_tables(store)
    store.release_pages(pids[1::2])
    assert held() == (0, 0)
    assert store.alloc.stats()["chunks_owned"] == 0 and store.counters["k_stored_bytes"] == 0


def test_emptied_chunk_returns_to_shared_list_and_serves_another_layer():
    geo = PoolGeometry(num_layers=2, groups_per_page=4, blocks_per_group=2, block_size=512, chunk_bytes=4 * 2048,
                       num_chunks=3, private_chunks=0)
    pool = ChunkPool(geo)
    a = pool.alloc(0, 2, 5)  # layer 0, fully compressed groups: 5 slots of 1536 B fill one 8 KiB chunk
    assert len(a) == 5 and len({o // geo.chunk_bytes for o in a}) == 1
    chunk = int(a[0]) // geo.chunk_bytes
    pool.free(a)
    assert pool.stats()["chunks_returned"] == 1 and chunk in pool.shared_free
    b = pool.alloc(1, 0, 12)  # layer 1 takes all three chunks, the freed one included
    assert len(b) == 12 and chunk in {o // geo.chunk_bytes for o in b}
    assert pool.stats()["shared_chunk_reuses_across_layers"] >= 1
    assert len(pool.alloc(0, 0, 1)) == 0, "the pool is dry: no slot may be invented"


def test_capacity_counts_all_layers_and_never_overpromises():
    store = ZipPagedKV(GEO, budget_bytes=30 * GEO.raw_page_bytes)
    n = store.free_pages(reserve=False)
    assert n <= store.raw_capacity_pages and store.free_pages() <= n
    store.alloc_pages(list(range(n)))  # exactly what was promised fits
    assert store.free_pages(reserve=False) == 0
    with pytest.raises(MemoryError):
        store.alloc_pages([n])
    assert store.free_pages(reserve=False) == 0, "a failed allocation must leave nothing behind"


def test_capacity_grows_as_pages_compress():
    store = ZipPagedKV(GEO, budget_bytes=64 * GEO.raw_page_bytes)
    gen = torch.Generator().manual_seed(1)
    pid = 0
    while store.free_pages() > 0:  # fill the pool with narrow (compressible) pages, compressing each
        store.alloc_pages([pid])
        slots = torch.arange(pid * GEO.page_size, (pid + 1) * GEO.page_size)
        for layer in range(GEO.num_layers):
            k = narrow((GEO.page_size, GEO.num_kv_heads, GEO.head_dim), gen)
            store.write(layer, k, k, slots)
        store.compress([pid])
        pid += 1
    s = store.stats()
    assert s["pages_held"] == pid
    assert pid >= 1.25 * store.raw_capacity_pages, s  # 0.75 bytes per page (1.33x), less the reserved chunks
    assert s["k_ratio"] == s["v_ratio"] == 0.75


def test_bad_geometry_and_config_fail_fast():
    with pytest.raises(ValueError, match="block_size 384 does not divide"):
        ZipGeometry(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16, block_size=384)
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(compress=True, block_size=100)
    with pytest.raises(ValueError, match="compress needs kv_dtype bfloat16"):
        CacheConfig(compress=True, kv_dtype="float32")
    with pytest.raises(ValueError, match="format_version"):
        CacheConfig(compress=True, format_version=3)
    with pytest.raises(ValueError, match="private"):  # a private chunk for each layer's slabs: more than there are
        ZipPagedKV(GEO, budget_bytes=2 * GEO.raw_page_bytes, chunk_bytes=GEO.raw_page_bytes, private_chunks=1,
                   shared_slabs=False)
    with pytest.raises(ValueError, match="private"):  # shared slabs: one owner, still more than there are
        ZipPagedKV(GEO, budget_bytes=2 * GEO.raw_page_bytes, chunk_bytes=GEO.raw_page_bytes, private_chunks=3)
    assert np.isfinite(CacheConfig().block_size)



def test_write_with_rows_planned_once_equals_per_call_rows() -> None:
    """Backends plan write_rows once per step and pass it to every layer: the pool's bytes are those of writes
    that compute the rows themselves (two stores, same writes, compared bit for bit)."""
    stores = [ZipPagedKV(GEO, budget_bytes=40 * GEO.raw_page_bytes) for _ in range(2)]
    pids = [2, 4]
    gen = torch.Generator().manual_seed(3)
    for st in stores:
        st.alloc_pages(pids)
    for step in range(3):
        slots = torch.tensor([2 * GEO.page_size + 3 + step, 4 * GEO.page_size + step, 4 * GEO.page_size + 9 + step])
        rows = stores[1].write_rows(slots)
        for layer in range(GEO.num_layers):
            k, v = narrow((3, GEO.num_kv_heads, GEO.head_dim), gen), narrow((3, GEO.num_kv_heads, GEO.head_dim), gen)
            stores[0].write(layer, k, v, slots)
            stores[1].write(layer, k, v, slots, rows)
    for layer in range(GEO.num_layers):
        a, b = (st.read_pages(layer, torch.tensor(pids)) for st in stores)
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        assert bool((a != 0).any())  # something was written


def test_pool_free_in_bulk_equals_one_by_one() -> None:
    """ChunkPool.free groups offsets by chunk (numpy); the state must be what freeing them one at a time gives:
    the same free-slot order per chunk, counts, open slabs, chunks returned, and the same next allocations."""
    geo = PoolGeometry(num_layers=2, groups_per_page=2, blocks_per_group=2, block_size=512, chunk_bytes=2048 * 6,
                       num_chunks=12, private_chunks=1)
    rng = np.random.default_rng(0)
    pools = [ChunkPool(geo), ChunkPool(geo)]
    taken = [[p.alloc(layer, k, 9) for layer in range(2) for k in (0, 1, 2)] for p in pools]
    assert all(np.array_equal(a, b) for a, b in zip(*taken))
    offs = np.concatenate(taken[0])
    give = rng.permutation(offs)[: len(offs) * 2 // 3]  # shuffled, spanning chunks, emptying some of them
    pools[0].free(give)
    for off in give:
        pools[1].free(np.array([off]))
    a, b = pools
    assert a.slot_free == b.slot_free and a.open == b.open and a.chunks_returned == b.chunks_returned
    assert np.array_equal(a.used, b.used) and np.array_equal(a.raw_free_slots, b.raw_free_slots)
    assert a.shared_free == b.shared_free and a.private_free == b.private_free
    assert a.chunks_returned > 0, "the case should empty a chunk"
    for layer in range(2):
        for k in (0, 1, 2):
            assert np.array_equal(a.alloc(layer, k, 5), b.alloc(layer, k, 5))


@pytest.mark.parametrize("tail", [0, 768], ids=["raw-aligned-chunks", "chunks-with-a-tail"])
def test_new_pages_read_as_zeros_in_slots_a_previous_page_used(tail):
    chunk = GEO.raw_group_bytes * 4 + tail
    store = ZipPagedKV(GEO, GEO.num_layers * chunk * 3, chunk_bytes=chunk, private_chunks=3)
    fill(store, [0, 1], seed=3)
    store.release_pages([0, 1])
    store.alloc_pages([2, 3])
    assert set(store._starts_host[:, [2, 3]].ravel().tolist()) & set(range(0, store.pool.numel(), chunk)), \
        "expected the new pages to reuse slots"
    for layer in range(GEO.num_layers):
        assert (store.read_pages(layer, torch.tensor([2, 3])).view(torch.int16) == 0).all()


def test_begun_compression_keeps_pages_readable_and_skips_pages_freed_or_reused_before_it_finishes():
    """compress_begin / compress_finish (the engine's split across two steps): pages read back exactly while
    pending; one released meanwhile is skipped, one released and allocated again keeps its new contents raw."""
    store = ZipPagedKV(GEO, budget_bytes=40 * GEO.raw_page_bytes)
    first = fill(store, [0, 1, 2, 3], seed=5)
    store.compress_begin([0, 1, 2, 3])
    assert (store.state[[0, 1, 2, 3]] == PAGE_RAW).all(), "pending pages stay raw"
    assert_exact(store, [0, 1, 2, 3], first)
    store.compress_begin([0])  # already pending: not staged twice
    assert sum(len(j.pids) for j in store._pending) == 4
    store.release_pages([1, 2])
    again = fill(store, [2], seed=6)  # page id 2 reused for new contents
    store.compress_finish()
    assert (store.state[[0, 3]] == COMPRESSED).all() and store.state[2] == PAGE_RAW
    def pages(x: torch.Tensor) -> torch.Tensor:  # rows of pages 0 and 3 of a fill of pages 0..3
        return x.view(4, -1, *x.shape[1:])[[0, 3]].flatten(0, 1)

    assert_exact(store, [0, 3], {layer: (pages(k), pages(v)) for layer, (k, v) in first.items()})
    assert_exact(store, [2], again)
    store.compress([2])
    assert_exact(store, [2], again)
    store.release_pages([0, 2, 3])
    assert store.alloc.stats()["chunks_owned"] == 0 and store.counters["k_stored_bytes"] == 0


def test_compression_finished_a_few_pages_at_a_time_equals_all_at_once():
    """compress_finish(max_pages) (the engine spreads a page step's placement over a few steps): oldest pages
    first, the rest stay raw and readable, a page released meanwhile is skipped, and the pool ends up holding
    the same compressed groups as one finish of everything, every value exact."""
    pids = list(range(10))
    stores = [ZipPagedKV(GEO, budget_bytes=40 * GEO.raw_page_bytes) for _ in range(2)]
    written = [fill(st, pids, seed=9) for st in stores]
    for st in stores:
        st.compress_begin(pids[:6])
        st.compress_begin(pids[6:])
    one, spread = stores
    one.release_pages([4])
    one.compress_finish()
    assert spread.pages_pending == 10
    spread.compress_finish(max_pages=3)
    assert (spread.state[:3] == COMPRESSED).all() and (spread.state[3:10] == PAGE_RAW).all()
    assert spread.pages_pending == 7
    assert_exact(spread, pids, written[1])
    spread.release_pages([4])
    spread.compress_finish(max_pages=4)  # 3, 5, 6 (4 is gone) and 7: across the two begun jobs
    assert (spread.state[[3, 5, 6, 7]] == COMPRESSED).all() and (spread.state[[8, 9]] == PAGE_RAW).all()
    spread.compress_finish(max_pages=0)
    assert spread.pages_pending == 2
    spread.compress_finish()
    assert spread.pages_pending == 0 and one.pages_pending == 0
    live = [p for p in pids if p != 4]
    # the same blocks compressed and bytes stored (places may differ: slices free raw slots sooner)
    assert torch.equal(one.group_desc_all[:, live], spread.group_desc_all[:, live])
    assert np.array_equal(one._class_host[:, live], spread._class_host[:, live])
    assert one.counters["k_stored_bytes"] == spread.counters["k_stored_bytes"]
    assert one.counters["v_stored_bytes"] == spread.counters["v_stored_bytes"]
    rows = {layer: (k.view(10, -1, *k.shape[1:])[live].flatten(0, 1), v.view(10, -1, *v.shape[1:])[live].flatten(0, 1))
            for layer, (k, v) in written[1].items()}
    assert_exact(spread, live, rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_page_allocation_and_compression_make_no_host_sync_on_cuda():
    """On a GPU, compress_begin and compress_finish run right after the step's forward is enqueued: a host sync
    there (a pageable copy, a boolean mask, a value read back) would wait for that whole forward. Not one."""
    from kvtide.engine.pool_kernels import triton_pool_kernels

    store = ZipPagedKV(GEO, budget_bytes=40 * GEO.raw_page_bytes, device="cuda", kernels=triton_pool_kernels())
    gen = torch.Generator().manual_seed(7)
    store.alloc_pages([0, 1, 2])
    slots = torch.arange(3 * GEO.page_size, device="cuda")
    for layer in range(GEO.num_layers):
        k, v = kv_like(len(slots), gen)
        store.write(layer, k.cuda(), v.cuda(), slots)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        store.compress_begin([0, 1, 2])
        store.alloc_pages([3, 4])
        store.release_pages([1])
        store.compress_finish()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert (store.state[[0, 2]] == COMPRESSED).all()
