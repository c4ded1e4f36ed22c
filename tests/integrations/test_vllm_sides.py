"""Both sides of the connector driven in vLLM's order without vLLM (``fake_vllm``): what one process saves, another
finds and places exactly; every kind of failed load is reported as blocks to recompute, writes nothing and is
counted; a late layer cancels the loads before they land; saves of a step that read failed KV are dropped; the
planned split loads only what it planned."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvtide.store.auth import RecordAuth
from kvtide.store.keys import chunk_keys
from kvtide.store.record import encode_record
from tests.integrations.fake_vllm import BS, L, Engine, Request, true_kv
from kvtide.integrations.vllm.plan import WorkerReport

C = 32  # chunk tokens: two vLLM blocks


def tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 30000, (n,), generator=g).tolist()


def saved(store: str, reqs: list[Request], **kw) -> Engine:
    """A first process that computes ``reqs`` (saving their chunks) and has written them all."""
    e = Engine(store, C, **kw)
    for r in reqs:
        assert e.admit(r) == 0
    e.step(reqs)
    assert e.worker.flush(10)
    return e


def entry_file(root: Path, key_hex: str, layer: int) -> Path:
    return next(root.rglob(f"{key_hex}.{layer}.kvt"))


@pytest.fixture
def disk(tmp_path: Path) -> tuple[str, Path]:
    return f"disk:{tmp_path}", tmp_path


def test_second_process_places_exactly_what_the_first_computed(disk):
    spec, _ = disk
    r = Request("a", tokens(100))
    first = saved(spec, [r])
    assert first.counters.totals()["saved_chunks"] == 3  # 100 tokens: chunks [0, 32), [32, 64), [64, 96)
    second = Engine(spec, C)
    r2 = Request("a2", list(r.all_token_ids))
    assert second.admit(r2) == 96  # every stored chunk; at least the last token is left to vLLM
    second.next_block = 9  # another block table than the first process had
    invalid = second.step([r2])
    assert invalid == set()
    for layer in range(L):
        assert torch.equal(second.placed("a2", layer, 0, 96), true_kv(layer, r2.all_token_ids, 0, 96))
    t = second.counters.totals()
    assert t["hit_tokens"] == 96 and t["loaded_tokens"] == 96 and t["loaded_chunks"] == 3 * L
    assert t["load_errors"] == 0 and t["saved_chunks"] == 0  # nothing new to save: the store had it all


def test_match_stops_before_the_last_token(disk):
    spec, _ = disk
    r = Request("a", tokens(96))
    saved(spec, [r])
    e = Engine(spec, C)
    assert e.admit(Request("b", list(r.all_token_ids))) == 95  # the whole prompt is stored: vLLM computes 1


def test_local_prefix_hits_are_not_loaded_again(disk):
    spec, _ = disk
    r = Request("a", tokens(100))
    saved(spec, [r])
    e = Engine(spec, C)
    assert e.sched.lookup(Request("b", list(r.all_token_ids)), 32) == 64  # vLLM has [0, 32): load [32, 96)


@pytest.mark.parametrize("damage,counter", [("corrupt", "load_corrupt"), ("truncate", "load_truncated"),
                                            ("tokens", "load_token_mismatch"), ("forge", "load_forged"),
                                            ("missing", "load_missing")])
def test_failed_loads_are_reported_and_write_nothing(disk, damage, counter):
    spec, root = disk
    secret = {"secret": "s"} if damage == "forge" else {}
    toks = tokens(100)
    saved(spec, [Request("a", toks)], **secret)
    e = Engine(spec, C, **secret)
    key = chunk_keys(toks, e.space if not secret else e.sched.keyspace)[1]  # the second chunk, layer 2
    path = entry_file(root, key.hex, 2)
    blob = bytearray(path.read_bytes())
    if damage == "corrupt":
        blob[-100] ^= 1
    elif damage == "truncate":
        del blob[-64:]
    elif damage == "tokens":  # a well-formed record of other tokens under this chunk's name
        other = tokens(C, seed=9)
        blob = bytearray(encode_record(key, 2, other, true_kv(2, other, 0, C)).tobytes())
    elif damage == "forge":
        blob = bytearray(encode_record(key, 2, toks[C:2 * C], true_kv(2, toks, C, 2 * C),
                                       auth=RecordAuth(b"not the secret")).tobytes())
    if damage == "missing":
        path.unlink()
    else:
        path.write_bytes(bytes(blob))
    r = Request("b", list(toks))
    assert e.admit(r) == 96
    table = e.tables["b"]
    invalid = e.step([r])
    assert invalid == set(table[C // BS: 96 // BS])  # from the failed chunk's first block to the load's end
    t = e.counters.totals()
    assert t[counter] == 1 and t["load_errors"] == 1 and t["load_failed_requests"] == 1
    # chunk 0 placed in every layer; the failed chunk and the one after never written from layer 2 on
    for layer in range(L):
        assert torch.equal(e.placed("b", layer, 0, C), true_kv(layer, toks, 0, C))
    for layer in range(2, L):
        assert not e.placed("b", layer, C, 96).any()
    # the chunks from the failed one on are no longer taken as stored: written again once recomputed
    assert key.hex not in e.sched._known


def test_unreachable_tier_is_a_load_error(disk):
    spec, root = disk
    toks = tokens(70)
    saved(spec, [Request("a", toks)])
    e = Engine(spec, C, breaker_failures=0)
    r = Request("b", list(toks))
    assert e.admit(r) == 64
    for p in sorted(root.rglob("*"), reverse=True):  # the store's directory goes away between lookup and load
        p.unlink() if p.is_file() else p.rmdir()
    root.rmdir()
    invalid = e.step([r])
    assert invalid == set(e.tables["b"][:64 // BS])
    t = e.counters.totals()
    assert t["load_unavailable"] >= 1 and t["load_failed_requests"] == 1


class SlowLayer:
    """A store whose fetch of one layer takes ``delay`` seconds (a stalled link)."""

    def __init__(self, inner, layer: int, delay: float) -> None:
        self.inner, self.layer, self.delay = inner, layer, delay

    def fetch(self, items, max_bytes=None):
        if items and items[0][1] == self.layer:
            time.sleep(self.delay)
        return self.inner.fetch(items, max_bytes=max_bytes)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_late_layer_cancels_the_loads(disk):
    spec, _ = disk
    toks = tokens(100)
    saved(spec, [Request("a", toks)])
    e = Engine(spec, C, load_timeout_s=0.3)
    e.worker.store = SlowLayer(e.worker.store, layer=1, delay=0.8)
    r = Request("b", list(toks))
    assert e.admit(r) == 96
    t0 = time.monotonic()
    invalid = e.step([r])
    assert time.monotonic() - t0 < 0.75  # the step did not wait for the stalled layer
    assert invalid == set(e.tables["b"][:96 // BS])
    time.sleep(1.0)  # the stalled fetch has returned by now: nothing of it may land
    for layer in range(1, L):
        assert not e.placed("b", layer, 0, 96).any()
    assert e.counters.totals()["load_late"] == 1


def test_saves_of_a_step_that_read_failed_kv_are_dropped(disk):
    spec, root = disk
    toks = tokens(64)
    saved(spec, [Request("a", toks)])
    e = Engine(spec, C)
    key = chunk_keys(toks, e.space)[0]
    entry_file(root, key.hex, 1).write_bytes(b"garbage")
    # b loads [0, 32) and fails; it also computes [32, 64) + 40 more tokens over the unloaded prefix
    b = Request("b", toks[:32] + tokens(72, seed=3))
    assert e.admit(b) == 32
    e.step([b])
    assert e.worker.flush(10)
    t = e.counters.totals()
    assert t["load_failed_requests"] == 1 and t["saves_skipped"] == 2 and t.get("saved_chunks", 0) == 0
    assert all(ref.key not in e.sched._known for s in e.last_plan.saves for ref in s.chunks)


def test_decode_chunks_are_saved(disk):
    spec, _ = disk
    e = Engine(spec, C)
    r = Request("a", tokens(60))
    e.admit(r)
    e.step([r])
    for _ in range(6):  # decode to 66 tokens: chunk [32, 64) completes at token 64
        r.all_token_ids.append(7)
        e.step([r], new=False)
    assert e.worker.flush(10)
    assert e.counters.totals()["saved_chunks"] == 2
    f = Engine(spec, C)
    assert f.admit(Request("b", list(r.all_token_ids) + [1, 2])) == 64


def test_planned_split_loads_only_the_planned_prefix(disk):
    spec, _ = disk
    toks = tokens(200)
    saved(spec, [Request("a", toks)])
    e = Engine(spec, C)
    # measurements: a load rate about as slow per token as a recompute, so loading all is not the best plan
    e.sched.on_report(WorkerReport(steps=[([(0, 512)], 0.5), ([(0, 128)], 0.125), ([(0, 2048)], 2.0)],
                                   loads=[(1000 * L, 10_000, 1000 * 1e-3)]))
    r = Request("b", list(toks))
    ext = e.admit(r)
    assert 0 < ext < 192 and ext % C == 0
    e.step([r])
    t = e.counters.totals()
    assert t["planned_load_tokens"] == ext and t["planned_recompute_tokens"] == 192 - ext
    assert t["split_requests"] == 1 and t["loaded_tokens"] == ext
    assert e.last_plan.loads[0].end == ext
