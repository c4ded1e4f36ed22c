"""Engine behaviour that needs no reference model: bad input, streaming, stop strings, seeds, page accounting."""
from __future__ import annotations

import pytest

from kvtide import CacheConfig, EngineConfig, SamplingParams, SchedulerConfig
from kvtide.models.registry import ModelNotFoundError
from tests.conftest import engine_llm

GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def llm():
    return engine_llm("smollm2-135m")


def test_bad_inputs_raise_clear_errors_and_engine_keeps_serving(llm):
    eng = llm.engine
    rid = eng.add_request("A running request that must survive its neighbours' errors:", GREEDY)
    eng.step()
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.add_request("", GREEDY)
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.add_request([], GREEDY)
    with pytest.raises(ValueError, match="context window"):
        eng.add_request([42] * (eng.max_seq_len + 5), GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request([10**9], GREEDY)
    with pytest.raises(TypeError, match="prompt must be"):
        eng.add_request(3.14, GREEDY)  # type: ignore[arg-type]
    finished = None
    while finished is None:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                finished = out
    assert finished.token_ids and finished.finish_reason in ("stop", "length")
    # and the facade still works afterwards
    assert llm.generate("Hello", GREEDY)[0].token_ids


def test_generate_names_the_bad_prompt_and_runs_nothing(llm):
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate(["fine", ""], GREEDY)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(top_k=-2), "top_k"), (dict(stop=[""]), "stop"),
    (dict(seed=-1), "seed"), (dict(temperature=float("nan")), "temperature"),
])
def test_invalid_sampling_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(device="tpu"), "device"), (dict(attention_backend="magic"), "attention_backend"),
    (dict(dtype="int3"), "dtype"), (dict(model=""), "model"),
])
def test_invalid_engine_config(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(page_size=12), "page_size"), (dict(num_pages=0), "num_pages"), (dict(kv_dtype="int7"), "dtype"),
    (dict(num_pages=4, kv_cache_bytes=10), "not both"), (dict(compress_spread_steps=0), "compress_spread_steps"),
    (dict(compress_spread_steps=2.5), "compress_spread_steps"),
])
def test_invalid_cache_config(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CacheConfig(**kwargs)


def test_scheduler_config_validation():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)


def test_unknown_model():
    from kvtide import LLM

    with pytest.raises(ModelNotFoundError, match="unknown model 'no-such-model'"):
        LLM("no-such-model", progress=False)


def test_stream_concatenates_to_final_text(llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    chunks, tokens, last = [], [], None
    for out in llm.stream("Write a short sentence about the sea:", params):
        chunks.append(out.new_text)
        tokens.extend(out.new_token_ids)
        last = out
    assert last is not None and last.finished
    assert "".join(chunks) == last.text
    assert tokens == last.token_ids == llm.generate("Write a short sentence about the sea:", params)[0].token_ids


def test_stop_string_truncates_and_is_never_streamed(llm):
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].text
    assert "9" in full, full  # the model counts on; pick a stop string inside its continuation
    stop = full[full.index("9"):full.index("9") + 2]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    out = llm.generate(prompt, params)[0]
    assert out.finish_reason == "stop" and out.text == full[: full.index(stop)]
    streamed = "".join(o.new_text for o in llm.stream(prompt, params))
    assert streamed == out.text


def test_seeded_sampling_is_reproducible_and_varies_with_seed(llm):
    p = "Tell me a story about a dragon"
    a = [llm.generate(p, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=s))[0].token_ids for s in (1, 1, 2)]
    assert a[0] == a[1]
    assert a[0] != a[2]


def test_tiny_top_p_and_top_k_equal_greedy(llm):
    p = "The weather today is"
    g = llm.generate(p, GREEDY)[0].token_ids
    assert llm.generate(p, SamplingParams(temperature=0.8, top_p=1e-6, max_tokens=10, seed=3))[0].token_ids == g
    assert llm.generate(p, SamplingParams(temperature=0.8, top_k=1, max_tokens=10, seed=3))[0].token_ids == g


def test_max_tokens_and_pages_are_released(llm):
    bm = llm.engine.block_manager
    out = llm.generate(["one", "two two", "three three three"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert all(len(o.token_ids) == 5 and o.finish_reason == "length" for o in out)
    assert all(c == 0 for c in bm.ref_count), "finished requests must release every page"
    assert bm.num_free_pages == bm.num_pages


def test_chat_template_and_multi_turn_reuse(llm):
    msgs = [{"role": "user", "content": "Name a fruit."}]
    first = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=8))
    msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And a vegetable?"}]
    second = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=8))
    assert second.num_cached_tokens >= 32, "turn 2 should reuse turn 1's pages"
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"text": "no role"}])
