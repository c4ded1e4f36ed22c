"""Restorations through the runner's layer graphs (each layer's halves around attention over fixed, padded buffers)
give what the plain layer calls give: same logits, same restored KV, same greedy tokens. On the CPU the halves run
eagerly (``capture=False``): that checks the buffers, the padding rows, the row buckets and the hand-over of h
between calls; the GPU test checks the captured graphs."""
from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch

from kvtide.engine.cuda_graphs import LayerGraphs
from kvtide.engine.restore_port import EnginePort
from kvtide.engine.sequence import Sequence
from kvtide.restore.executor import RestoreExecutor, RestoreJob
from kvtide.store.keys import chunk_keys
from tests.restore.restore_helpers import (
    CHUNK, fresh_store, greedy, mixed_staircase, no_restore, restore_llm, text_ids, two_turns,
)


@contextlib.contextmanager
def layer_graphs(llm, max_rows: int = 128, capture: bool = False) -> Iterator[LayerGraphs]:
    runner = llm.engine.runner
    old = runner.layer_graphs
    runner.layer_graphs = LayerGraphs(llm.engine.model, runner.device, max_rows=max_rows, capture=capture)
    try:
        yield runner.layer_graphs
    finally:
        runner.layer_graphs = old


def _prefill(eng, ids: list[int]) -> Sequence:
    seq = Sequence(f"p{len(ids)}", None, list(ids), greedy(1))
    assert eng.block_manager.allocate(seq, len(ids))
    eng.runner.execute([(seq, len(ids))], [None])
    return seq


def _kv(eng, seqs: list[Sequence], n: int) -> list[torch.Tensor]:
    p = eng.block_manager.page_size
    pages = torch.tensor([pid for s in seqs for pid in s.pages[: -(-n // p)]])
    return [eng.runner.kv_caches[i][pages].clone() for i in range(eng.model.args.num_layers)]


def _restore(eng, store, jobs: list[RestoreJob]) -> tuple[torch.Tensor, list[torch.Tensor], object]:
    seqs = [Sequence(f"r{i}", None, list(j.token_ids), greedy(1)) for i, j in enumerate(jobs)]
    for s in seqs:
        assert eng.block_manager.allocate(s, s.num_tokens)
    res = RestoreExecutor(EnginePort(eng.runner, seqs), store, CHUNK).run(jobs)
    kv = _kv(eng, seqs, jobs[0].total)
    for s in seqs:
        eng.block_manager.release(s)
    return res.logits, kv, res


@pytest.mark.parametrize("plan", ["load", "recompute", "staircase"])
def test_layer_graph_calls_match_plain_calls(plan: str):
    """Two requests with suffixes of 12 and 5 rows (17: bucket 32, 15 padding rows), and staircase layers of 64 or 192
    rows (bucket 64, or plain calls beyond 128): logits and every restored KV byte within fp32 noise of plain calls."""
    llm = restore_llm()
    eng = llm.engine
    r = eng.restorer
    store = fresh_store(llm)
    L = eng.model.args.num_layers
    n = 96
    prompts = [text_ids(llm, 6000, n + 12), text_ids(llm, 9000, n + 5)]
    with torch.inference_mode():
        for ids in prompts:
            base = _prefill(eng, ids[:n])
            r.on_finish(type("S", (), {"num_computed_tokens": n, "pages": base.pages, "token_ids": ids[:n]})())
            eng.block_manager.release(base)
        r.writer.flush()
        js = {"load": [0] * L, "recompute": [n] * L, "staircase": mixed_staircase(n, L)}[plan]
        jobs = [RestoreJob(ids, 0, n, len(ids), chunk_keys(ids[:n], r.keyspace), list(js)) for ids in prompts]
        want_logits, want_kv, _ = _restore(eng, store, jobs)
        with layer_graphs(llm) as g:
            got_logits, got_kv, res = _restore(eng, store, jobs)
            # the suffix in bucket 32; staircase layers of 2 x 32 rows in bucket 64, of 2 x 96 plain calls
            assert set(g.cache) == ({32, 64} if plan == "staircase" else {32})
    assert res.failures == []
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    for got, want in zip(got_kv, want_kv):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_layer_graphs_engine_tokens_and_a_failed_request():
    """Through the engine: every method's greedy tokens equal a full prefill's with layer graphs on; a batch of two
    where one request's tier dies mid-load keeps the other on the graphs (its rows leave the suffix batch) and both
    still answer as a full prefill would."""
    llm = restore_llm()
    r = llm.engine.restorer
    store = fresh_store(llm)
    b, ref = two_turns(llm, 300, first=100, extra=12, out=2)
    c, ref_c = two_turns(llm, 5000, first=100, extra=9, out=2)
    with layer_graphs(llm, max_rows=64) as g:
        for m in ["cacheflow", "recompute", "load", "cake", "layerwise"]:
            r.cfg.method = m
            assert llm.generate(b, greedy(2))[0].token_ids == ref, m
        assert g.cache[32].calls >= 5 * 30, "every method's suffix (18 rows) on the graphs"
        name = chunk_keys(c[:96], r.keyspace)[1].entry_name(7)  # c's second chunk, layer 7: corrupt
        blob = bytearray(store._read(name))
        blob[-7] ^= 0x40
        store._poke(name, bytes(blob))
        r.cfg.method = "load"
        before = {k: v.calls for k, v in g.cache.items()}
        try:
            outs = llm.generate([c, b], greedy(2))  # 15 + 18 suffix rows (bucket 64), then b's 18 alone (bucket 32)
        finally:
            r.cfg.method = "cacheflow"
        # b's 30 suffix layers: beside c's rows until the failure is seen (at most c's 7 good layers; how many
        # depends on how far the I/O thread got first), then alone; c is recomputed by the fallback (plain calls)
        both = g.cache[64].calls - before.get(64, 0) if 64 in g.cache else 0
        assert both <= 7 and both + g.cache[32].calls - before[32] == 30
    assert [o.token_ids for o in outs] == [ref_c, ref]
    assert r.history[-1].failures == 1 and r.stats.fallbacks == 1


def test_layer_graphs_config_errors():
    llm = restore_llm()
    with pytest.raises(ValueError, match="CUDA device"):
        LayerGraphs(llm.engine.model, torch.device("cpu"))
    with pytest.raises(ValueError, match="power of two"):
        LayerGraphs(llm.engine.model, torch.device("cpu"), max_rows=100, capture=False)
    g = LayerGraphs(llm.engine.model, torch.device("cpu"), max_rows=32, capture=False)
    assert [g.bucket(n) for n in (1, 16, 17, 32)] == [16, 16, 32, 32]
    with pytest.raises(ValueError, match="1..32 rows"):
        g.get(33)
    g.prepare()  # every bucket, as a bench does before timing
    assert sorted(g.cache) == [16, 32] and g.captures == 2


def _two_turns_ids(llm, seed: int, extra: int, first: int = 100, out: int = 3) -> tuple[list[int], list[int]]:
    """``two_turns`` for a model without a tokenizer (random weights): random token ids."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(1, llm.engine.model.args.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    a = ids(first)
    o = llm.generate(a, greedy(out))[0]
    llm.engine.restorer.writer.flush()
    b = a + o.token_ids + ids(extra)
    with no_restore(llm):
        ref = llm.generate(b, greedy(out))[0].token_ids
    return b, ref


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compress", [False, True])
def test_cuda_layer_graphs_restore_the_eager_tokens(compress: bool):
    """Captured graphs on the GPU: every method restores to the tokens the eager layer calls give (fp32 model);
    compress=True: bf16 KV in the ZipFusion pool, attention between the graphed halves by the zip kernel."""
    from kvtide import LLM, CacheConfig
    from kvtide.config import RestoreConfig

    out = {}
    for graphs in (False, True):
        llm = LLM("random:tiny-d128", progress=False, device="cuda", dtype="float32", seed=0, cuda_graphs=graphs,
                  cache=CacheConfig(kv_dtype="bfloat16" if compress else "float32", compress=compress,
                                    enable_prefix_caching=False, num_pages=256),
                  restore=RestoreConfig(chunk_tokens=CHUNK))
        if compress:
            assert llm.engine.runner.attention.kernel.__name__.endswith("zip_attention_cuda")
        fresh_store(llm)
        b, ref = _two_turns_ids(llm, 1, extra=12)
        c, ref_c = _two_turns_ids(llm, 2, extra=9)
        got = []
        for m in ["cacheflow", "recompute", "load", "cake", "layerwise"]:
            llm.engine.restorer.cfg.method = m
            got.append([o.token_ids for o in llm.generate([b, c], greedy(3))])
        assert all(x == [ref, ref_c] for x in got)
        if graphs:
            assert llm.engine.runner.layer_graphs.captures >= 1
        out[graphs] = got
    assert out[True] == out[False]
