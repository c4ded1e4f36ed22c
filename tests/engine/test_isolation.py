"""One request never hurts another: poison sampling values, NaN logits, a failing stop check or step."""
from __future__ import annotations

import pytest
import torch

from kvtide import SamplingParams
from kvtide.engine.loop import RequestError
from tests.conftest import engine_llm

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# clear greedy margins: other batch shapes cannot flip their tokens (see test_loop.py)
PROMPTS = ["The capital of France is", "def f(x):", "SELECT * FROM"]


@pytest.fixture(scope="module")
def llm():
    return engine_llm("smollm2-135m")


@pytest.fixture(scope="module")
def reference(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _idle(llm) -> None:
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished() and not llm.engine.seqs
    assert all(c == 0 for c in bm.ref_count), "every page must be released"


@pytest.mark.parametrize("temperature", [1e-300, 1e-9, 5e-324])
def test_tiny_temperature_is_greedy_and_neighbours_unchanged(llm, reference, temperature):
    poison = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, seed=1)
    outs = llm.generate(PROMPTS + ["Poison prompt"], [GREEDY] * len(PROMPTS) + [poison])
    assert [o.token_ids for o in outs[:-1]] == reference
    assert outs[-1].error is None and outs[-1].token_ids == llm.generate("Poison prompt", GREEDY)[0].token_ids
    _idle(llm)


def test_sampling_values_that_cannot_be_honoured_are_rejected():
    for bad in (float("inf"), -1e-9, True):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)


def _nan_rows(monkeypatch, llm, row_of_call: dict[int, int]):
    """Make the model's logits NaN in row ``row_of_call[i]`` of its i-th call (counted from now)."""
    model = llm.engine.runner.model
    real = model.forward
    calls = [0]

    def forward(*args, **kw):
        logits = real(*args, **kw)
        row = row_of_call.get(calls[0])
        calls[0] += 1
        if row is not None and row < logits.shape[0]:
            logits = logits.clone()
            logits[row] = float("nan")
        return logits

    monkeypatch.setattr(model, "forward", forward)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=4,
                                                             ignore_eos=True)])
def test_nan_logits_fail_only_their_request(llm, reference, monkeypatch, params):
    # the poisoned request is first in the batch; its prefill (the first call) yields NaN for row 0, and later
    # calls NaN a row that no longer exists for it, so every other request decodes untouched
    _nan_rows(monkeypatch, llm, {0: 0})
    outs = llm.generate(["Poisoned prompt here"] + PROMPTS, [params] + [GREEDY] * len(PROMPTS))
    assert outs[0].finish_reason == "error" and "non-finite" in outs[0].error
    assert [o.token_ids for o in outs[1:]] == reference
    assert all(o.error is None for o in outs[1:])
    monkeypatch.undo()
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == reference[0]
    _idle(llm)


def test_nan_mid_decode_keeps_tokens_before_it(llm, reference, monkeypatch):
    _nan_rows(monkeypatch, llm, {3: 0})  # prefill, then two decode steps fine, NaN in the third decode step
    outs = llm.generate(PROMPTS, GREEDY)
    assert outs[0].finish_reason == "error" and outs[0].token_ids == reference[0][:3]
    assert [o.token_ids for o in outs[1:]] == reference[1:]
    _idle(llm)


def test_failing_output_processing_fails_only_that_request(llm, reference, monkeypatch):
    eng = llm.engine
    real = eng.make_sequence

    def make(prompt, params=None, request_id=None):
        seq = real(prompt, params, request_id)
        if prompt == "Broken detokenizer":
            def boom(token):
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "test")
            seq.detok.step = boom
        return seq

    monkeypatch.setattr(eng, "make_sequence", make)
    outs = llm.generate(PROMPTS + ["Broken detokenizer"], GREEDY)
    assert outs[-1].finish_reason == "error" and "UnicodeDecodeError" in outs[-1].error
    assert [o.token_ids for o in outs[:-1]] == reference
    _idle(llm)


def test_failed_step_ends_its_requests_and_engine_goes_on(llm, reference, monkeypatch):
    runner = llm.engine.runner
    real = runner.launch
    calls = [0]

    def launch(*a, **kw):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected device failure")
        return real(*a, **kw)

    monkeypatch.setattr(runner, "launch", launch)
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(o.finish_reason == "error" and "injected device failure" in o.error for o in outs)
    assert llm.engine.stats.step_errors >= 1
    _idle(llm)
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_stream_of_a_failed_request_raises_after_its_tokens(llm, reference, monkeypatch):
    _nan_rows(monkeypatch, llm, {2: 0})
    got = []
    with pytest.raises(RequestError, match="non-finite") as info:
        for out in llm.stream(PROMPTS[0], GREEDY):
            got += out.new_token_ids
    assert got == reference[0][:2] == info.value.output.token_ids
    _idle(llm)


def test_restored_request_with_nan_logits(monkeypatch):
    """A restoration samples its requests' first tokens itself: a NaN there fails that request only."""
    from kvtide import SamplingParams as SP
    from kvtide.config import RestoreConfig
    from kvtide.engine import restoration

    llm = engine_llm("smollm2-135m", restore=RestoreConfig(store="memory", chunk_tokens=32))
    prompt = "A long shared prefix about kv caches and restoration. " * 8
    params = SP(temperature=0, max_tokens=4, ignore_eos=True)
    ref = llm.generate(prompt + "One", params)[0].token_ids
    llm.engine.block_manager.evict_cached()  # the device cache forgets it; the store still has the chunks
    real = restoration.sample

    def nan_sample(logits, ps, gens):
        return real(torch.full_like(logits, float("nan")), ps, gens)

    monkeypatch.setattr(restoration, "sample", nan_sample)
    out = llm.generate(prompt + "One", params)[0]
    assert llm.engine.restorer.stats.restorations >= 1, "the request should have been restored"
    assert out.finish_reason == "error" and "non-finite" in out.error
    monkeypatch.undo()
    llm.engine.block_manager.evict_cached()
    assert llm.generate(prompt + "One", params)[0].token_ids == ref
