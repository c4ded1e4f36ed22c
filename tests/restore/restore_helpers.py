"""Shared pieces of the restoration tests: engines with a store, turns, plain-prefill references, fault stores."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from kvtide import CacheConfig, SamplingParams
from kvtide.config import RestoreConfig
from kvtide.engine.llm import LLM
from kvtide.engine.restoration import RestoreStats
from kvtide.restore.planner import Plan
from kvtide.store import MemoryStore, StoreUnavailable

CHUNK = 32
_LLMS: dict[str, LLM] = {}


def restore_llm(model: str = "smollm2-135m", kv_dtype: str = "float32", prefix_caching: bool = False,
                num_pages: int | None = None, **restore_kw: Any) -> LLM:
    """One engine per configuration per session (loading is the slow part); KV store in memory unless told."""
    key = f"{model}|{kv_dtype}|{prefix_caching}|{num_pages}|{sorted(restore_kw.items())}"
    if key not in _LLMS and len(_LLMS) >= 2:  # bound memory: drop the oldest engine
        old = _LLMS.pop(next(iter(_LLMS)))
        if old.engine.restorer is not None and old.engine.restorer.writer is not None:
            old.engine.restorer.writer.close()
        del old
        import gc

        gc.collect()
    if key not in _LLMS:
        _LLMS[key] = LLM(model, progress=False,
                         cache=CacheConfig(kv_dtype=kv_dtype, enable_prefix_caching=prefix_caching,
                                           **({"num_pages": num_pages} if num_pages else {})),
                         restore=RestoreConfig(chunk_tokens=CHUNK, **restore_kw))
    return _LLMS[key]


def fresh_store(llm: LLM, store: Any | None = None) -> Any:
    """Give the engine's restorer an empty store (and writer, stats) so tests do not see each other's chunks."""
    r = llm.engine.restorer
    r.use_store(store if store is not None else MemoryStore(256 << 20))
    r.stats = RestoreStats()
    return r.store


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def text_ids(llm: LLM, offset: int, n: int) -> list[int]:
    from pydoc_data.topics import topics

    ids = llm.tokenizer.encode(" ".join(topics[k] for k in sorted(topics)))
    return ids[offset:offset + n]


def two_turns(llm: LLM, offset: int, first: int = 90, extra: int = 20, out: int = 4) -> tuple[list[int], list[int]]:
    """Run turn 1 (its chunks go to the store); return turn 2's prompt and its plain-prefill greedy tokens."""
    a = text_ids(llm, offset, first)
    o = llm.generate(a, greedy(out))[0]
    llm.engine.restorer.writer.flush()
    b = a + o.token_ids + text_ids(llm, offset + 2000, extra)
    with no_restore(llm):
        ref = llm.generate(b, greedy(out))[0].token_ids
    return b, ref


@contextlib.contextmanager
def no_restore(llm: LLM) -> Iterator[None]:
    """The plain engine path: no lookups, no writes."""
    eng = llm.engine
    r, eng.restorer = eng.restorer, None
    try:
        yield
    finally:
        eng.restorer = r


@contextlib.contextmanager
def forced_plan(llm: LLM, staircase: Any) -> Iterator[None]:
    """Make the restorer run ``staircase(cached_tokens, num_layers) -> boundaries`` instead of its method."""
    r = llm.engine.restorer
    orig = r.plan_for

    def plan_for(picked, method=None):  # noqa: ANN001
        rows = [staircase(cached - start, r.num_layers) for _, start, cached, _ in picked]
        return Plan(boundaries=rows, predicted_seconds=0.0, method="forced")

    r.plan_for = plan_for
    try:
        yield
    finally:
        r.plan_for = orig


def mixed_staircase(n: int, layers: int) -> list[int]:
    """A staircase that recomputes, loads and mixes: n in the first third, n/2 (on the grid) next, 0 after."""
    half = (n // 2) // CHUNK * CHUNK
    return [n if i < layers // 3 else half if i < 2 * layers // 3 else 0 for i in range(layers)]


class FailAfter:
    """A store wrapper whose loads succeed ``ok`` entries, then fail (a tier dying in the middle of a load),
    through both load paths: entry by entry (``get_entry``) and in bulk (``fetch``)."""

    def __init__(self, inner: Any, ok: int, exc: BaseException | None = None) -> None:
        self.inner = inner
        self.ok = ok
        self.exc = exc or StoreUnavailable("link dropped mid-load")
        self.calls = 0

    def get_entry(self, key, layer, tokens):  # noqa: ANN001
        self.calls += 1
        if self.calls > self.ok:
            raise self.exc
        return self.inner.get_entry(key, layer, tokens)

    def fetch(self, items, **kw):  # noqa: ANN001, ANN003
        f = self.inner.fetch(items, **kw)
        for i in range(len(f.blobs)):
            self.calls += 1
            if self.calls > self.ok:
                f.blobs[i] = self.exc
        return f

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class EntryByEntry:
    """A store wrapper with only ``get_entry`` (like a shard's view): the executor's one-by-one load path."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def get_entry(self, key, layer, tokens):  # noqa: ANN001
        return self.inner.get_entry(key, layer, tokens)

    def __getattr__(self, name: str) -> Any:
        if name in ("fetch", "open"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def prefill(eng: Any, ids: list[int]) -> Any:
    """A sequence of ``ids`` prefilled in the engine's pages (not released): what a prefill of the prefix writes."""
    from kvtide.engine.sequence import Sequence

    seq = Sequence(f"p{len(ids)}-{id(ids)}", None, list(ids), greedy(1))
    assert eng.block_manager.allocate(seq, len(ids))
    eng.runner.execute([(seq, len(ids))], [None])
    return seq


def prefix_kv(eng: Any, seq: Any, n: int) -> list:
    """Copies of the first ``n`` tokens' pages of ``seq``, per layer."""
    import torch

    p = eng.block_manager.page_size
    pages = torch.tensor(seq.pages[: n // p])
    return [eng.runner.kv_caches[i][pages].clone() for i in range(eng.model.args.num_layers)]


def write_prefix(r: Any, seq: Any, ids: list[int], n: int) -> None:
    """Hand ``seq``'s first ``n`` tokens to the restorer as a finished request would, and wait for the store."""
    r.on_finish(type("S", (), {"num_computed_tokens": n, "pages": seq.pages, "token_ids": ids[:n]})())
    r.writer.flush()
