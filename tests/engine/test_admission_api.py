"""The public admission API restoration uses (no model): look up a chunk's cached pages, admit a restored request
with pages for its whole prompt, start it or hand it back, and output its first token."""
from __future__ import annotations

from kvtide import SamplingParams, SchedulerConfig
from kvtide.engine.block_manager import BlockManager
from kvtide.engine.scheduler import Scheduler
from kvtide.engine.sequence import Sequence, Status

PAGE = 4


def seq(rid: str, n: int, first: int = 1) -> Sequence:
    return Sequence(rid, None, list(range(first, first + n)), SamplingParams(temperature=0, max_tokens=8))


def finished_prefix(sch: Scheduler, n: int) -> tuple[Sequence, list[bytes]]:
    """A request of ``n`` tokens run to its end and released (its full pages stay cached), and their hashes."""
    s = seq("old", n)
    sch.add(s)
    sch.schedule()
    s.num_computed_tokens = s.num_tokens
    sch.bm.commit(s)
    hashes = sch.bm.committed_hashes(s)
    sch.finish(s)
    return s, hashes


def test_cached_pages_finds_a_whole_run_or_nothing():
    sch = Scheduler(SchedulerConfig(max_num_seqs=4), BlockManager(num_pages=8, page_size=PAGE))
    bm = sch.bm
    old, hashes = finished_prefix(sch, 3 * PAGE + 1)
    toks = old.token_ids[:3 * PAGE]
    assert len(hashes) == 3
    pids = bm.cached_pages(hashes, toks)
    assert pids is not None and len(set(pids)) == 3
    assert [bm.hash_of(p) for p in pids] == hashes
    assert bm.cached_pages(hashes, [0] + toks[1:]) is None  # tokens verified, not just hashes
    bm.evict_cached()
    assert bm.cached_pages(hashes, toks) is None and bm.hash_of(pids[0]) is None


def test_admit_restored_takes_pages_for_the_whole_prompt_and_keeps_room():
    sch = Scheduler(SchedulerConfig(max_num_seqs=4), BlockManager(num_pages=6, page_size=PAGE))
    a, b = seq("a", 3 * PAGE + 2, first=100), seq("b", 2 * PAGE, first=200)
    sch.add(a)
    sch.add(b)
    assert sch.waiting_head(1) == [a] and sch.seq_slots_left() == 4
    assert sch.admit_restored(a, [], cached=3 * PAGE)
    assert a.status is Status.RUNNING and len(a.pages) == 4 and a.num_cached_tokens == 3 * PAGE
    assert list(sch.waiting) == [b] and a not in sch.running  # running only once its prompt is computed
    # 2 pages left: b needs 2, plus one of room for the admitted-but-not-running a: refused, nothing changed
    assert not sch.admit_restored(b, [], cached=PAGE, pending=1)
    assert list(sch.waiting) == [b] and b.pages == [] and b.status is Status.WAITING
    sch.run_restored(a)
    assert sch.running == [a] and a.num_computed_tokens == a.num_tokens
    assert len(sch.bm.committed_hashes(a)) == 3  # its full pages joined the prefix cache


def test_requeue_restored_hands_the_request_back_to_plain_prefill():
    sch = Scheduler(SchedulerConfig(max_num_seqs=4), BlockManager(num_pages=6, page_size=PAGE))
    a, b = seq("a", 2 * PAGE + 1), seq("b", PAGE + 1, first=50)
    sch.add(b)
    sch.add(a)
    assert sch.admit_restored(a, [], cached=2 * PAGE)
    free = len(sch.bm.free)
    sch.requeue_restored(a)
    assert list(sch.waiting) == [a, b] and a.pages == [] and a.status is Status.WAITING
    assert a.num_computed_tokens == 0 and len(sch.bm.free) == free + 3
    plan = sch.schedule()  # prefilled as usual, at the head of the queue
    assert [s for s, _ in plan.batch] == [a, b] and plan.batch[0][1] == a.num_tokens
