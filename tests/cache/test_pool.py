"""ChunkPool's batched bookkeeping against the plain loops it replaced: same offsets, same state, same set order.

The allocator breaks ties between equally full chunks by the iteration order of each slab's set, so "the same
state" includes that order: the sets must see the same adds and discards in the same order.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtide.cache import zip_blocks as zb
from kvtide.cache.pool import ChunkPool, PoolGeometry
from kvtide.cache.zip_pages import ABSENT, RAW, ZipGeometry, ZipPagedKV


class LoopPool(ChunkPool):
    """alloc and free as they were before the batched versions (one Python iteration per chunk, numpy per chunk)."""

    def alloc(self, layer: int, k: int, count: int) -> np.ndarray:
        out: list[np.ndarray] = []
        got = 0
        size = self.geo.slot_bytes(k)
        cb = self.geo.chunk_bytes
        chunks = self.open[layer][k]
        cand = np.fromiter(chunks, dtype=np.int64, count=len(chunks))
        queue = iter(cand[np.argsort(-self.used[cand], kind="stable")].tolist())
        while got < count:
            c = next(queue, None)
            if c is None:
                c = self._take_chunk(layer, k)
            if c is None:
                break
            free = self.slot_free[c]
            take = min(count - got, len(free))
            slots = free[len(free) - take:]
            del free[len(free) - take:]
            out.append(c * cb + np.asarray(slots[::-1], dtype=np.int64) * size)
            self.used[c] += take
            got += take
            if k == 0:
                self.raw_free_slots[layer] -= take
            if not free:
                chunks.discard(c)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def free(self, offsets: np.ndarray) -> None:
        offs = np.asarray(offsets, dtype=np.int64).ravel()
        if not offs.size:
            return
        cb = self.geo.chunk_bytes
        chunk = offs // cb
        order = np.argsort(chunk, kind="stable")
        chunk, offs = chunk[order], offs[order]
        cuts = np.flatnonzero(np.diff(chunk)) + 1
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [chunk.size]])
        last = np.maximum.reduceat(order, starts)
        groups = np.argsort(last, kind="stable")
        for c, a, b in zip(chunk[starts][groups].tolist(), starts[groups].tolist(), ends[groups].tolist()):
            layer, k = int(self.owner[c]), int(self.klass[c])
            n = b - a
            self.slot_free[c].extend(((offs[a:b] - c * cb) // self.geo.slot_bytes(k)).tolist())
            self.used[c] -= n
            self.open[layer][k].add(c)
            if k == 0:
                self.raw_free_slots[layer] += n
            if self.used[c] == 0:
                self._return_chunk(c)


def assert_same_state(a: ChunkPool, b: ChunkPool) -> None:
    assert a.slot_free == b.slot_free
    assert [[list(s) for s in per] for per in a.open] == [[list(s) for s in per] for per in b.open], "set order"
    for name in ("owner", "klass", "used", "raw_free_slots", "last_owner"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.private_free == b.private_free and a.shared_free == b.shared_free
    assert (a.chunks_returned, a.shared_reuses) == (b.chunks_returned, b.shared_reuses)


@pytest.mark.parametrize("seed", range(6))
def test_batched_alloc_and_free_equal_the_loops_on_random_workloads(seed: int) -> None:
    """Random allocations (all layers and classes, often more than fits) and frees (shuffled subsets across chunks,
    emptying some) on a small pool: every call returns the same offsets and leaves the same state."""
    rng = np.random.default_rng(seed)
    geo = PoolGeometry(num_layers=3, groups_per_page=4, blocks_per_group=4, block_size=32, chunk_bytes=256 * 7,
                       num_chunks=40, private_chunks=1)
    new, old = ChunkPool(geo), LoopPool(geo)
    if seed % 2:  # the sort key of pools with more than 65,536 chunks (int64 instead of 16 bits)
        new._chunk_key = np.int64
    held: list[int] = []
    for _ in range(300):
        if held and rng.random() < 0.45:
            idx = rng.permutation(len(held))[: rng.integers(1, len(held) + 1)]
            give = np.asarray(held)[idx]
            held = [h for i, h in enumerate(held) if i not in set(idx.tolist())]
            new.free(give)
            old.free(give.copy())
        else:
            layer, k, n = int(rng.integers(3)), int(rng.integers(geo.num_classes)), int(rng.integers(0, 40))
            got_new, got_old = new.alloc(layer, k, n), old.alloc(layer, k, n)
            assert got_new.dtype == np.int64 and np.array_equal(got_new, got_old)
            held += got_new.tolist()
        assert_same_state(new, old)
        assert new.new_pages_fit() == old.new_pages_fit() and new.new_pages_fit(False) == old.new_pages_fit(False)
    assert new.chunks_returned > 0 and new.shared_reuses > 0, "the workload should return and reuse chunks"


def test_alloc_from_a_dry_pool_gives_nothing_and_changes_nothing() -> None:
    geo = PoolGeometry(num_layers=2, groups_per_page=2, blocks_per_group=2, block_size=512, chunk_bytes=2048 * 3,
                       num_chunks=2, private_chunks=1)
    pool = ChunkPool(geo)
    assert len(pool.alloc(0, 0, 3)) == 3 and len(pool.alloc(1, 1, 100)) == geo.slots_per_chunk(1)
    assert not pool.can_alloc(0, 1) and pool.can_alloc(1, 1) is False
    before = (pool.slot_free[0][:], pool.used.copy())
    assert pool.alloc(0, 1, 5).size == 0 and pool.alloc(0, 0, 0).size == 0
    assert pool.slot_free[0] == before[0] and np.array_equal(pool.used, before[1])


class LoopPlaceStore(ZipPagedKV):
    """ZipPagedKV with the placement as it was before (every call made, every segment visited) over a LoopPool."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.alloc = LoopPool(self.alloc.geo)

    def _place(self, layer: int, cls: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
        todo = np.nonzero(cls > 0)[0]
        if not len(todo):
            return
        placed = []
        for k in np.unique(cls[todo]).tolist():
            sel = todo[cls[todo] == k]
            offs = self.alloc.alloc(layer, k, len(sel))
            new[sel[: len(offs)]] = offs
            placed.append(sel[: len(offs)])
        placed = np.concatenate(placed)
        self.alloc.free(old[placed])
        if len(placed) == len(todo):
            return
        todo = np.setdiff1d(todo, placed)
        chunk = old[todo] // self.alloc.geo.chunk_bytes
        todo = todo[np.argsort(chunk, kind="stable")]
        cuts = np.nonzero(np.diff(np.sort(chunk)))[0] + 1
        for seg in np.split(todo, cuts):
            placed = []
            for k in np.unique(cls[seg]).tolist():
                sel = seg[cls[seg] == k]
                offs = self.alloc.alloc(layer, k, len(sel))
                got = sel[: len(offs)]
                new[got] = offs
                placed.append(got)
                if len(offs) < len(sel):
                    n = len(sel) - len(offs)
                    self.counters["groups_in_place"] += n
                    self.counters["in_place_waste_bytes"] += n * (self.geo.raw_group_bytes - self.alloc.geo.slot_bytes(k))
            self.alloc.free(old[np.concatenate(placed)])


def spiky_kv(geo: ZipGeometry, t: int, gen: torch.Generator, p: float) -> torch.Tensor:
    """[t, heads, head_dim] BF16, narrow but for one huge value in a random share p of (4-token, head) cells: with
    256-value blocks of head_dim 64 that spoils whole blocks, so groups land in every class 0..4."""
    x = (torch.rand(t, geo.num_kv_heads, geo.head_dim, generator=gen) * 0.9 + 0.1)
    spoil = torch.rand(t // 4, geo.num_kv_heads, generator=gen) < p
    x.view(t // 4, 4, geo.num_kv_heads, geo.head_dim)[..., 0, :, 0][spoil] = 1e6
    return x.to(torch.bfloat16)


def assert_same_store(a: ZipPagedKV, b: ZipPagedKV) -> None:
    assert_same_state(a.alloc, b.alloc)
    for name in ("_starts_host", "_class_host", "state", "_generation"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.counters == b.counters
    assert torch.equal(a.group_start_all, b.group_start_all) and torch.equal(a.group_desc_all, b.group_desc_all)
    assert torch.equal(a.pool, b.pool)


def run_store_workload(new: ZipPagedKV, old: ZipPagedKV, seed: int, max_new: int, check=None) -> int:
    """40 rounds on two stores of one geometry, the same calls to each: finish the previous round's compressions,
    allocate up to ``max_new`` fresh pages (as many as fit), write every layer's spiky K/V, begin compressing them,
    release a random part of what is held; after each round the stores must agree (and ``check(new, old)`` hold).
    Returns the pages allocated."""
    geo = new.geo
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    held: list[int] = []
    allocated = 0
    for _ in range(40):
        for st in (new, old):
            st.compress_finish()  # the previous round's pages, one "step" later
        room = new.free_pages(reserve=False)
        assert room == old.free_pages(reserve=False) and new.free_pages() == old.free_pages()
        absent = [p for p in range(new.num_page_ids) if new.state[p] == ABSENT]
        fresh = absent[: int(rng.integers(0, min(room, max_new) + 1))]
        slots = torch.tensor([p * geo.page_size + o for p in fresh for o in range(geo.page_size)], dtype=torch.long)
        kv = [(spiky_kv(geo, len(slots), gen, 0.3), spiky_kv(geo, len(slots), gen, 0.1)) for _ in range(geo.num_layers)]
        for st in (new, old):
            st.alloc_pages(fresh)
            for layer, (k, v) in enumerate(kv):
                st.write(layer, k, v, slots)
            st.compress_begin(fresh)
        allocated += len(fresh)
        held += fresh
        if held and rng.random() < 0.5:
            gone = [held.pop(int(i)) for i in sorted(rng.choice(len(held), rng.integers(1, len(held) + 1),
                                                                replace=False), reverse=True)]
            for st in (new, old):
                st.release_pages(gone)
        assert_same_store(new, old)
        if check is not None:
            check(new, old)
    return allocated


@pytest.mark.parametrize("seed", range(4))
def test_store_places_every_group_as_the_loops_did_in_a_tight_pool(seed: int) -> None:
    """Pages allocated, written, compressed (both halves, a step apart) and released at random in a pool too small
    for all of them (prefix-cache pressure): the batched placement (early in-place exit included) and allocator
    leave the pool, the tables and every counter exactly as the old loops do, step by step."""
    geo = ZipGeometry(num_layers=3, num_kv_heads=2, head_dim=64, page_size=16, block_size=256)
    chunk = geo.raw_group_bytes * 4
    kw = dict(budget_bytes=geo.num_layers * chunk * 3 + 5 * chunk, chunk_bytes=chunk, private_chunks=2,
              shared_slabs=False)  # the old loops knew only slabs per layer
    new, old = ZipPagedKV(geo, **kw), LoopPlaceStore(geo, **kw)
    run_store_workload(new, old, seed, max_new=8)
    assert new.counters["groups_in_place"] > 0 and new.alloc.chunks_returned > 0, \
        "the workload should compress in place and return chunks"


class _Placer:
    """What ZipPagedKV._place touches, over a bare ChunkPool (a pool state built by hand)."""

    def __init__(self, pool: ChunkPool, geo: ZipGeometry, place) -> None:
        self.alloc, self.geo, self._place_fn = pool, geo, place
        self.counters = {"groups_in_place": 0, "in_place_waste_bytes": 0}

    _alloc_into = ZipPagedKV._alloc_into
    _in_place = ZipPagedKV._in_place
    _room_for = ZipPagedKV._room_for
    evictor = None  # nothing to evict: in place, as before evictions for compression

    def place(self, *args) -> None:
        self._place_fn(self, *args)


def test_placement_that_runs_dry_part_way_through_the_raw_chunks_equals_the_loops() -> None:
    """Hand-built: the first pass fills the one open compressed chunk and empties a raw chunk, which comes back and
    serves the next raw chunks' groups until it is full; the rest (one short in a chunk, then a whole chunk) is
    compressed in place. The batched placement stops early there; offsets, counters and pool state must not differ."""
    geo = ZipGeometry(num_layers=1, num_kv_heads=2, head_dim=64, page_size=16, block_size=256)
    pg = PoolGeometry(1, geo.groups_per_page, geo.blocks_per_group, geo.block_size, chunk_bytes=geo.raw_group_bytes * 4,
                      num_chunks=6, private_chunks=0)
    assert (pg.slots_per_chunk(0), pg.slots_per_chunk(4)) == (4, 5)
    out = []
    for pool_cls, place in ((ChunkPool, ZipPagedKV._place), (LoopPool, LoopPlaceStore._place)):
        pool = pool_cls(pg)
        raw = pool.alloc(0, 0, 20)  # raw chunks 0..4, four groups each
        assert len(pool.alloc(0, 4, 1)) == 1 and not pool.shared_free  # a compressed chunk with 4 free slots; no more
        old = np.concatenate([raw[0:4], raw[4:6], raw[8:10], raw[12:14], raw[16:18]])  # half of chunks 1..4 stay
        placer = _Placer(pool, geo, place)
        new = old.copy()
        placer.place(0, np.full(len(old), 4, dtype=np.int8), old, new)
        out.append((pool, new, placer.counters))
    (a, new_a, ca), (b, new_b, cb) = out
    assert np.array_equal(new_a, new_b) and ca == cb
    assert_same_state(a, b)
    assert ca["groups_in_place"] == 3 and (new_a != old).sum() == 9


def _live_slots_disjoint_and_in_their_class(pool: ChunkPool, held: dict[int, int]) -> None:
    """Every held slot (offset -> class) lies inside a chunk owned with that class, no two overlap, and the free
    class-0 slot counts equal what the owned raw chunks hold free."""
    g = pool.geo
    spans = sorted((off, off + g.slot_bytes(k)) for off, k in held.items())
    assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:])), "two live slots overlap"
    for off, k in held.items():
        c = off // g.chunk_bytes
        assert pool.owner[c] >= 0 and pool.klass[c] == k and off + g.slot_bytes(k) <= (c + 1) * g.chunk_bytes
    for o in range(g.num_owners):
        free0 = sum(len(pool.slot_free[c]) for c in np.flatnonzero((pool.owner == o) & (pool.klass == 0)))
        assert pool.raw_free_slots[o] == free0


@pytest.mark.parametrize("shared", [False, True], ids=["layer-slabs", "shared-slabs"])
@pytest.mark.parametrize("seed", range(4))
def test_new_pages_fit_is_exactly_what_allocation_gives(seed: int, shared: bool) -> None:
    """Random allocations and frees over all layers and classes; at every step the capacity figure is checked
    against doing it: ``new_pages_fit(False)`` whole pages (``groups_per_page`` raw slots in every layer) can be
    allocated on a copy of the pool, one page more cannot. Held slots never overlap and stay in chunks of their
    class, with slabs per layer or shared by all layers."""
    import copy

    rng = np.random.default_rng(seed)
    geo = PoolGeometry(num_layers=3, groups_per_page=4, blocks_per_group=4, block_size=32, chunk_bytes=256 * 7,
                       num_chunks=24, private_chunks=1, shared_slabs=shared)
    pool = ChunkPool(geo)
    held: dict[int, int] = {}
    for _ in range(150):
        if held and rng.random() < 0.4:
            give = rng.choice(np.fromiter(held, dtype=np.int64), rng.integers(1, len(held) + 1), replace=False)
            pool.free(give)
            for off in give.tolist():
                del held[off]
        else:
            layer, k, n = int(rng.integers(3)), int(rng.integers(geo.num_classes)), int(rng.integers(0, 30))
            held.update((off, k) for off in pool.alloc(layer, k, n).tolist())
        _live_slots_disjoint_and_in_their_class(pool, held)
        fit = pool.new_pages_fit(False)
        for pages, ok in ((fit, True), (fit + 1, False)):
            trial = copy.deepcopy(pool)
            got = [len(trial.alloc(layer, 0, pages * geo.groups_per_page)) for layer in range(geo.num_layers)]
            assert (got == [pages * geo.groups_per_page] * geo.num_layers) == ok, (pages, got)
        assert pool.new_pages_fit() <= fit
    assert pool.chunks_returned > 0


def test_shared_slabs_let_every_layer_use_free_raw_slots() -> None:
    """Four raw slots a chunk, a page = 2 raw groups in each of 2 layers, 3 chunks. Per-layer slabs: each layer's
    chunk holds its groups of 2 pages, and a third page needs a chunk for each layer: 2 pages fit. Shared, a page
    fills one chunk: 3 pages. And a layer's free slots serve another layer: after layer 0's first groups are freed
    in a full pool, layer 1 can take their slots."""
    out = {}
    for shared in (False, True):
        geo = PoolGeometry(num_layers=2, groups_per_page=2, blocks_per_group=2, block_size=512, chunk_bytes=2048 * 4,
                           num_chunks=3, private_chunks=0, shared_slabs=shared)
        assert geo.slots_per_chunk(0) == 4
        pool = ChunkPool(geo)
        out[shared] = pool.new_pages_fit(False)
        first = [pool.alloc(layer, 0, 2) for layer in range(2)]
        pool.alloc(0, 0, 100), pool.alloc(1, 0, 100)  # the pool full of raw groups
        pool.free(first[0])
        assert len(pool.alloc(1, 0, 2)) == (2 if shared else 0)
    assert out == {False: 2, True: 3}


class PerLayerAllocStore(ZipPagedKV):
    """alloc_pages as it was: one ChunkPool.alloc call per layer, also where all layers share one slab owner."""

    def _alloc_pages(self, pids: list[int]) -> None:
        g = self.geo
        n = len(pids) * g.groups_per_page
        taken = [self.alloc.alloc(layer, 0, n) for layer in range(g.num_layers)]
        assert all(len(offs) == n for offs in taken)
        self._starts_host[:, pids] = np.stack(taken).reshape(g.num_layers, len(pids), g.num_kv_heads, 2)
        idx = self._to_device(np.asarray(pids, dtype=np.int64))
        starts = self._to_device(self._starts_host[:, pids])
        self.group_start_all[:, idx] = starts
        self.group_desc_all.index_fill_(1, idx, zb.RAW)
        self._raw_groups(starts, zero=True)
        self.state[pids] = RAW
        self._generation[pids] += 1
        self.counters["pages_allocated"] += len(pids)


@pytest.mark.parametrize("seed", range(3))
def test_shared_slab_page_allocation_in_one_call_equals_one_call_per_layer(seed: int) -> None:
    """With shared slabs, alloc_pages takes all layers' raw slots in one ChunkPool.alloc call (one sort of the open
    chunks instead of one per layer): the same offsets per layer, pool state and tables as per-layer calls, step by
    step, through allocation, compression (raw slots freed all over the pool) and release."""
    geo = ZipGeometry(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, block_size=256)
    chunk = geo.raw_group_bytes * 4
    kw = dict(budget_bytes=geo.num_layers * chunk * 6 + 9 * chunk, chunk_bytes=chunk, private_chunks=2,
              shared_slabs=True)
    new, old = ZipPagedKV(geo, **kw), PerLayerAllocStore(geo, **kw)
    assert new.alloc.geo.num_owners == 1
    allocated = run_store_workload(new, old, seed, max_new=6, check=lambda a, b: assert_same_state(a.alloc, b.alloc))
    assert allocated > 20 and new.alloc.chunks_returned > 0


def test_shared_slab_page_allocation_that_runs_dry_frees_what_it_took() -> None:
    """One call for all layers that gets fewer slots than all layers need: nothing stays taken, MemoryError."""
    geo = ZipGeometry(num_layers=3, num_kv_heads=2, head_dim=64, page_size=16, block_size=256)
    chunk = geo.raw_group_bytes * 4
    st = ZipPagedKV(geo, budget_bytes=5 * chunk, chunk_bytes=chunk, private_chunks=1, shared_slabs=True)
    before = st.alloc.raw_free_slots.copy(), st.alloc.used.copy()
    with pytest.raises(MemoryError, match="ran out"):
        st.alloc_pages(list(range(4)))
    assert np.array_equal(st.alloc.raw_free_slots, before[0]) and np.array_equal(st.alloc.used, before[1])
    assert (st.state == ABSENT).all()
