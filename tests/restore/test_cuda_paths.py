"""The executor's CUDA paths (skipped without a GPU): pinned staging, parallel verify workers, the I/O stream and
its events, event timing, stealing, a failed load. Random-weight tiny model, bf16 KV: loads must place exactly the
prefill's bytes, and every plan must give the logits a plain prefill gives.

Run on a GPU machine with ``python -m pytest -q tests/restore/test_cuda_paths.py`` (or as a script).
"""
from __future__ import annotations

import time

import torch

try:
    import pytest

    pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
except ImportError:  # run as a script on a machine without pytest
    pytest = None

C = 32
N = 4 * C


def _setup(codec=None):
    from kvtide import CacheConfig
    from kvtide.config import RestoreConfig
    from kvtide.engine.llm import LLM

    # The tiny model's head_dim (32) has no prebuilt FlashInfer kernel (a JIT build needs the toolchain): torch.
    llm = LLM("random:llama3-8b" if _BIG else "random:tiny", device="cuda", progress=False,
              cache=CacheConfig(kv_dtype="bfloat16", enable_prefix_caching=False, num_pages=4096),
              restore=RestoreConfig(chunk_tokens=C, store_codec=codec), attention_backend="flashinfer" if _BIG else "torch")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, llm.engine.model.args.vocab_size, (N + 8,), generator=g).tolist()
    return llm, ids


_BIG = False


def _prefill_kv(eng, ids):
    from kvtide.engine.sequence import Sequence
    from kvtide.engine.sampling_params import SamplingParams

    seq = Sequence(f"p{time.perf_counter_ns()}", None, list(ids), SamplingParams(max_tokens=1))
    assert eng.block_manager.allocate(seq, len(ids))
    with torch.inference_mode():
        eng.runner.execute([(seq, len(ids))], [None])
    return seq


def _finish(r, seq, ids):
    """Hand the prefilled prefix to the restorer as a finished request would (its chunks go to the store)."""
    r.on_finish(type("S", (), {"num_computed_tokens": N, "pages": seq.pages, "token_ids": ids[:N]})())


def _kv(eng, seq, n):
    p = eng.block_manager.page_size
    pages = torch.tensor(seq.pages[: n // p], device=eng.runner.device)
    return [eng.runner.kv_caches[i][pages].clone() for i in range(eng.model.args.num_layers)]


def _stored(llm, ids):
    """Prefill the prefix, keep its KV, and hand it to the store as a finished request would; (engine, restorer,
    layers, prefilled sequence, its KV per layer, chunk keys)."""
    from kvtide.store.keys import chunk_keys

    eng, r = llm.engine, llm.engine.restorer
    base = _prefill_kv(eng, ids[:N])
    want = _kv(eng, base, N)
    _finish(r, base, ids)
    r.writer.flush()
    return eng, r, eng.model.args.num_layers, base, want, chunk_keys(ids[:N], r.keyspace)


def _restore(llm, store, ids, keys, js, load):
    from kvtide.engine.restore_port import EnginePort
    from kvtide.engine.sequence import Sequence
    from kvtide.engine.sampling_params import SamplingParams
    from kvtide.restore.executor import RestoreExecutor, RestoreJob

    eng = llm.engine
    seq = Sequence(f"r{time.perf_counter_ns()}", None, list(ids), SamplingParams(max_tokens=1))
    assert eng.block_manager.allocate(seq, len(ids))
    with torch.inference_mode():
        res = RestoreExecutor(EnginePort(eng.runner, [seq]), store, C, load).run(
            [RestoreJob(ids, 0, N, len(ids), keys, js)])
    got = _kv(eng, seq, N)
    eng.block_manager.release(seq)
    return res, got


def test_cuda_load_paths_place_prefill_bytes_and_match_logits():
    from kvtide.restore.executor import LoadConfig

    llm, ids = _setup()
    eng, r, L, base, want, keys = _stored(llm, ids)
    ref, _ = _restore(llm, r.store, ids, keys, [N] * L, LoadConfig())  # recompute-only: a plain prefill
    for load in (LoadConfig(), LoadConfig(workers=0), LoadConfig(workers=3, batch_bytes=1, read_ahead=2)):
        res, got = _restore(llm, r.store, ids, keys, [0] * L, load)
        assert res.failures == [] and res.loaded_tokens == L * N
        assert all(torch.equal(g.view(torch.int16), w.view(torch.int16)) for g, w in zip(got, want)), load
        assert torch.allclose(res.logits.float(), ref.logits.float(), atol=0.1, rtol=0.05)
        assert res.recompute_seconds == 0.0 and res.suffix_seconds > 0 and len(res.suffix_layer_seconds) == L
    half = [N if i < L // 2 else N // 2 for i in range(L)]
    res, got = _restore(llm, r.store, ids, keys, half, LoadConfig(steal=True))
    b = res.boundaries[0]  # stealing may take whole lower layers: the staircase then stops early
    assert res.failures == [] and res.recompute_seconds > 0 and b[0] == N
    assert len(res.layer_recompute_seconds) == sum(x > 0 for x in b)
    assert res.recomputed_tokens == sum(b) and res.recomputed_tokens + res.stolen_tokens == sum(half)
    assert torch.allclose(res.logits.float(), ref.logits.float(), atol=0.1, rtol=0.05)
    eng.block_manager.release(base)


def test_cuda_finished_chunks_are_read_before_their_pages_are_reused():
    """The copy-out to the store is asynchronous (side stream, pinned memory): a step that overwrites the pages
    right after ``on_finish`` must not change what the store gets."""
    from kvtide.store.keys import chunk_keys

    llm, ids = _setup()
    eng, r = llm.engine, llm.engine.restorer
    L = eng.model.args.num_layers
    base = _prefill_kv(eng, ids[:N])
    want = _kv(eng, base, N)
    _finish(r, base, ids)
    pages = torch.tensor(base.pages, device=eng.runner.device)
    for i in range(L):  # what the next step's writes would do to reused pages, enqueued before any host wait
        eng.runner.kv_caches[i].index_fill_(0, pages, 7.0)
    r.writer.flush()
    assert r.stats.write_seconds > 0
    p = eng.block_manager.page_size
    for key in chunk_keys(ids[:N], r.keyspace):
        lo = key.index * C
        for i in range(L):
            got = r.store.get(key, i, ids[lo:lo + C])
            w = want[i][lo // p:(lo + C) // p].permute(1, 0, 2, 3, 4).reshape(got.shape)
            assert torch.equal(got.view(torch.int16), w.cpu().view(torch.int16)), (key.index, i)
    eng.block_manager.release(base)


def test_cuda_failed_load_falls_back():
    from kvtide.restore.executor import LoadConfig
    from tests.restore.restore_helpers import FailAfter

    llm, ids = _setup()
    eng, r, L, base, _, keys = _stored(llm, ids)
    ref, _ = _restore(llm, r.store, ids, keys, [N] * L, LoadConfig())
    res, _ = _restore(llm, FailAfter(r.store, ok=2), ids, keys, [0] * L, LoadConfig())
    # Batched fetches reach the failure in (layer, chunk) batches: how much stays loaded depends on the batching;
    # what must hold is a counted fallback that recomputes at most the whole prompt and the same logits.
    assert res.failures and res.fallback_requests == [0] and 0 < res.fallback_tokens <= len(ids)
    assert torch.allclose(res.logits.float(), ref.logits.float(), atol=0.1, rtol=0.05)
    eng.block_manager.release(base)


def _check_store_loads(llm, store, ids, keys, want, ref, L):
    """Load-only through three LoadConfigs (exact prefill bytes, prefill logits), a hybrid plan with stealing, and a
    failure after two entries (counted fallback, same logits), all from ``store``."""
    from kvtide.restore.executor import LoadConfig
    from tests.restore.restore_helpers import FailAfter

    for load in (LoadConfig(), LoadConfig(workers=0), LoadConfig(workers=3, batch_bytes=1, read_ahead=2)):
        res, got = _restore(llm, store, ids, keys, [0] * L, load)
        assert res.failures == [] and res.loaded_tokens == L * N
        assert all(torch.equal(g.view(torch.int16), w.view(torch.int16)) for g, w in zip(got, want)), load
        assert torch.allclose(res.logits.float(), ref.logits.float(), atol=0.1, rtol=0.05)
    half = [N if i < L // 2 else N // 2 for i in range(L)]
    res, _ = _restore(llm, store, ids, keys, half, LoadConfig(steal=True))
    assert res.failures == [] and torch.allclose(res.logits.float(), ref.logits.float(), atol=0.1, rtol=0.05)
    res, _ = _restore(llm, FailAfter(store, ok=2), ids, keys, [0] * L, LoadConfig())
    assert res.failures and res.fallback_requests == [0]
    assert torch.allclose(res.logits.float(), ref.logits.float(), atol=0.1, rtol=0.05)


def test_cuda_pinned_store_dma_places_prefill_bytes_and_releases_after_the_copies():
    """Records in page-locked slabs go to the device by DMA straight from the record: the same bytes land, with
    stealing and with a failure mid-load, and no lease outlives its copies."""
    from kvtide.restore.executor import LoadConfig
    from kvtide.store import PinnedMemoryStore

    llm, ids = _setup()
    eng, r, L, base, want, keys = _stored(llm, ids)
    pinned = PinnedMemoryStore.filled_from(r.store, 256 << 20, slab_bytes=4 << 20)
    assert pinned.pinned
    ref, _ = _restore(llm, pinned, ids, keys, [N] * L, LoadConfig())
    _check_store_loads(llm, pinned, ids, keys, want, ref, L)
    torch.cuda.synchronize()
    assert pinned.leased == 0
    eng.block_manager.release(base)


def test_cuda_zip_store_encodes_on_device_and_places_prefill_bytes():
    """store_codec="zip": chunks are encoded on the GPU on the way out (while the pages are overwritten right after
    the finish), loads are decoded on the GPU in one launch per fetch; the pages get the prefill's exact bytes from
    the memory and the pinned tier, with stealing, and after a failure mid-load."""
    from kvtide.restore.executor import LoadConfig
    from kvtide.store import PinnedMemoryStore
    from kvtide.store.zip_entry import ZipEntry

    llm, ids = _setup("zip")
    eng, r, L, base, want, keys = _stored(llm, ids)
    assert r.writer.stats.zip_entries == L * len(keys) and r.writer.stats.failures == 0
    e = r.store.open(r.store._read(keys[0].entry_name(0)), keys[0], 0, ids[:C], decode=False).tensor
    assert isinstance(e, ZipEntry)
    print(f"zip entries: {r.bytes_per_token:.0f} B/token/layer vs {r.plain_bytes_per_token:.0f} plain")
    ref, _ = _restore(llm, r.store, ids, keys, [N] * L, LoadConfig())
    pinned = PinnedMemoryStore.filled_from(r.store, 256 << 20, slab_bytes=4 << 20)
    for store in (r.store, pinned):
        _check_store_loads(llm, store, ids, keys, want, ref, L)
    torch.cuda.synchronize()
    assert pinned.leased == 0
    eng.block_manager.release(base)
    # the copy-out is asynchronous: pages overwritten right after the finish must not change what is stored
    base = _prefill_kv(eng, ids[:N])
    want = _kv(eng, base, N)
    from tests.restore.restore_helpers import fresh_store

    fresh_store(llm)
    _finish(r, base, ids)
    pages = torch.tensor(base.pages, device=eng.runner.device)
    for i in range(L):
        eng.runner.kv_caches[i].index_fill_(0, pages, 7.0)
    r.writer.flush()
    res, got = _restore(llm, r.store, ids, keys, [0] * L, LoadConfig())
    assert res.failures == [] and all(torch.equal(g.view(torch.int16), w.view(torch.int16)) for g, w in zip(got, want))
    eng.block_manager.release(base)


if __name__ == "__main__":  # a GPU machine without pytest
    import sys

    sys.path.insert(0, ".")
    for name, fn in list(globals().items()):
        if name.startswith("test_"):
            t = time.perf_counter()
            fn()
            print(f"{name}: ok ({time.perf_counter() - t:.1f}s)")
