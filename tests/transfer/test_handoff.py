"""The per-layer hand-off (send_layers / receive_layers) over the in-process transport, the container written into
a caller's buffer, and the transport's buffer pool."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtide.transfer.container import pack_into
from kvtide.transfer.handoff import (HandoffError, LayerNotice, SendResult, capacity, codec_device, layer_capacity,
                                    receive_layers, send_layers)
from kvtide.transfer.pipeline import Pipeline
from kvtide.transfer.transport.inproc import InProcTransport
from kvtide.transfer.transport.pool import BufferPool

L, T, H, D = 4, 48, 2, 16
LOSSLESS = ("none|none|none", "none|none|zstd", "none|none|zipf")


def layers(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, T, H, D, generator=g).to(torch.bfloat16) for _ in range(L)]


def hand_off(kv: list[torch.Tensor], spec: str, staging_count: int = 2, tamper=None):
    a, b = InProcTransport(), InProcTransport()
    raw = kv[0].numel() * 2
    staging = [a.alloc(layer_capacity(raw)) for _ in range(staging_count)]
    buf = b.alloc(capacity(raw, L))
    pipe = Pipeline(spec)
    items = list(send_layers(lambda i: kv[i], L, pipe, "p", a, staging, buf.remote()))
    notices = [i for i in items if isinstance(i, LayerNotice)]
    if tamper is not None:
        tamper(buf, notices)
    got: dict[int, torch.Tensor] = {}
    res = receive_layers(notices, buf, pipe, L, (2, T, H, D), lambda i, x: got.__setitem__(i, x.clone()))
    return items[-1], res, got


@pytest.mark.parametrize("spec", LOSSLESS)
@pytest.mark.parametrize("staging_count", [1, 2])
def test_lossless_layers_arrive_bit_exact(spec, staging_count):
    kv = layers()
    sent, res, got = hand_off(kv, spec, staging_count)
    assert isinstance(sent, SendResult) and sent.layers == L and res.layers == L
    assert res.wire_bytes == sent.wire_bytes
    for i in range(L):
        assert torch.equal(got[i].view(torch.int16), kv[i].view(torch.int16)), f"layer {i} differs"


def test_a_flipped_byte_is_caught_by_its_digest():
    def flip(buf, notices):
        n = notices[2]
        buf.array[n.offset + n.nbytes // 2] ^= 0x40

    with pytest.raises(HandoffError) as e:
        hand_off(layers(), "none|none|none", tamper=flip)
    assert e.value.reason == "corrupt" and "layer 2" in str(e.value)


def test_a_blob_past_the_staging_buffer_is_refused():
    a, b = InProcTransport(), InProcTransport()
    kv = layers()
    staging = [a.alloc(1024)]
    buf = b.alloc(capacity(kv[0].numel() * 2, L))
    with pytest.raises(HandoffError) as e:
        list(send_layers(lambda i: kv[i], L, Pipeline("none|none|none"), "p", a, staging, buf.remote()))
    assert e.value.reason == "refused" and "staging" in str(e.value)


@pytest.mark.parametrize("spec", ["none|none|none", "none|none|zstd", "none|kivi:k=2,v=2,g=16,r=16|pack", "delta:a=16|layer:b=6/4/3,g=64|ans"])
def test_encode_into_writes_the_same_blob_as_encode(spec):
    kv = layers(1)[0].unsqueeze(0)
    pipe = Pipeline(spec)
    blob = pipe.encode(kv)
    out = np.full(len(blob) + 100, 0xAB, dtype=np.uint8)
    n = pipe.encode_into(kv, out)
    assert n == len(blob) and bytes(out[:n]) == bytes(blob)
    assert (out[n:] == 0xAB).all()  # nothing past the blob was touched
    small = np.zeros(len(blob) - 1, dtype=np.uint8)
    with pytest.raises(ValueError, match="takes"):
        pipe.encode_into(kv, small)
    assert not small.any()


def test_pack_into_refuses_a_read_only_buffer():
    with pytest.raises(ValueError, match="read-only"):
        pack_into(bytes(1 << 10), "none|none|none", [])


def test_buffer_pool_reuses_settled_buffers_within_its_bounds():
    t = InProcTransport()
    pool = BufferPool(t, max_buffers=2, max_bytes=3 << 20)
    a = pool.take(1 << 20)
    pool.give(a)
    assert pool.take(512 << 10) is a  # the smallest pooled buffer that fits
    pool.give(a)
    big = pool.take(2 << 20)
    assert big is not a
    pool.give(big)
    assert pool.held_bytes() == 3 << 20
    c = t.alloc(1 << 20)
    pool.give(c)  # past the byte bound: the smallest go
    assert pool.held_bytes() <= 3 << 20 and a.freed
    u = pool.take(4 << 20)
    pool.give(u, settled=False)  # a write may still land in it: freed, never handed out again
    assert u.freed and pool.take(4 << 20) is not u
    pool.close()
    assert big.freed and pool.held_bytes() == 0


def test_a_store_record_of_a_strided_layer_slice_equals_the_contiguous_one():
    from kvtide.store.keys import KeySpace, chunk_keys
    from kvtide.store.memory import MemoryStore

    kv = layers(2)[0]  # [2, T, H, D]: a chunk's slice along tokens is strided
    ids = list(range(T))
    k = chunk_keys(ids, KeySpace("m", 16))[1]
    view = kv[:, 16:32]
    assert not view.is_contiguous()
    a, b = MemoryStore(1 << 20), MemoryStore(1 << 20)
    a.put(k, 0, ids[16:32], view)
    b.put(k, 0, ids[16:32], view.contiguous())
    assert a.records() == b.records()
    assert torch.equal(a.get(k, 0, ids[16:32]).view(torch.int16), view.view(torch.int16))


@pytest.mark.parametrize("spec,gpu", [("none|none|none", False), ("none|none|zstd", False), ("none|none|zipf", False),
                                      ("none|none|nvzstd", True), ("none|kivi:k=2,v=2,g=32,r=32|pack", True),
                                      ("delta:a=16|layer:b=6/4/3,g=64|nvans", True)])
def test_codec_device_puts_computing_pipelines_on_the_gpu(spec, gpu):
    p = Pipeline(spec)
    assert codec_device(p, "cpu") is None and codec_device(p, None) is None
    assert codec_device(p, "cuda:0") == (torch.device("cuda:0") if gpu else None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", ["none|kivi:k=2,v=2,g=16,r=16|pack", "none|uniform:k=3,v=3,g=16|pack"])
def test_gpu_hand_off_equals_the_cpu_one(spec):
    """Layers read onto the GPU, encoded and decoded there, give the CPU hand-off's blobs and tensors."""
    kv = layers(3)
    _, _, cpu = hand_off(kv, spec)
    a, b = InProcTransport(), InProcTransport()
    raw = kv[0].numel() * 2
    staging = [a.alloc(layer_capacity(raw)) for _ in range(2)]
    buf = b.alloc(capacity(raw, L))
    pipe = Pipeline(spec)
    notices = [i for i in send_layers(lambda i: kv[i].cuda(), L, pipe, "p", a, staging, buf.remote())
               if isinstance(i, LayerNotice)]
    got: dict[int, torch.Tensor] = {}
    receive_layers(notices, buf, pipe, L, (2, T, H, D), lambda i, x: got.__setitem__(i, x.clone()), device="cuda")
    for i in range(L):
        assert got[i].device.type == "cpu"
        assert torch.equal(got[i].view(torch.int16), cpu[i].view(torch.int16)), f"layer {i} differs"
