import dataclasses
import struct
import sys
import types
import zlib

import numpy as np
import pytest
import torch

from kvtide.transfer import ContainerError, Pipeline, decode
from kvtide.transfer.container import SUM_BYTES, VERSION, checksum
from kvtide.transfer.baselines import BASELINES
from kvtide.transfer.codecs import pack_bits, unpack_bits

L, T, H, D = 3, 70, 2, 64


def kv(seed: int = 0, t: int = T) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, 2, t, H, D, generator=g) * (0.2 + 3 * torch.rand(1, 2, 1, H, D, generator=g))
    x[0, 0, :, 0, 5] += 20.0  # an outlier channel, as real keys have
    return x.bfloat16()


SCORES = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.5, 0.4]])

LOSSLESS = ["none|none|none", "none|none|pack", "none|none|zstd", "none|none|zstd:l=19", "none|none|lz4",
            "none|none|lz4:l=12", "none|none|ans"]
LOSSY = [
    "delta|none|zstd", "hadamard|none|pack", "affine|none|ans",
    "none|uniform:k=8,v=8|pack", "none|uniform:k=3,v=5,kax=channel,g=16,r=4|ans",
    "hadamard|kivi|pack", "none|kivi:k=4,v=4|zstd", "affine|kivi:k=1,v=1|lz4", "delta:a=8|kivi:k=6,v=7,g=64|ans",
    "none|layer:b=8/4/2|ans", "hadamard|layer:b=5|zstd", "delta|layer:b=7/3,g=16,kax=channel|pack",
    "none|mixhq|ans", "hadamard|mixhq:hi=6,lo=1,frac=0.5|zstd", "none|mixhq:hi=16,lo=3|pack",
    *[s for s in BASELINES.values() if "zipf" not in s],
]


@pytest.mark.parametrize("spec", LOSSLESS)
def test_lossless_bit_exact(spec):
    x = kv(1)
    x.view(torch.int16)[0, 0, 0, 0, :8] = torch.tensor([0x7F80, -0x80, 0x7FC1, 0, -0x8000, 1, 0x8001 - 0x10000, 0x7F7F],
                                                        dtype=torch.int16)  # inf, -inf, nan, +-0, subnormals, max
    p = Pipeline(spec)
    blob = p.encode(x)
    y = p.decode(blob)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(y.view(torch.int16), x.view(torch.int16))
    assert p.lossless and p.error_bound(blob) == 0.0


def test_lossless_every_bf16_pattern():
    allbits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = allbits.view(torch.bfloat16).reshape(1, 2, 512, 2, 32)
    for spec in ("none|none|zstd", "none|none|ans", "none|none|lz4"):
        y = Pipeline(spec).decode(Pipeline(spec).encode(x))
        assert torch.equal(y.view(torch.int16), x.view(torch.int16)), spec


@pytest.mark.parametrize("spec", LOSSY)
def test_lossy_within_stated_bound(spec):
    x = kv(2)
    p = Pipeline(spec, head_scores=SCORES)
    blob = p.encode(x)
    y, mask = p.decode_with_mask(blob)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    err = (y.float() - x.float()).abs()
    if mask is not None:
        assert mask.shape == x.shape[:4]
        err = err * mask.unsqueeze(-1)
        assert not mask.all()
    bound = p.error_bound(blob)
    assert torch.all(err <= bound + 2.0**-8 * x.float().abs() + 1e-4 * x.float().abs().max()), (err.max(), bound)


def test_rough_accuracy_of_4bit():
    x = kv(3).float()
    for spec in ("none|kivi:k=4,v=4|pack", "hadamard|uniform:k=4,v=4|pack"):
        y = Pipeline(spec).decode(Pipeline(spec).encode(x.bfloat16())).float()
        assert ((y - x).norm() / x.norm()) < 0.1, spec


def test_ratio_ordering():
    x = kv(4, t=256)
    sizes = {s: len(Pipeline(s).encode(x)) for s in
             ["none|none|none", "none|kivi:k=4,v=4|pack", "none|kivi:k=2,v=2|pack", "none|kivi:k=2,v=2|ans"]}
    vals = list(sizes.values())
    assert vals[0] > vals[1] > vals[2] >= vals[3] * 0.98
    assert x.numel() * 2 / vals[2] > 3.0  # 2 bits + fp16 scale/min per 32 + 32 recent BF16 tokens of 256


def test_pruning_press_keeps_sink_and_window():
    x = kv(5)
    p = Pipeline("none|mixhq:hi=16,lo=0,frac=0.5,sink=4,win=16|none", head_scores=SCORES)
    y, mask = p.decode_with_mask(p.encode(x))
    # the 3 lowest-scored heads (of 6) are pruned: (0,1), (2,1), (1,0)
    for l, h in ((0, 1), (2, 1), (1, 0)):
        assert mask[l, :, :4, h].all() and mask[l, :, -16:, h].all() and not mask[l, :, 4:-16, h].any()
        assert (y[l, :, 4:-16, h] == 0).all()
    for l, h in ((0, 0), (1, 1), (2, 0)):
        assert mask[l, :, :, h].all() and torch.equal(y[l, :, :, h], x[l, :, :, h])


def test_mixhq_needs_scores():
    with pytest.raises(ValueError, match="head_scores"):
        Pipeline("none|mixhq|pack").encode(kv())
    with pytest.raises(ValueError, match="shaped"):
        Pipeline("none|mixhq|pack", head_scores=torch.ones(2, 2)).encode(kv())


def test_dict_and_short_inputs():
    d = {"a": kv(6), "b": kv(7, t=1), "c": kv(8, t=33)}
    p = Pipeline("hadamard|kivi:k=3,v=3|ans")
    blob = p.encode(d)
    out = p.decode(blob)
    assert set(out) == set(d)
    for k in d:
        assert out[k].shape == d[k].shape
    assert torch.equal(out["b"], Pipeline("hadamard|none|none").decode(Pipeline("hadamard|none|none").encode(d["b"])))


@pytest.mark.parametrize("bad", [torch.zeros(2, 2, 3, 1, 8), torch.zeros(2, 3, 3, 1, 8, dtype=torch.bfloat16),
                                 torch.zeros(2, 2, 0, 1, 8, dtype=torch.bfloat16), "x"])
def test_bad_inputs(bad):
    with pytest.raises((TypeError, ValueError)):
        Pipeline("none|none|none").encode(bad)


def test_bad_group_for_head_dim():
    with pytest.raises(ValueError):
        Pipeline("none|uniform:g=48|none").encode(kv())


@pytest.mark.parametrize("spec", ["none|none|zstd", "hadamard|kivi|ans", "none|layer|lz4", "none|none|none"])
def test_damaged_blobs_rejected(spec):
    p = Pipeline(spec)
    blob = p.encode(kv(9))
    rng = np.random.default_rng(0)
    for pos in list(rng.integers(0, len(blob), 20)) + [0, 5, 7, len(blob) - 1, len(blob) // 2]:
        b = bytearray(blob)
        b[pos] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(ContainerError):
            p.decode(bytes(b))
    for cut in (0, 3, 10, len(blob) // 3, len(blob) - 1):
        with pytest.raises(ContainerError):
            p.decode(blob[:cut])
    with pytest.raises(ContainerError):
        p.decode(blob + b"\0")
    with pytest.raises(ContainerError, match="magic"):
        p.decode(b"PK\x03\x04" + blob[4:])
    with pytest.raises(ContainerError):
        p.decode(b"")
    with pytest.raises(ContainerError):
        p.decode("not bytes")  # type: ignore[arg-type]


def test_wrong_version_and_foreign_spec():
    blob = bytearray(Pipeline("none|none|none").encode(kv()))
    blob[4] = 9
    body = bytes(blob[:-4])
    with pytest.raises(ContainerError, match="version"):
        decode(body + struct.pack("<I", zlib.crc32(body)))
    good = Pipeline("none|none|none").encode(kv())
    with pytest.raises(ContainerError, match="encoded with"):
        Pipeline("none|none|zstd").decode(good)
    assert torch.equal(decode(good), kv())


def test_valid_checksum_but_inconsistent_content():
    blob = bytes(Pipeline("none|none|none").encode(kv()))
    hl = struct.unpack_from("<I", blob, 6)[0]
    header = blob[10:10 + hl].replace(b'"shape":[3,2,70,2,64]', b'"shape":[3,2,71,2,64]')
    assert header != blob[10:10 + hl]
    body = blob[:6] + struct.pack("<I", len(header)) + header + blob[10 + hl:-SUM_BYTES[VERSION]]
    with pytest.raises(ContainerError, match="expected 109056 bytes, got 107520"):
        decode(body + checksum(body))


def test_version_1_containers_still_read():
    """Version 1 ended in a CRC-32 instead of XXH3-64: such a blob (e.g. an older store entry) still decodes."""
    x = kv()
    blob = bytes(Pipeline("none|kivi:k=2,v=2,g=32|zstd").encode(x))
    body = blob[:4] + bytes([1]) + blob[5:-SUM_BYTES[VERSION]]
    old = body + struct.pack("<I", zlib.crc32(body))
    assert torch.equal(decode(old).view(torch.int16), decode(blob).view(torch.int16))
    with pytest.raises(ContainerError, match="checksum"):
        decode(old[:-1] + bytes([old[-1] ^ 1]))


@pytest.mark.parametrize("bits", range(1, 9))
def test_bit_packing(bits):
    rng = np.random.default_rng(bits)
    for n in (0, 1, 7, 8, 9, 1000):
        c = rng.integers(0, 1 << bits, n).astype(np.uint8)
        assert np.array_equal(unpack_bits(pack_bits(c, bits), n, bits), c)
        assert len(pack_bits(c, bits)) == -(-n * bits // 8)


def test_zipfusion_wrapper_with_stand_in(monkeypatch):
    """The real kvtide.cache.zip_format may not exist yet: exercise the wrapper against a stand-in."""

    @dataclasses.dataclass
    class Encoded:
        data: torch.Tensor
        block_size: int

    mod = types.ModuleType("kvtide.cache.zip_format")
    mod.Encoded = Encoded
    mod.encode = lambda x, block_size=512: Encoded(x.view(torch.int16).clone(), block_size)
    mod.decode = lambda e: e.data.view(torch.bfloat16)
    import kvtide.cache
    monkeypatch.setitem(sys.modules, "kvtide.cache.zip_format", mod)
    monkeypatch.setattr(kvtide.cache, "zip_format", mod, raising=False)
    x = kv(10)
    for spec in ("none|none|zipf", "hadamard|kivi|zipf:bs=256", "none|kivi:r=5|zipf:bs=64"):
        p = Pipeline(spec)
        y = p.decode(p.encode(x))
        if p.lossless:
            assert torch.equal(y.view(torch.int16), x.view(torch.int16))


def test_zipfusion_real_if_present():
    pytest.importorskip("kvtide.cache.zip_format")
    x = kv(11, t=37)  # not a whole number of blocks: the wrapper pads
    for spec in ("none|none|zipf", "none|none|zipf:v=2", "none|none|zipf:bs=128"):
        p = Pipeline(spec)
        blob = p.encode(x)
        assert torch.equal(p.decode(blob).view(torch.int16), x.view(torch.int16))
        assert len(blob) < x.numel() * 2
    p = Pipeline("hadamard|kivi:k=4,v=4|zipf")
    blob = p.encode(x)
    assert (p.decode(blob).float() - x.float()).abs().max() <= p.error_bound(blob) + 2**-8 * x.float().abs().max()


def test_pack_takes_tensor_payloads_as_their_bytes():
    """A stream payload handed over as a uint8 tensor (as GPU codecs do) packs to the same blob as its bytes."""
    from kvtide.transfer.container import Entry, StreamRecord, pack, unpack
    raw = [bytes(range(7)), b"", bytes(range(200, 256)) * 3]

    def blob(as_tensor: list[bool]) -> bytes:
        recs = [StreamRecord(f"s{i}", "|u1", (len(r),), None, False,
                             torch.tensor(list(r), dtype=torch.uint8) if t else r)
                for i, (r, t) in enumerate(zip(raw, as_tensor))]
        return bytes(pack("none|none|none", [Entry(None, (300,), "bfloat16", {}, recs)]))

    want = blob([False, False, False])
    for mix in ([True, True, True], [True, False, True], [False, True, False]):
        assert blob(mix) == want
    _, entries = unpack(want)
    assert [bytes(s.payload) for s in entries[0].streams] == raw
    with pytest.raises(TypeError, match="uint8"):
        pack("none|none|none", [Entry(None, (1,), "bfloat16", {}, [
            StreamRecord("x", "<u2", (1,), None, False, torch.zeros(1, dtype=torch.int16))])])
