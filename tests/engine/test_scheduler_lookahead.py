"""Pages taken ahead (SchedulerConfig.page_lookahead): a batch decoding in lockstep spreads its page allocations
over the steps before the page boundary instead of making them all in one step, and never preempts for it."""
from __future__ import annotations

import pytest

from kvtide import SamplingParams, SchedulerConfig
from kvtide.engine.block_manager import BlockManager
from kvtide.engine.scheduler import Scheduler
from kvtide.engine.sequence import Sequence

PAGE = 16


def lockstep(n_seqs: int, lookahead: int, num_pages: int, steps: int = 40) -> tuple[list[int], Scheduler]:
    """Pages allocated by each decode step of `n_seqs` sequences with 20-token prompts (no model: each step's
    tokens are booked as the engine books them)."""
    bm = BlockManager(num_pages, PAGE, enable_prefix_caching=False)
    sch = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096, page_lookahead=lookahead), bm)
    seqs = [Sequence(f"r{i}", None, [i + 1] * 20, SamplingParams(temperature=0, max_tokens=1000)) for i in range(n_seqs)]
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


def test_lookahead_never_preempts_when_the_plain_allocation_fits():
    """A cache with room for exactly the pages the batch needs: early pages do not fit, the plain ones do."""
    n = 6
    # 28 steps: 20 + 27 tokens, 3 pages each; from token 41 on the 4th page is due early but does not fit
    _, sch = lockstep(n, 8, num_pages=3 * n, steps=28)
    assert sch.num_preemptions == 0
    assert [len(s.pages) for s in sch.running] == [3] * n


def test_config_validation():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="page_lookahead"):
            SchedulerConfig(page_lookahead=bad)
