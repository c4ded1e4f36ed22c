"""Pages taken ahead (SchedulerConfig.page_lookahead): a batch decoding in lockstep spreads its page allocations
over the steps before the page boundary instead of making them all in one step, and never preempts for it."""
from __future__ import annotations

import pytest

from kvtide import SamplingParams, SchedulerConfig
from kvtide.cache.zip_pages import ZipGeometry, ZipPagedKV
from kvtide.engine.block_manager import BlockManager
from kvtide.engine.scheduler import Scheduler
from kvtide.engine.sequence import Sequence

PAGE = 16


GEO = ZipGeometry(num_layers=1, num_kv_heads=1, head_dim=8, page_size=PAGE, block_size=32)


def lockstep(n_seqs: int, lookahead: int, num_pages: int, steps: int = 40, cached: int = 0) -> tuple[list[int], Scheduler]:
    """Pages allocated by each decode step of `n_seqs` sequences with 20-token prompts over a compressed pool of
    `num_pages` raw pages (no model: each step's tokens are booked as the engine books them); `cached`: that many
    of the pool's pages first held by a finished request's cached prefix."""
    store = ZipPagedKV(GEO, budget_bytes=num_pages * GEO.raw_page_bytes)
    bm = BlockManager(0, PAGE, enable_prefix_caching=True, pool=store)
    sch = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096, page_lookahead=lookahead), bm)
    seqs = [Sequence(f"r{i}", None, [i + 1] * 20, SamplingParams(temperature=0, max_tokens=1000)) for i in range(n_seqs)]
    if cached:
        old = Sequence("old", None, list(range(1, cached * PAGE + 2)), SamplingParams(temperature=0, max_tokens=1))
        sch.add(old)
        sch.schedule()
        old.num_computed_tokens = old.num_tokens
        bm.commit(old)
        sch.finish(old)
        assert len(bm.free) == cached
    for s in seqs:
        sch.add(s)
    per_step = []
    for step in range(steps):
        before = sum(len(s.pages) for s in seqs)
        plan = sch.schedule()
        for seq, n in plan.batch:
            seq.num_computed_tokens += n
            seq.output_token_ids.append(7)
        if step:  # the first step is the prefill
            per_step.append(sum(len(s.pages) for s in seqs) - before)
    return per_step, sch


@pytest.mark.parametrize("n_seqs", [5, 24, 65])
def test_lockstep_allocations_are_spread_over_the_lookahead(n_seqs):
    plain, _ = lockstep(n_seqs, 0, num_pages=4096)
    spread, sch = lockstep(n_seqs, 8, num_pages=4096)
    assert max(plain) == n_seqs  # every sequence crosses a page boundary in the same step
    assert max(spread) <= -(-n_seqs // 8)
    assert sum(spread) >= sum(plain), "every page a sequence needs is still taken"
    assert sch.num_preemptions == 0


def test_early_pages_only_from_free_room():
    """A full pool with a cached prefix in it: early pages would have to evict cached pages, so they are not taken
    early; the run evicts and preempts no more than without lookahead."""
    n = 6
    runs = {ahead: lockstep(n, ahead, num_pages=3 * n + 6, steps=28, cached=4)[1] for ahead in (0, 8)}
    assert runs[8].bm.stats["evictions"] <= runs[0].bm.stats["evictions"]
    assert runs[8].num_preemptions <= runs[0].num_preemptions
    assert len(runs[8].running) == len(runs[0].running)


def test_fixed_cache_takes_no_page_early():
    bm = BlockManager(64, PAGE, enable_prefix_caching=False)
    sch = Scheduler(SchedulerConfig(page_lookahead=8), bm)
    seq = Sequence("r", None, [1] * 12, SamplingParams(temperature=0, max_tokens=100))
    sch.add(seq)
    sch.schedule()
    seq.num_computed_tokens = 12
    seq.output_token_ids.append(7)
    sch.schedule()
    assert len(seq.pages) == 1


def test_config_validation():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="page_lookahead"):
            SchedulerConfig(page_lookahead=bad)
