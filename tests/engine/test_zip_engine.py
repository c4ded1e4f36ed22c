"""The engine with compress=True: same greedy tokens as the fixed cache, pool bytes equal to the KV written,
admission by the pool's capacity with preemption instead of crashes, capacity that grows with compression."""
from __future__ import annotations

import pytest
import torch

from kvtide import CacheConfig, SamplingParams, SchedulerConfig
from kvtide.cache.zip_pages import COMPRESSED, ZipGeometry, ZipPagedKV
from tests.conftest import engine_llm

SMOL = "smollm2-135m"
QWEN = "qwen2.5-coder-0.5b"
# Openings no other test uses, so the shared fixed-cache engine has no prefix hits for them.
PROMPTS = [
    "Zebras in the savanna gather near the water hole at dusk because",
    "import heapq\n\ndef k_smallest(values, k):\n    \"\"\"Return the k smallest values in order.\"\"\"\n",
    "Quarterly report, section two: the warehouse in Lyon shipped",
    "Yesterday's weather in Oslo was",
]
PREAMBLE = "Zoning notes shared by every question below, repeated so that it spans whole pages. " * 2
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def zip_llm(**cache_kw):
    return engine_llm(SMOL, cache=CacheConfig(compress=True, **cache_kw))


@pytest.fixture(scope="module")
def runs():
    """The same requests, in the same order, on the fixed cache and on the compressed one."""
    out = {}
    for name, llm in (("dense", engine_llm(SMOL)), ("zip", zip_llm(num_pages=96)),
                      ("zip_mma", zip_llm(num_pages=96, value_order="mma"))):  # the CUDA kernel's value order
        batch = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        first = llm.generate(PREAMBLE + "Question one:", GREEDY)[0]
        second = llm.generate(PREAMBLE + "Question two, a little different:", GREEDY)[0]
        out[name] = (llm, batch, first, second)
    return out


@pytest.mark.parametrize("kind", ["zip", "zip_mma"])
def test_greedy_tokens_equal_with_and_without_compression(runs, kind):
    _, batch_d, first_d, second_d = runs["dense"]
    llm, batch_z, first_z, second_z = runs[kind]
    assert llm.engine.pool.geo.value_order == ("mma" if kind == "zip_mma" else "token")
    assert batch_z == batch_d
    assert first_z.token_ids == first_d.token_ids
    assert second_z.num_cached_tokens >= 16, "the preamble should come from cached (compressed) pages"
    assert second_z.token_ids == second_d.token_ids
    s = llm.engine.kv_stats()
    assert s["pages_compressed_total"] > 0 and s["groups_in_place"] == 0
    assert 0.75 <= s["k_ratio"] < 0.95 and 0.75 <= s["v_ratio"] < 0.9, s


@pytest.mark.parametrize("kind", ["zip", "zip_mma"])
def test_pool_bytes_decode_to_exactly_the_kv_written(runs, kind):
    dense, zipped = runs["dense"][0].engine, runs[kind][0].engine
    store = zipped.pool
    pairs = [(pz, dense.block_manager.hash_to_page[h]) for h, pz in zipped.block_manager.hash_to_page.items()
             if h in dense.block_manager.hash_to_page]
    assert len(pairs) >= 8
    pz = torch.tensor([p for p, _ in pairs])
    pd = torch.tensor([p for _, p in pairs])
    assert (store.state[pz.numpy()] == COMPRESSED).all()
    for layer in range(zipped.model.args.num_layers):
        got = store.read_pages(layer, pz)
        assert torch.equal(got.view(torch.int16), dense.runner.kv_caches[layer][pd].view(torch.int16)), layer
    assert (store.group_desc_all[:, pz] != 0xFF).float().mean() > 0.7  # most blocks are really compressed


def small_llm(shared_slabs: bool = False):
    """A pool of 4 raw pages and 8-token steps: chunked prefill, queueing and preemption all happen."""
    return engine_llm(SMOL, cache=CacheConfig(compress=True, num_pages=4, shared_slabs=shared_slabs),
                      scheduler=SchedulerConfig(max_num_batched_tokens=8))


@pytest.mark.parametrize("shared_slabs", [False, True])
def test_small_pool_preempts_and_chunked_prefill_keeps_tokens(runs, shared_slabs):
    """24 tokens each (10 preempt already with a slab per layer; shared slabs hold a page more, 24 preempt both)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in runs["dense"][0].generate([PROMPTS[0], PROMPTS[2]], params)]
    llm = small_llm(shared_slabs)
    before = llm.engine.scheduler.num_preemptions
    outs = llm.generate([PROMPTS[0], PROMPTS[2]], params)
    assert [o.token_ids for o in outs] == ref
    assert llm.engine.scheduler.num_preemptions > before, "two 3-page requests in a 3-4 page pool must preempt"


@pytest.mark.parametrize("shared_slabs", [False, True])
def test_long_requests_fill_the_pool_without_over_commit(runs, shared_slabs):
    """Four requests in a pool for fewer: queued or preempted, never over-committed, the dense cache's tokens."""
    llm = small_llm(shared_slabs)
    eng = llm.engine
    text = "Yaks and llamas carry loads across the high passes; " * 3
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [f"Trip {i}. {text}" for i in range(4)]
    ref = [o.token_ids for o in runs["dense"][0].generate(prompts, params)]
    rids = [eng.add_request(p, params) for p in prompts]
    done, peak = {}, 0
    while eng.has_unfinished():
        for out in eng.step():  # a MemoryError here would be an over-commit
            if out.finished:
                done[out.request_id] = out
        peak = max(peak, len(eng.scheduler.running))
        running_pages = sum(len(s.pages) for s in eng.scheduler.running)
        assert running_pages <= eng.kv_stats()["capacity_pages"]
    assert sorted(done) == sorted(rids) and [done[r].token_ids for r in rids] == ref
    assert peak < 4, "the pool cannot hold all four at once: admission must queue or preempt them"
    s = eng.kv_stats()
    assert s["pages_held"] == s["pages_compressed_held"] > 0, "finished requests leave compressed cached pages"
    assert s["preemptions"] == eng.scheduler.num_preemptions


def test_capacity_grows_with_compression_on_real_kv(runs):
    """Real pages of the fixed cache, written into a fresh pool until it is full: more pages than raw fit, and
    with slabs shared by all layers at least as many as with a slab per layer and class."""
    dense = runs["dense"][0].engine
    pids = sorted(dense.block_manager.hash_to_page.values())
    a = dense.model.args
    geo = ZipGeometry(a.num_layers, a.num_kv_heads, a.head_dim, 16)
    held = {}
    for shared in (False, True):
        store = ZipPagedKV(geo, budget_bytes=48 * geo.raw_page_bytes, shared_slabs=shared)
        slots = torch.arange(16)
        n = 0
        while store.free_pages() > 0:
            store.alloc_pages([n])
            src = pids[n % len(pids)]
            for layer in range(a.num_layers):
                kv = dense.runner.kv_caches[layer][src]  # [2, page, heads, dim]
                store.write(layer, kv[0], kv[1], slots + n * 16)
            store.compress([n])
            n += 1
        s = store.stats()
        assert s["pages_held"] == n > 1.15 * store.raw_capacity_pages, s
        assert s["capacity_pages"] > s["capacity_pages_uncompressed"]
        held[shared] = n
    assert held[True] >= held[False], held


def test_qwen_greedy_tokens_equal_with_and_without_compression():
    prompt = ["# Parse a CSV line into fields, honouring quotes\ndef parse_csv_line(line: str) -> list[str]:\n"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    zipped = engine_llm(QWEN, cache=CacheConfig(compress=True, num_pages=16))
    dense = engine_llm(QWEN, cache=CacheConfig(num_pages=16))
    assert zipped.generate(prompt, params)[0].token_ids == dense.generate(prompt, params)[0].token_ids
    assert zipped.engine.kv_stats()["pages_compressed_total"] >= 1


def test_decode_compresses_a_filled_page_one_step_later_and_prefill_at_once():
    """Decode steps split compression (placed while the next step runs); prefill steps finish it in the step."""
    from kvtide.cache.zip_pages import RAW

    eng = zip_llm(num_pages=24).engine
    store = eng.pool
    ids = eng.tokenizer.encode("A ledger of the harbour's ships, their cargo and their ports of call:")
    prompt = (ids * 4)[:37]  # two full pages filled by prefill, 5 tokens into the third
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    eng.step()  # prefill
    seq = next(iter(eng.seqs.values()))
    assert (store.state[seq.pages[:2]] == COMPRESSED).all() and not store._pending
    while seq.num_computed_tokens < 48:  # decode until the step that writes token 47 fills page 2
        eng.step()
    assert store.state[seq.pages[2]] == RAW and [j.pids for j in store._pending] == [[seq.pages[2]]]
    eng.step()
    assert store.state[seq.pages[2]] == COMPRESSED
    while eng.has_unfinished():
        eng.step()
    assert not store._pending, "an idle engine leaves no compression half done"
