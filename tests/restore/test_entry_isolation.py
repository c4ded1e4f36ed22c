"""One bad entry costs only its own request's chunk: in a restoration batch of two requests the other restores fully.
A tier-level failure (StoreUnavailable) marks the tier down: no further loads are asked of it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtide.store import DiskStore, StoreUnavailable
from kvtide.store.base import encode_record
from kvtide.store.keys import chunk_keys
from tests.restore.restore_helpers import CHUNK, fresh_store, greedy, restore_llm, two_turns

BAD_LAYER = 7


def _two_stored(llm, tmp_path: Path):  # noqa: ANN001
    store = fresh_store(llm, DiskStore(tmp_path / "kv"))
    b1, ref1 = two_turns(llm, 7300, first=100, extra=12, out=2)
    b2, ref2 = two_turns(llm, 12100, first=100, extra=12, out=2)
    return store, (b1, ref1), (b2, ref2)


def _spoil(store: DiskStore, key, tokens, kind: str) -> None:  # noqa: ANN001
    path = store.path(key.entry_name(BAD_LAYER))
    if kind == "unreadable":  # an I/O error on this one file (the tier itself is fine)
        path.unlink()
        path.mkdir()
    elif kind == "oversize":  # a 4 GiB sparse file under the entry's name
        with open(path, "wb") as f:
            f.truncate(4 << 30)
    elif kind == "uint8":  # the right key, layer, tokens and shape, valid digest, another dtype: cast, it is garbage
        kv = store.get(key, BAD_LAYER, tokens)
        path.write_bytes(bytes(encode_record(key, BAD_LAYER, tokens, kv.to(torch.uint8))))


@pytest.mark.parametrize("kind,counter", [("unreadable", "read_errors"), ("oversize", "oversize"),
                                          ("uint8", "corrupt")])
def test_one_bad_entry_costs_only_its_own_chunk(tmp_path: Path, kind: str, counter: str) -> None:
    llm = restore_llm()
    r = llm.engine.restorer
    store, (b1, ref1), (b2, ref2) = _two_stored(llm, tmp_path)
    key = chunk_keys(b1[:96], r.keyspace)[1]
    _spoil(store, key, b1[CHUNK:2 * CHUNK], kind)
    r.cfg.method = "load"  # every layer's entries are loaded, the bad one too
    try:
        out1, out2 = llm.generate([b1, b2], [greedy(2), greedy(2)])
    finally:
        r.cfg.method = "cacheflow"
    assert out1.token_ids == ref1 and out2.token_ids == ref2
    rec = r.history[-1]
    assert len(rec.request_ids) == 2  # one restoration batch held both
    assert rec.failures == 1 and r.stats.fallbacks == 1
    assert rec.fallback_tokens == len(b1) - CHUNK  # request 1 from its bad chunk on; request 2 not at all
    assert out2.num_cached_tokens == 96
    st = store.stats.snapshot()
    assert st[counter] == 1 and st["unavailable"] == 0


class DiesOnOneEntry:
    """The tier stops answering: one fetched entry of request 1 comes back StoreUnavailable. Counts fetches."""

    def __init__(self, inner, name: str) -> None:  # noqa: ANN001
        self.inner, self.name = inner, name
        self.fetches, self.failed_at = 0, None

    def fetch(self, items, **kw):  # noqa: ANN001, ANN003
        f = self.inner.fetch(items, **kw)
        self.fetches += 1
        for i, n in enumerate(f.names):
            if n == self.name:
                f.blobs[i] = StoreUnavailable("connection reset", n)
                self.failed_at = self.fetches
        return f

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def test_a_tier_level_failure_stops_every_request_s_loads(tmp_path: Path) -> None:
    llm = restore_llm()
    r = llm.engine.restorer
    store, (b1, ref1), (b2, ref2) = _two_stored(llm, tmp_path)
    dying = DiesOnOneEntry(store, chunk_keys(b1[:96], r.keyspace)[1].entry_name(BAD_LAYER))
    r.store = dying
    r.cfg.method = "load"
    try:
        out1, out2 = llm.generate([b1, b2], [greedy(2), greedy(2)])
    finally:
        r.store, r.cfg.method = store, "cacheflow"
    assert out1.token_ids == ref1 and out2.token_ids == ref2
    assert dying.failed_at == BAD_LAYER + 1  # a fetch per layer
    assert dying.fetches <= dying.failed_at + 1  # at most the one fetched ahead; not one a layer to the end
    assert r.stats.fallbacks == 2  # both fall back: the tier did not answer, so nothing more is asked of it
