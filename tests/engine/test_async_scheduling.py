"""Async scheduling (step N+1 launched before step N's tokens are read) gives exactly the outputs of the
synchronous engine: greedy and seeded sampling, stop strings and stop tokens that end a request while its next
step is in flight, preemption and chunked prefill in a small cache, the compressed pool, aborts."""
from __future__ import annotations

import pytest
import torch

from kvtide import LLM, CacheConfig, EngineConfig, SamplingParams, SchedulerConfig
from kvtide.config import RestoreConfig
from kvtide.engine.sequence import PENDING
from tests.conftest import engine_llm

SMOL = "smollm2-135m"
PROMPTS = [
    "Async scheduling test: the lighthouse keeper wrote in his log that",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Async scheduling test: a recipe for bread starts with",
    "Async scheduling test: the three largest moons of Jupiter are",
    "Q: What is 12 times 12?\nA:",
]


def params_for(ref_texts: list[str] | None = None) -> list[SamplingParams]:
    """One request of each kind: plain greedy (may stop at EOS), ignore_eos, seeded sampling, short max_tokens,
    and (given a reference run) a stop string inside request 0's continuation."""
    ps = [SamplingParams(temperature=0, max_tokens=24),
          SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20, seed=7, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=18, ignore_eos=True)]
    if ref_texts is not None:  # stop in the middle of request 4's greedy text: its next step is then in flight
        text = ref_texts[4]
        ps[4] = SamplingParams(temperature=0, max_tokens=18, ignore_eos=True, stop=[text[len(text) // 2:][:3]])
    return ps


def run(llm, prompts, params):
    outs = llm.generate(prompts, params)
    return [(o.token_ids, o.text, o.finish_reason) for o in outs]


def engines(**kw):
    return (engine_llm(SMOL, async_scheduling=False, **kw), engine_llm(SMOL, async_scheduling=True, **kw))


@pytest.mark.parametrize("cache", [dict(), dict(cache=CacheConfig(compress=True, num_pages=96))],
                         ids=["dense", "zip"])
def test_same_outputs_as_the_synchronous_engine(cache):
    sync, asy = engines(**cache)
    assert not sync.engine.async_scheduling and asy.engine.async_scheduling
    ref = run(sync, PROMPTS, params_for())
    params = params_for([t for _, t, _ in ref])
    want = run(sync, PROMPTS, params)
    assert want[4][2] == "stop", "the stop string should end request 4 early"
    got = run(asy, PROMPTS, params)
    assert got == want
    for llm in (sync, asy):
        bm = llm.engine.block_manager
        assert all(c == 0 for c in bm.ref_count), "finished requests must release every page"
        assert not llm.engine.has_unfinished()


def test_stop_token_while_the_next_step_is_in_flight():
    sync, asy = engines()
    prompt = PROMPTS[0]
    free = sync.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    stop_tok = free[5]
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_tok])
    want = sync.generate(prompt, p)[0]
    got = asy.generate(prompt, p)[0]
    assert want.finish_reason == got.finish_reason == "stop"
    assert got.token_ids == want.token_ids == free[: free.index(stop_tok) + 1]
    assert PENDING not in got.token_ids


def test_outputs_arrive_one_step_later_and_stream_the_same_text():
    sync, asy = engines()
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eng = asy.engine
    rid = eng.add_request("Async scheduling test: stream me", p)
    assert eng.step() == []  # the prefill is launched; its token is read by the next step
    assert eng._pending is not None
    first = eng.step()
    assert [o.request_id for o in first] == [rid] and len(first[0].token_ids) == 1
    while eng.has_unfinished():
        eng.step()
    want = "".join(o.new_text for o in sync.stream("Async scheduling test: stream me", p))
    assert "".join(o.new_text for o in asy.stream("Async scheduling test: stream me", p)) == want


def test_preemption_and_chunked_prefill_in_a_small_cache():
    kw = dict(cache=CacheConfig(num_pages=12), scheduler=SchedulerConfig(max_num_batched_tokens=32))
    sync, asy = engines(**kw)
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)] * len(PROMPTS)
    want = run(sync, PROMPTS, params)
    got = run(asy, PROMPTS, params)
    assert got == want
    assert asy.engine.scheduler.num_preemptions > 0, "the cache should be too small for every request at once"


def test_abort_while_a_step_is_in_flight():
    sync, asy = engines()
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = sync.generate(PROMPTS[1], p)[0].token_ids
    eng = asy.engine
    keep = eng.add_request(PROMPTS[1], p)
    drop = eng.add_request(PROMPTS[0], p)
    eng.step()
    eng.step()
    eng.abort(drop)
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id != drop, "an aborted request must produce no more output"
            done[o.request_id] = o
    assert done[keep].token_ids == want
    assert all(c == 0 for c in eng.block_manager.ref_count)


def test_config():
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling=True, restore=RestoreConfig())
    assert EngineConfig(device="cpu").async_scheduling_on is False  # auto: off on the CPU
    assert EngineConfig(device="cpu", async_scheduling=True).async_scheduling_on is True


def test_from_env(monkeypatch):
    monkeypatch.setenv("KVTIDE_ASYNC_SCHEDULING", "1")
    assert EngineConfig.from_env(device="cpu").async_scheduling is True
    monkeypatch.setenv("KVTIDE_ASYNC_SCHEDULING", "auto")
    assert EngineConfig.from_env(device="cpu").async_scheduling is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compress", [False, True])
def test_cuda_async_steps_give_the_synchronous_tokens(compress: bool) -> None:
    """On CUDA (random tiny model at the zip kernel's shape, CUDA graphs; FlashInfer or the CUDA zip kernel): a
    batch of prompts of different lengths decoding in lockstep across page boundaries, and a request ended by a
    stop token while its next step is in flight, give the synchronous engine's tokens. Batches are kept the same
    in both modes (a different batch size may round a GEMM differently on the GPU)."""
    prompts = [[(7 * i + 3 * j) % 997 + 1 for j in range(5 + 13 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = {}
    for mode in (False, True):
        llm = LLM("random:tiny-d128", progress=False, device="cuda", dtype="float32", seed=0, cuda_graphs=True,
                  async_scheduling=mode, cache=CacheConfig(compress=compress, num_pages=96))
        assert llm.engine.async_scheduling is mode
        first = [r.token_ids for r in llm.generate(prompts, params)]
        stop = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[first[0][9]])
        out[mode] = (first, llm.generate(prompts[0], stop)[0].token_ids)
    assert out[True] == out[False]
    assert out[True][1] == out[True][0][0][:out[True][0][0].index(out[True][0][0][9]) + 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compress", [False, True])
def test_cuda_async_steps_in_a_small_cache_finish_every_request(compress: bool) -> None:
    """Preemption, re-admission and chunked prefill with steps in flight: every request gets all its tokens, every
    page comes back. (Token equality with the synchronous engine is not asked here: pages freed a step later change
    which batches run, and a batch of another size may round differently on the GPU.)"""
    prompts = [[(11 * i + 5 * j) % 997 + 1 for j in range(5 + 13 * i)] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=40 + 6 * i, ignore_eos=True) for i in range(6)]
    llm = LLM("random:tiny-d128", progress=False, device="cuda", dtype="float32", seed=0, cuda_graphs=True,
              async_scheduling=True, cache=CacheConfig(compress=compress, num_pages=24),
              scheduler=SchedulerConfig(max_num_batched_tokens=48))
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert all(o.finish_reason == "length" and PENDING not in o.token_ids for o in outs)
    assert llm.engine.scheduler.num_preemptions > 0, "the cache should be too small for every request at once"
    assert all(c == 0 for c in llm.engine.block_manager.ref_count)
