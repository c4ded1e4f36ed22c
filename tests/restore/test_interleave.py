"""A restoration beside running requests (RestoreConfig.step_fraction): the others keep decoding while it runs in
quanta over several engine steps; its output equals a plain prefill's, the decoders' tokens equal their tokens
without it; aborts, failed loads and a failed restoration leave pages and other requests intact."""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Iterator

import pytest

from kvtide.restore.executor import RestoreRun, Segment, _slice_rows
from tests.restore.restore_helpers import (FailAfter, forced_plan, fresh_store, greedy, mixed_staircase, no_restore,
                                           restore_llm, text_ids, two_turns)

DECODE = 60  # decoder tokens: outlasts a restoration of one quantum a step (30 layers + suffix)


@pytest.fixture(scope="module")
def setup():
    """Two restorable turn-2 prompts with their plain-prefill tokens, a decoder prompt and its tokens, the store."""
    llm = restore_llm()
    store = fresh_store(llm)
    b1, ref1 = two_turns(llm, 9000, first=100, extra=12, out=3)
    b2, ref2 = two_turns(llm, 12000, first=100, extra=9, out=3)
    dec = text_ids(llm, 15000, 40)
    with no_restore(llm):
        dref = llm.generate(dec, greedy(DECODE))[0].token_ids
    return llm, (b1, ref1), (b2, ref2), (dec, dref), OrderedDict(store._data)


@contextlib.contextmanager
def interleaved(llm: Any, snapshot: OrderedDict, fraction: float = 1e-3) -> Iterator[Any]:
    """A store holding exactly the turns' entries, a tiny step budget (one quantum a step) and a mixed plan."""
    r = llm.engine.restorer
    store = fresh_store(llm)
    store._data = OrderedDict(snapshot)
    store._used = sum(len(v) for v in snapshot.values())
    old = r.cfg.step_fraction
    r.cfg.step_fraction = fraction
    try:
        with forced_plan(llm, mixed_staircase):
            yield r
    finally:
        r.cfg.step_fraction = old


def _drive(eng: Any, max_steps: int = 2000, on_step: Any = None) -> tuple[dict[str, list[int]], list[tuple]]:
    """Step until done; tokens per request, and per step (restoration in flight after it, request ids output)."""
    toks: dict[str, list[int]] = {}
    trace = []
    for i in range(max_steps):
        if not eng.has_unfinished():
            break
        outs = eng.step()
        for o in outs:
            toks[o.request_id] = list(o.token_ids)
        trace.append((eng.restorer._flight is not None, {o.request_id for o in outs}))
        if on_step is not None:
            on_step(i)
    assert not eng.has_unfinished()
    return toks, trace


def _start_decoder(eng: Any, dec: list[int]) -> str:
    rid = eng.add_request(dec, greedy(DECODE))
    for _ in range(3):  # prefilled and decoding before the restorable request arrives
        eng.step()
    return rid


def test_decoders_keep_decoding_while_a_restoration_runs(setup):
    llm, (b1, ref1), _, (dec, dref), snap = setup
    eng = llm.engine
    with interleaved(llm, snap) as r:
        n0 = r.stats.restorations
        d = _start_decoder(eng, dec)
        q = eng.add_request(b1, greedy(3))
        toks, trace = _drive(eng)
    assert toks[q] == ref1  # restored in quanta, equal to a plain prefill
    assert toks[d] == dref  # the decoder's tokens are those it makes alone
    assert r.stats.restorations == n0 + 1
    during = [ids for inflight, ids in trace if inflight]
    assert len(during) >= 10  # the restoration spanned many steps ...
    assert sum(d in ids for ids in during) >= len(during) - 1  # ... and the decoder made a token in each
    rec = r.history[-1]
    assert rec.advances > 10 and rec.paused_seconds > 0
    assert not eng.scheduler.restoring and not any(eng.block_manager.ref_count)  # every page released


def test_abort_during_restoration_frees_its_pages(setup):
    llm, (b1, _), (b2, ref2), (dec, dref), snap = setup
    eng = llm.engine
    bm = eng.block_manager
    with interleaved(llm, snap) as r:
        d = _start_decoder(eng, dec)
        q1 = eng.add_request(b1, greedy(3))
        q2 = eng.add_request(b2, greedy(3))
        aborted = []

        def on_step(i: int) -> None:
            if r._flight is not None and i == 5:
                assert {s.request_id for s in r._flight.seqs} == {q1, q2}
                eng.abort(q1)  # one of two: its pages wait for the run's end
                aborted.append(q1)
        toks, trace = _drive(eng, on_step=on_step)
        assert aborted and q1 not in toks and toks[q2] == ref2 and toks[d] == dref

        # the last one of a restoration aborted stops it at once
        d2 = _start_decoder(eng, dec)
        q3 = eng.add_request(b1, greedy(3))
        for _ in range(5):
            eng.step()
        assert r.holds(eng.seqs[q3])
        eng.abort(q3)
        assert r._flight is None and not eng.scheduler.restoring
        toks, _ = _drive(eng)
        assert q3 not in toks and toks[d2] == dref
    assert not eng.has_unfinished()
    assert not any(bm.ref_count)  # the aborted requests' pages too
    assert not eng.scheduler.running and not eng.scheduler.waiting


def test_failed_loads_during_restoration_recompute_that_request(setup):
    llm, (b1, ref1), _, (dec, dref), snap = setup
    eng = llm.engine
    with interleaved(llm, snap) as r:
        inner = r.store
        r.store = FailAfter(inner, ok=20)  # the link dies in the middle of the loads
        try:
            n0 = r.stats.fallbacks
            d = _start_decoder(eng, dec)
            q = eng.add_request(b1, greedy(3))
            toks, _ = _drive(eng)
        finally:
            r.store = inner
    assert toks[q] == ref1 and toks[d] == dref
    assert r.stats.fallbacks == n0 + 1 and r.history[-1].fallback_tokens > 0


def test_a_failed_restoration_requeues_to_plain_prefill(setup, monkeypatch):
    llm, (b1, ref1), _, (dec, dref), snap = setup
    eng = llm.engine
    calls = {"n": 0}
    orig = RestoreRun.advance

    def advance(self, budget):  # noqa: ANN001
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("a bug in the middle of a restoration")
        return orig(self, budget)

    monkeypatch.setattr(RestoreRun, "advance", advance)
    with interleaved(llm, snap) as r:
        e0 = r.stats.errors
        d = _start_decoder(eng, dec)
        q = eng.add_request(b1, greedy(3))
        toks, _ = _drive(eng)
        assert r.stats.errors == e0 + 1 and r._flight is None
    assert toks[q] == ref1 and toks[d] == dref


def test_alone_a_restoration_runs_in_the_step_it_starts(setup):
    """Nothing else running: the blocking restoration of before (one step, one advance)."""
    llm, (b1, ref1), _, _, snap = setup
    eng = llm.engine
    with interleaved(llm, snap) as r:
        q = eng.add_request(b1, greedy(3))
        first = eng.step()
        assert {o.request_id for o in first} == {q} and r._flight is None  # (and its first decode step)
        toks, _ = _drive(eng)
    assert r.history[-1].advances == 1 and r.history[-1].paused_seconds == 0.0
    assert first[0].token_ids == ref1[:1]


@pytest.mark.parametrize("lengths,pieces", [([5], 2), ([3, 4, 1], 3), ([2, 2], 4), ([7, 1], 8)])
def test_slices_cover_the_rows_in_order(lengths: list[int], pieces: int):
    segs, o = [], 0
    for r, n in enumerate(lengths):
        segs.append(Segment(r, 10 * r, 10 * r + n))
    parts = _slice_rows(segs, pieces)
    flat = [(s.request, p) for part in parts for s in part for p in range(s.start, s.end)]
    assert flat == [(s.request, p) for s in segs for p in range(s.start, s.end)]
    sizes = sorted(sum(s.length for s in part) for part in parts)
    assert len(parts) == pieces and sizes[-1] - sizes[0] <= 1


def test_an_advanced_run_in_slices_restores_what_a_blocking_run_does():
    """The executor alone: ``start`` + finite ``advance`` calls (layer calls cut into row slices) give the logits and
    the KV of ``run()``, with more, smaller layer calls."""
    import torch

    from kvtide.engine.restore_port import EnginePort
    from kvtide.engine.sequence import Sequence
    from kvtide.restore.executor import RestoreExecutor, RestoreJob
    from kvtide.store.keys import chunk_keys
    from tests.restore.restore_helpers import CHUNK, prefill, prefix_kv, write_prefix

    llm = restore_llm()
    eng = llm.engine
    r = eng.restorer
    store = fresh_store(llm)
    L = eng.model.args.num_layers
    ids = text_ids(llm, 4000, 96 + 12)
    n = 96
    js = mixed_staircase(n, L)
    with torch.inference_mode():
        base = prefill(eng, ids[:n])
        write_prefix(r, base, ids, n)
        eng.block_manager.release(base)
        keys = chunk_keys(ids[:n], r.keyspace)
        got = {}
        for mode in ("run", "advance"):
            seq = Sequence(mode, None, list(ids), greedy(1))
            assert eng.block_manager.allocate(seq, len(ids))
            port = EnginePort(eng.runner, [seq])
            calls = []
            orig = port.run_layer
            port.run_layer = lambda layer, h, segs: (calls.append(sum(s.length for s in segs)), orig(layer, h, segs))[1]
            ex = RestoreExecutor(port, store, CHUNK)
            job = RestoreJob(ids, 0, n, len(ids), keys, js)
            if mode == "run":
                res = ex.run([job])
            else:
                run = ex.start([job], quantum_cost=lambda segs: float(sum(s.length for s in segs)))
                steps = 0
                while not run.advance(40.0):  # 40 rows a quantum: the 96-row layers in 3 slices
                    steps += 1
                    assert steps < 10_000
                res = run.result()
                assert steps > L and res.advances == steps + 1
            got[mode] = (res.logits, prefix_kv(eng, seq, len(ids) // 16 * 16), calls)
            assert res.failures == []
            eng.block_manager.release(seq)
    (l0, kv0, c0), (l1, kv1, c1) = got["run"], got["advance"]
    assert max(c1) <= 40 < max(c0) and sum(c1) == sum(c0)  # the same rows, cut into slices
    assert torch.allclose(l0, l1, atol=1e-3, rtol=1e-3) and l0.argmax(-1).tolist() == l1.argmax(-1).tolist()
    assert all(torch.allclose(a, b, atol=1e-4, rtol=1e-3) for a, b in zip(kv0, kv1))


def test_a_restorable_request_arriving_meanwhile_waits_for_the_next_restoration(setup):
    llm, (b1, ref1), (b2, ref2), (dec, dref), snap = setup
    eng = llm.engine
    with interleaved(llm, snap) as r:
        n0, q0 = r.stats.restorations, r.stats.requests
        d = _start_decoder(eng, dec)
        q1 = eng.add_request(b1, greedy(3))
        eng.step()
        assert r.holds(eng.seqs[q1])
        q2 = eng.add_request(b2, greedy(3))  # its prefix is in the store too: held back, not prefilled
        eng.step()
        assert id(eng.seqs[q2]) in eng.scheduler.held and eng.seqs[q2].num_computed_tokens == 0
        toks, _ = _drive(eng)
    assert toks[q1] == ref1 and toks[q2] == ref2 and toks[d] == dref
    assert r.stats.restorations == n0 + 2 and r.stats.requests == q0 + 2


@pytest.mark.parametrize("bad", [0, -0.5, float("nan"), float("inf"), True, "0.5", 101])
def test_step_fraction_fails_fast(bad: Any):
    from kvtide.config import RestoreConfig

    with pytest.raises(ValueError, match="step_fraction"):
        RestoreConfig(step_fraction=bad)
    assert RestoreConfig(step_fraction=None).step_fraction is None and RestoreConfig().step_fraction is None
