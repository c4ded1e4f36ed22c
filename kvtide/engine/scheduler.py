"""Continuous batching: each step mixes decodes and prefill chunks under a token budget.

Running sequences go first (one token each when decoding, the next chunk when a long prompt is being prefilled),
then waiting ones are admitted while pages, the token budget and the sequence limit allow. A waiting request is
admitted only if its pages fit with room left for each running sequence to grow by one page; when a running
sequence cannot grow, the newest running sequence is preempted (its pages released, recomputed later — cheap,
since its full pages usually stay in the prefix cache). A running sequence with nothing to compute (async
scheduling: its final token is being sampled by the step in flight) is skipped. Decoding sequences may take their
next page a few steps early (``SchedulerConfig.page_lookahead``) so that a batch in lockstep does not allocate all its
pages in one step.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from ..config import SchedulerConfig
from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class StepPlan:
    batch: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute this step)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.batch)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # admitted by a restoration still computing their prompts: pages held, not in steps, never preempted
        self.restoring: list[Sequence] = []
        # ids of waiting sequences a restoration will take once the one in flight ends: not prefilled meanwhile
        self.held: set[int] = set()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.restoring)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        i = 0
        # Fast path: when every running sequence's next chunk fits, allocate them all at once.
        grow = []
        for seq in self.running:
            if budget <= 0:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            grow.append((seq, n))
            budget -= n
        need = [(seq, seq.num_computed_tokens + n) for seq, n in grow]
        early = self._early(need)
        if (early and self.bm.allocate_all(early)) or self.bm.allocate_all(need):
            plan.batch.extend((seq, n) for seq, n in grow if n)  # n == 0: its last token is still being sampled
            i = len(grow)
        else:
            budget = self.config.max_num_batched_tokens
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 0:  # its last token is being sampled by a launched step (async scheduling): nothing to run
                i += 1
                continue
            while not self.bm.allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            else:
                plan.batch.append((seq, n))
                budget -= n
                i += 1
        w = 0  # index of the first waiting sequence not held
        while self.held and w < len(self.waiting) and id(self.waiting[w]) in self.held:
            w += 1
        while w < len(self.waiting) and budget > 0 \
                and len(self.running) + len(self.restoring) < self.config.max_num_seqs:
            seq = self.waiting[w]
            hits = self.bm.match_prefix(seq)
            computed = len(hits) * self.bm.page_size
            n = min(seq.num_tokens - computed, budget)
            fresh = max(0, -(-(computed + n) // self.bm.page_size) - len(hits))
            if not self.bm.can_admit(hits, fresh, reserve=len(self.running)):
                break
            del self.waiting[w]
            while self.held and w < len(self.waiting) and id(self.waiting[w]) in self.held:
                w += 1
            self.bm.admit(seq, hits)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            ok = self.bm.allocate(seq, seq.num_computed_tokens + n)
            assert ok, "admission check and allocation disagree"
            seq.status = Status.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
            self.running.append(seq)
            plan.batch.append((seq, n))
            budget -= n
        return plan

    def _early(self, need: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]] | None:
        """``need`` with some decoding sequences given their next page ahead of time (SchedulerConfig.page_lookahead),
        or None when none is due. Compressed pool only (a page of the fixed cache costs nothing to take), and only
        from free room: early pages never evict a cached page and never cause a preemption (the plain allocation
        is tried when these do not fit)."""
        ahead = self.config.page_lookahead
        if not ahead or self.bm.pool is None:
            return None
        cap, p = -(-len(need) // ahead), self.bm.page_size
        out, taken = [], 0
        for seq, tokens in need:
            if taken < cap and tokens - seq.num_computed_tokens == 1 and not self.bm.pages_needed(seq, tokens) \
                    and self.bm.pages_needed(seq, tokens + ahead):
                tokens = -(-tokens // p) * p + 1  # exactly one more page
                taken += 1
            out.append((seq, tokens))
        if not taken or self.bm.pool.free_pages(reserve=False) < sum(self.bm.pages_needed(s, t) for s, t in out):
            return None
        return out

    # ---- admission of restored requests (kvtide.engine.restoration computes their prompts outside a step) ----
    def waiting_head(self, n: int) -> list[Sequence]:
        """The first ``n`` waiting sequences, in queue order."""
        return list(itertools.islice(self.waiting, n))

    def seq_slots_left(self) -> int:
        """Sequences that may still start running (``SchedulerConfig.max_num_seqs`` less those running or being
        restored)."""
        return self.config.max_num_seqs - len(self.running) - len(self.restoring)

    def admit_restored(self, seq: Sequence, hits: list[int], cached: int, pending: int = 0) -> bool:
        """Take waiting ``seq`` out of the queue with prefix hits ``hits`` and pages for all its tokens, for a
        restoration to compute them; ``cached``: its tokens found cached (device and store). Room stays for each
        running sequence and the ``pending`` sequences admitted this way and not running yet. False (nothing
        changed) when its pages do not fit. The caller then runs it (:meth:`run_restored`) or hands it back
        (:meth:`requeue_restored`)."""
        fresh = max(0, -(-seq.num_tokens // self.bm.page_size) - len(hits))
        if not self.bm.can_admit(hits, fresh, reserve=len(self.running) + pending):
            return False
        self.waiting.remove(seq)
        self.bm.admit(seq, hits)
        ok = self.bm.allocate(seq, seq.num_tokens)
        assert ok, "admission check and allocation disagree"
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = cached
        seq.status = Status.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.perf_counter()
        self.restoring.append(seq)
        return True

    def run_restored(self, seq: Sequence) -> None:
        """An admitted sequence whose tokens a restoration has all computed: its full pages join the prefix cache
        and it runs (decodes) from the next step on."""
        seq.num_computed_tokens = seq.num_tokens
        self.bm.commit(seq)
        self.restoring.remove(seq)
        self.running.append(seq)

    def requeue_restored(self, seq: Sequence) -> None:
        """Hand an admitted sequence back (its restoration failed): pages released, at the head of the queue, to
        be prefilled as usual."""
        self.restoring.remove(seq)
        self.bm.release(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.release(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished (or aborted) sequence from the queues and release its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.restoring:  # (the restorer's call, once nothing writes its pages any more)
            self.restoring.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.release(seq)
