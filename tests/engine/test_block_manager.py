"""Page bookkeeping and the prefix cache, without a model."""
from __future__ import annotations

from kvtide.engine.block_manager import BlockManager
from kvtide.engine.sampling_params import SamplingParams
from kvtide.engine.sequence import Sequence


def seq(rid: str, ids: list[int]) -> Sequence:
    return Sequence(rid, None, ids, SamplingParams())


def run_to_end(bm: BlockManager, s: Sequence) -> None:
    assert bm.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.commit(s)


def test_prefix_hit_reuses_pages_and_keeps_one_token_to_compute():
    bm = BlockManager(num_pages=16, page_size=4)
    a = seq("a", list(range(12)))
    bm.admit(a, bm.match_prefix(a))
    run_to_end(bm, a)
    bm.release(a)
    b = seq("b", list(range(12)))  # identical prompt: only 2 of 3 full pages may hit (last token is recomputed)
    hits = bm.match_prefix(b)
    assert len(hits) == 2
    c = seq("c", list(range(8)) + [99, 98, 97, 96, 95])
    assert bm.match_prefix(c) == hits[:2]


def test_hit_is_verified_against_page_tokens():
    bm = BlockManager(num_pages=8, page_size=4)
    a = seq("a", list(range(9)))
    bm.admit(a, [])
    run_to_end(bm, a)
    bm.release(a)
    h = next(iter(bm.hash_to_page))
    pid = bm.hash_to_page[h]
    bm.page_tokens[pid] = (7, 7, 7, 7)  # simulate a hash collision / overwritten page
    assert bm.match_prefix(seq("b", list(range(9)))) == []


def test_eviction_takes_least_recent_and_forgets_hash():
    bm = BlockManager(num_pages=3, page_size=2)
    a = seq("a", [1, 2, 3, 4, 5])
    bm.admit(a, [])
    run_to_end(bm, a)
    bm.release(a)
    assert len(bm.hash_to_page) == 2
    b = seq("b", [9, 9, 9, 9, 9])
    bm.admit(b, bm.match_prefix(b))
    assert bm.allocate(b, 5)  # needs all 3 pages: both cached pages are evicted
    assert bm.hash_to_page == {}
    assert not bm.allocate(seq("c", [1]), 1) or False


def test_allocate_fails_cleanly_when_full():
    bm = BlockManager(num_pages=2, page_size=2)
    a = seq("a", [1, 2, 3, 4, 5])
    assert not bm.allocate(a, 5)
    assert a.pages == [] and bm.num_free_pages == 2


class CountingPool:
    """A CompressedPagePool that records its calls: allocate_all must reach it once per step, not once per sequence."""

    def __init__(self, pages: int):
        self.left, self.alloc_calls, self.num_page_ids = pages, [], 8

    def free_pages(self, reserve: bool = True) -> int:
        return self.left

    def alloc_pages(self, pids: list[int]) -> None:
        assert len(pids) <= self.left
        self.left -= len(pids)
        self.alloc_calls.append(list(pids))

    def release_pages(self, pids: list[int]) -> None:
        self.left += len(pids)


def test_allocate_all_grows_every_sequence_in_one_store_call_or_changes_nothing():
    store = CountingPool(pages=5)
    bm = BlockManager(num_pages=8, page_size=2, pool=store)
    seqs = [seq(str(i), [1, 2, 3]) for i in range(3)]
    assert not bm.allocate_all([(s, 3) for s in seqs])  # 2 pages each: 6 > 5
    assert store.alloc_calls == [] and all(s.pages == [] for s in seqs) and store.left == 5
    assert bm.allocate_all([(s, 3) for s in seqs[:2]])
    assert store.alloc_calls == [[0, 1, 2, 3]]
    assert [s.pages for s in seqs[:2]] == [[0, 1], [2, 3]] and all(bm.ref_count[p] == 1 for p in range(4))
    assert bm.allocate_all([(s, 3) for s in seqs[:2]]) and len(store.alloc_calls) == 1  # nothing new needed


def test_sequence_tokens_slices_prompt_and_output_as_token_ids_does():
    s = seq("a", [1, 2, 3, 4])
    s.output_token_ids = [5, 6, 7]
    for start in range(8):
        for stop in range(start, 8):
            assert s.tokens(start, stop) == s.token_ids[start:stop]
