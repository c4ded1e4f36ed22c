"""Device-generic pipelines and the nvCOMP codecs (kvtide.transfer.nvcodecs) against their CPU references.

The first half runs everywhere (CI has no GPU): the torch bit packing equals the numpy one, the tensor decode path
equals the numpy one, and the nv* stages' CPU formats round-trip and refuse malformed streams. The second half needs
CUDA (and nvCOMP for the nv* stages) and skips without them: GPU-encoded blobs equal CPU-encoded ones where the
stages are exact, decode on the other side, and nvCOMP's streams round-trip bit-exactly.
"""
from __future__ import annotations

import struct
import time

import numpy as np
import pytest
import torch

from kvtide.transfer import nvcodecs
from kvtide.transfer.codecs import pack_bits, pack_bits_t, unpack_bits, unpack_bits_t, unwire, wire_bytes
from kvtide.transfer.errors import ContainerError
from kvtide.transfer.pipeline import Pipeline
from kvtide.transfer.stage import Stream

from transfer_blobs import kv, replace_stream, split, stream_payloads

SCORES = torch.arange(4.0).reshape(2, 2)
EXACT_SPECS = ["none|none|none", "none|uniform:k=3,v=3,g=32|pack", "none|kivi:k=2,v=2,g=32|pack",
               "delta|uniform:k=5,v=6,g=8|none", "none|mixhq:hi=8,lo=0,g=16,r=4,sink=2,win=4|pack",
               "none|layer:b=8/4|zstd", "none|uniform:k=7,v=16,g=32|ans"]
CUDA = torch.cuda.is_available()
NVCOMP = CUDA and nvcodecs.nvcomp_module() is not None
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
needs_nvcomp = pytest.mark.skipif(not NVCOMP, reason="needs CUDA and nvidia-nvcomp-cu13")


@pytest.mark.parametrize("bits", range(1, 9))
def test_torch_bit_packing_equals_numpy(bits):
    g = np.random.default_rng(bits)
    for n in (0, 1, 7, 8, 9, 1001):
        c = g.integers(0, 1 << bits, n, dtype=np.uint8)
        packed = pack_bits_t(torch.from_numpy(c), bits).numpy().tobytes()
        assert packed == pack_bits(c, bits)
        back = unpack_bits_t(torch.frombuffer(bytearray(packed), dtype=torch.uint8) if packed else
                             torch.zeros(0, dtype=torch.uint8), n, bits)
        assert np.array_equal(back.numpy(), unpack_bits(packed, n, bits))
        assert np.array_equal(back.numpy(), c)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.float16, np.float32])
def test_wire_bytes_round_trip(dtype):
    a = np.frombuffer(np.random.default_rng(1).bytes(96 * np.dtype(dtype).itemsize), dtype).reshape(8, 12)
    raw = wire_bytes(Stream(a, bf16=dtype == np.uint16))
    back = unwire(raw, np.dtype(dtype), a.shape, None)
    got = back.numpy().view(np.uint16) if dtype == np.uint16 else back.numpy()
    assert got.tobytes() == a.tobytes()
    empty = unwire(wire_bytes(Stream(a[:0])), np.dtype(dtype), (0, 12), None)  # no bytes: any itemsize
    assert tuple(empty.shape) == (0, 12)


@pytest.mark.parametrize("spec", EXACT_SPECS + ["hadamard|kivi:k=4,v=4,g=32|pack", "affine|uniform:k=4,v=4,g=32|lz4"])
def test_tensor_decode_path_equals_numpy_path(spec):
    p = Pipeline(spec, head_scores=SCORES)
    blob = p.encode(kv(1, 40))
    a, ma = p.decode_with_mask(blob)
    b, mb = p.decode_with_mask(blob, device="cpu")
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert (ma is None and mb is None) or torch.equal(ma, mb)


@pytest.mark.parametrize("codec", ["nvzstd", "nvlz4"])
@pytest.mark.parametrize("qt", ["none|none", "none|kivi:k=2,v=2,g=32", "hadamard|uniform:k=3,v=3,g=32"])
def test_shared_format_codecs_on_the_cpu(codec, qt):
    """nvzstd / nvlz4 code on the CPU in nvCOMP's format; decoding equals the same pipeline with a CPU codec."""
    x = kv(2, 40)
    ref = Pipeline(f"{qt}|pack")
    p = Pipeline(f"{qt}|{codec}")
    out = p.decode(p.encode(x))
    assert torch.equal(out.view(torch.int16), ref.decode(ref.encode(x)).view(torch.int16))
    assert torch.equal(out.view(torch.int16), p.decode(p.encode(x), device="cpu").view(torch.int16))


def test_nvans_without_gpu_names_the_package(monkeypatch):
    monkeypatch.setattr(nvcodecs, "nvcomp_module", lambda: None)
    with pytest.raises(nvcodecs.NvcompMissing, match="nvidia-nvcomp-cu13"):
        Pipeline("none|none|nvans").encode(kv())


def _ans_chunk(declared: int, body: bytes = b"\0" * 8) -> bytes:
    return nvcodecs._frame_host([struct.pack("<Q", declared) + body])


def test_nvans_chunk_framing_checked_in_full():
    n = nvcodecs.ANS_CHUNK
    good = _ans_chunk(n) + _ans_chunk(n) + _ans_chunk(5)
    assert [k for _, k in nvcodecs.ans_chunks(good, 2 * n + 5)] == [16, 16, 16]
    odd = _ans_chunk(n, b"\0" * 9)  # 17 coded bytes: 15 bytes of padding follow
    assert len(odd) == 48 and [k for _, k in nvcodecs.ans_chunks(odd + _ans_chunk(n) + _ans_chunk(5), 2 * n + 5)] == [
        17, 16, 16]
    for bad, msg in ((good[:-1], "claims"), (good + b"\0", "after the last"), (_ans_chunk(n) + _ans_chunk(5), "declares"),
                     (good[:40], "truncated"), (struct.pack("<I", 1 << 31) + good[4:], "claims"),
                     (good[:8] + b"\1" + good[9:], "not zeros"), (odd[:-1] + b"\1" + good[32:], "not zeros")):
        with pytest.raises(ContainerError, match=msg):
            nvcodecs.ans_chunks(bad, 2 * n + 5)


def test_malformed_nv_streams_rejected_before_decoding():
    c = nvcodecs.NvZstd()
    raw = np.arange(256, dtype=np.uint8)
    good = c.encode(Stream(raw))
    assert np.array_equal(c.decode(good, np.dtype("|u1"), (256,), None, False), raw)
    with pytest.raises(ContainerError, match="declares 256 bytes"):
        c.decode(good, np.dtype("|u1"), (128,), None, False)
    with pytest.raises(ContainerError):
        c.decode(good[:-3], np.dtype("|u1"), (256,), None, False)
    import zstandard
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(raw.tobytes())
    with pytest.raises(ContainerError, match="declares"):
        c.decode(nvcodecs._frame_host([no_size]), np.dtype("|u1"), (256,), None, False)
    with pytest.raises(ContainerError, match="claims"):  # a bare frame, no chunk framing
        c.decode(no_size, np.dtype("|u1"), (256,), None, False)
    lz = nvcodecs.NvLz4()
    g = lz.encode(Stream(raw))
    with pytest.raises(ContainerError):
        lz.decode(g, np.dtype("|u1"), (255,), None, False)
    with pytest.raises(ContainerError, match="coded bytes"):
        lz.decode(b"\0" * 400, np.dtype("|u1"), (256,), None, False)
    ans = nvcodecs.NvAns()  # the declared sizes are checked before any decoder (or the missing-package error)
    with pytest.raises(ContainerError, match="declares"):
        ans.decode(_ans_chunk(1 << 40), np.dtype("|u1"), (256,), None, False)
    with pytest.raises(ContainerError, match="truncated"):
        ans.decode(b"\1\2", np.dtype("|u1"), (256,), None, False)
    with pytest.raises(ContainerError):
        c.decode(b"x", np.dtype("|u1"), (0,), None, False)
    assert c.encode(Stream(raw[:0])) == b""


def test_damaged_nv_payloads_are_container_errors():
    """A resealed blob whose nvzstd payload is cut or damaged fails as a ContainerError, never as garbage."""
    p = Pipeline("none|kivi:k=2,v=2,g=32|nvzstd")
    blob = p.encode(kv(3, 40))
    head, payload = split(blob)
    for name, data in stream_payloads(head, payload).items():
        assert len(data) > 8, name
        for bad in (data[:-5], b"\0\0\0\0" + data[4:], data + b"\0"):
            with pytest.raises(ContainerError):
                p.decode(replace_stream(blob, name, bad))


# --- CUDA --------------------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("spec", EXACT_SPECS)
def test_gpu_encode_equals_cpu_encode(spec):
    """Exact stages give the same blob on the GPU as on the CPU, and either side decodes it to the same bits."""
    x = kv(4, 40)
    p = Pipeline(spec, head_scores=SCORES)
    cpu, gpu = p.encode(x), p.encode(x.cuda())
    assert gpu == cpu
    assert torch.equal(p.decode(gpu, device="cuda").cpu().view(torch.int16), p.decode(cpu).view(torch.int16))


@needs_cuda
@pytest.mark.parametrize("spec", ["hadamard|kivi:k=4,v=4,g=32|pack", "affine|uniform:k=4,v=4,g=32|pack"])
def test_gpu_float_transforms_within_bound(spec):
    """hadamard/affine may round differently on the GPU; the decode still meets the blob's own stated bound."""
    x = kv(5, 40)
    p = Pipeline(spec)
    blob = p.encode(x.cuda())
    out = p.decode(blob).float()
    ref = x.float()
    bound = p.error_bound(blob)
    assert float((out - ref).abs().max()) <= bound + 2.0**-8 * float(ref.abs().max())


@needs_nvcomp
@pytest.mark.parametrize("codec", ["nvzstd", "nvlz4", "nvans"])
@pytest.mark.parametrize("qt", ["none|none", "none|kivi:k=2,v=2,g=32", "none|uniform:k=3,v=3,g=32"])
def test_nvcomp_round_trip_and_cross_decode(codec, qt):
    x = kv(6, 256)
    p = Pipeline(f"{qt}|{codec}")
    ref = Pipeline(f"{qt}|pack")
    want = ref.decode(ref.encode(x)).view(torch.int16)
    blob = p.encode(x.cuda())
    assert torch.equal(p.decode(blob, device="cuda").cpu().view(torch.int16), want)
    if codec != "nvans":  # the shared formats: GPU -> CPU and CPU -> GPU
        assert torch.equal(p.decode(blob).view(torch.int16), want)
        assert torch.equal(p.decode(p.encode(x), device="cuda").cpu().view(torch.int16), want)


def test_nvzstd_chunks_are_standard_zstd_frames():
    """Every nvzstd chunk is a plain zstd frame of ZSTD_CHUNK bytes (the last one shorter) that zstandard decodes."""
    import zstandard
    n = 2 * nvcodecs.ZSTD_CHUNK + 77
    raw = np.random.default_rng(3).integers(0, 4, n, dtype=np.uint8)
    enc = nvcodecs.NvZstd().encode(Stream(raw))
    spans = nvcodecs.chunk_spans(enc, n, nvcodecs.ZSTD_CHUNK, zstandard.frame_content_size, "nvzstd")
    assert len(spans) == 3
    out = b"".join(zstandard.ZstdDecompressor().decompress(enc[o: o + k]) for o, k in spans)
    assert out == raw.tobytes()
    assert np.array_equal(nvcodecs.NvZstd().decode(enc, np.dtype("|u1"), (n,), None, False), raw)


@needs_nvcomp
def test_nvzstd_gpu_stream_is_standard_zstd_frames():
    import zstandard
    n = (1 << 20) + 5
    raw = torch.randint(0, 4, (n,), dtype=torch.uint8, device="cuda")
    enc = nvcodecs.NvZstd().encode(Stream(raw))
    spans = nvcodecs.chunk_spans(enc, n, nvcodecs.ZSTD_CHUNK, zstandard.frame_content_size, "nvzstd")
    out = b"".join(zstandard.ZstdDecompressor().decompress(enc[o: o + k]) for o, k in spans)
    assert out == raw.cpu().numpy().tobytes()
    dev = nvcodecs.NvZstd().encode_device(Stream(raw))
    assert dev.is_cuda and dev.cpu().numpy().tobytes() == enc


@needs_nvcomp
@pytest.mark.parametrize("codec", [nvcodecs.NvZstd, nvcodecs.NvAns, nvcodecs.NvLz4])
def test_nvcomp_malformed_streams_rejected_on_gpu(codec):
    c = codec()
    raw = torch.randint(0, 16, (4096,), dtype=torch.uint8, device="cuda")
    enc = c.encode(Stream(raw))
    back = c.decode_tensor(enc, np.dtype("|u1"), (4096,), None, False, "cuda")
    assert torch.equal(back, raw)
    with pytest.raises(ContainerError):
        c.decode_tensor(enc, np.dtype("|u1"), (2048,), None, False, "cuda")
    if codec is nvcodecs.NvAns:  # nvCOMP's ANS decoder is not hardened against damaged payloads (see nvcodecs)
        return
    bad = bytearray(enc)
    for i in range(len(bad) // 2, len(bad)):
        bad[i] ^= 0x5A
    try:  # damage past the size fields: an error, or (an entropy coder cannot always tell) other bytes
        out = c.decode_tensor(bytes(bad), np.dtype("|u1"), (4096,), None, False, "cuda")
        assert out.numel() == 4096
    except ContainerError:
        pass


@needs_nvcomp
def test_nvcomp_throughput_sanity():
    """nvans codes 64 MB (64 chunks) of 4-bit codes on the GPU well above the CPU rANS codec's rate (> 1 GB/s each
    way; the CPU ``ans`` stage codes about a tenth of that)."""
    raw = torch.randint(0, 16, (64 << 20,), dtype=torch.uint8, device="cuda")
    c = nvcodecs.NvAns()
    s = Stream(raw, bits=8)
    enc = c.encode(s)
    c.decode_tensor(enc, np.dtype("|u1"), tuple(raw.shape), 8, False, "cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    enc = c.encode(s)
    te = time.perf_counter() - t
    t = time.perf_counter()
    back = c.decode_tensor(enc, np.dtype("|u1"), tuple(raw.shape), 8, False, "cuda")
    torch.cuda.synchronize()
    td = time.perf_counter() - t
    assert torch.equal(back, raw)
    assert raw.numel() / te > 1e9 and raw.numel() / td > 1e9, (te, td)
    assert len(enc) < 0.6 * raw.numel()
