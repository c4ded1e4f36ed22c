"""RequestOutput.queue_time: arrival to the first step that took the request in, never more than its TTFT."""
from __future__ import annotations

from kvtide import SamplingParams
from kvtide.engine.llm import LLM


def test_a_request_behind_a_full_batch_waits_for_it():
    llm = LLM("smollm2-135m", device="cpu", scheduler={"max_num_seqs": 1}, cache={"num_pages": 64}, progress=False)
    first, second = llm.generate(["Once upon a time", "The capital of France is"],
                                 SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for out in (first, second):
        assert out.queue_time is not None and 0 <= out.queue_time <= out.ttft <= out.latency
    assert first.queue_time < 0.5 * first.latency  # taken in by the first step
    assert second.queue_time >= 0.9 * (first.latency - first.queue_time) - 0.05  # waited for the first to finish
