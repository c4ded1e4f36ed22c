"""Greedy tokens of the kvtide engine equal transformers' own model on the same weights (fp32, CPU)."""
from __future__ import annotations

import pytest
import torch

from kvtide import CacheConfig, SamplingParams, SchedulerConfig
from tests.conftest import MODELS, engine_llm, hf_reference

PROMPTS = [
    "The capital of France is",
    "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three colours:",
]
MAX_NEW = 12


def hf_greedy(name: str, prompt_ids: list[int], n: int) -> list[int]:
    model, _ = hf_reference(name)
    x = torch.tensor([prompt_ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def fp32_llm(name: str, **kw):
    return engine_llm(name, cache=CacheConfig(kv_dtype="float32", **kw.pop("cache_kw", {})), **kw)


@pytest.mark.parametrize("name", MODELS)
def test_batched_greedy_equals_transformers(name):
    llm = fp32_llm(name)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        ref = hf_greedy(name, ids, MAX_NEW)
        assert out.token_ids == ref[: len(out.token_ids)], prompt
        assert len(out.token_ids) == len(ref)  # both stop at the same EOS or at max_tokens


@pytest.mark.parametrize("name", MODELS)
def test_prefix_cache_hit_gives_same_tokens(name):
    llm = fp32_llm(name)
    base = "Here is a long shared preamble that several requests reuse word for word. " * 3
    first = llm.generate([base + "Question one:"], SamplingParams(temperature=0, max_tokens=4))[0]
    second = llm.generate([base + "Question two, a little different:"], SamplingParams(temperature=0, max_tokens=MAX_NEW))[0]
    assert second.num_cached_tokens >= 16, "the shared preamble should be served from cached pages"
    assert first.num_cached_tokens < second.num_cached_tokens
    assert second.token_ids == hf_greedy(name, second.prompt_token_ids, MAX_NEW)[: len(second.token_ids)]


def test_chunked_prefill_and_preemption_keep_tokens():
    """A tiny cache (forcing preemption) and a tiny token budget (forcing chunked prefill) change nothing."""
    name = MODELS[0]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in fp32_llm(name).generate(PROMPTS, params)]
    small = engine_llm(name, cache=CacheConfig(kv_dtype="float32", num_pages=6, enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_num_batched_tokens=7))
    outs = small.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == ref
    assert small.engine.scheduler.num_preemptions > 0, "6 pages for 4 requests of 3-4 pages each must preempt"
