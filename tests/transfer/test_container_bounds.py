"""Crafted transfer containers (valid checksum, hostile content): each is refused with a ContainerError naming
what is wrong, before anything large is allocated. See test_container_rss.py for the memory measurements."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from kvtide.transfer import ContainerError, Pipeline, decode
from kvtide.transfer.container import MAX_HEADER_BYTES
from transfer_blobs import join, kv, replace_stream, reseal, split, stream_payloads


def _edit(spec: str, fn, t: int = 24) -> bytes:
    """Encode a small KV with ``spec``, let ``fn`` edit the header dict in place, re-pack with a valid CRC."""
    header, payload = split(Pipeline(spec).encode(kv(0, t)))
    fn(header)
    return join(header, payload)


def _e(h):  # the single entry
    return h["entries"][0]


def _s(h, name="q.v"):
    return next(s for s in _e(h)["streams"] if s["name"] == name)


def _raw_header(spec: str, fn) -> bytes:
    header, payload = split(Pipeline(spec).encode(kv()))
    return join(fn(json.dumps(header).encode()), payload)


def _set(path, value):
    def fn(h):
        obj = h
        for k in path[:-1]:
            obj = obj[k] if not callable(k) else k(obj)
        obj[path[-1]] = value
    return fn


# (id, blob builder, message the ContainerError must match)
HEADER_CASES = [
    ("deep-json", lambda: _raw_header("none|none|none", lambda hb: hb[:-1] + b', "z": ' + b"[" * 50000
                                      + b"]" * 50000 + b"}"), "nested too deeply"),
    ("infinity-dim", lambda: _raw_header("none|none|none", lambda hb: hb.replace(b'"shape": [2, 2, 24, 2, 32]',
                                         b'"shape": [2, 2, Infinity, 2, 32]', 1)), "Infinity is not allowed"),
    ("nan-bits", lambda: _raw_header("none|none|none", lambda hb: hb.replace(b'"bits": null', b'"bits": NaN')),
     "NaN is not allowed"),
    ("huge-int-literal", lambda: _raw_header("none|none|none", lambda hb: hb.replace(b'"n": ', b'"n": ' + b"9" * 5000)),
     "not valid JSON"),
    ("not-utf8", lambda: _raw_header("none|none|none", lambda hb: hb.replace(b'"key"', b'"k\xff"')), "not valid JSON"),
    ("duplicate-key", lambda: _raw_header("none|none|none", lambda hb: hb.replace(b'"spec":', b'"spec": "x", "spec":')),
     "repeated key"),
    ("negative-dim", lambda: _edit("none|none|none", _set(["entries", 0, "shape"], [2, 2, -24, 2, -32])),
     r"entries\[0\]\.shape: expected ints"),
    ("negative-stream-dim", lambda: _edit("none|none|none", lambda h: _s(h).update(shape=[2, 2, -24, 2, -32])),
     r"streams\[0\]\.shape: expected ints"),
    ("float-dim", lambda: _edit("none|none|none", _set(["entries", 0, "shape"], [2, 2, 24.0, 2, 32])),
     r"entries\[0\]\.shape: expected ints"),
    ("bool-dim", lambda: _edit("none|none|none", _set(["entries", 0, "shape"], [2, True, 24, 2, 32])),
     r"entries\[0\]\.shape: expected ints"),
    ("huge-dims", lambda: _edit("none|none|none", _set(["entries", 0, "shape"], [2, 2, 10**30, 2, 32])),
     r"entries\[0\]\.shape: expected ints"),
    ("too-many-values", lambda: _edit("none|none|none", _set(["entries", 0, "shape"], [4096, 2, 4096, 64, 128])),
     "more than max_values"),
    ("too-many-dims", lambda: _edit("none|none|none", _set(["entries", 0, "shape"], [1] * 9)), "at most 8 dims"),
    ("streams-not-list", lambda: _edit("none|none|none", lambda h: _e(h).update(streams={"a": _e(h)["streams"]})),
     r"entries\[0\]\.streams: expected list, got dict"),
    ("entries-not-list", lambda: _edit("none|none|none", lambda h: h.update(entries="x")),
     r"header\.entries: expected list"),
    ("no-entries", lambda: _edit("none|none|none", lambda h: h.update(entries=[])), "at least one entry"),
    ("spec-not-str", lambda: _edit("none|none|none", lambda h: h.update(spec=3)), r"header\.spec: expected str"),
    ("header-not-object", lambda: _raw_header("none|none|none", lambda hb: b"[" + hb + b"]"),
     "header: expected an object"),
    ("missing-key", lambda: _edit("none|none|none", lambda h: _s(h).pop("bf16")), "expected keys"),
    ("extra-key", lambda: _edit("none|none|none", lambda h: _s(h).update(extra=1)), "expected keys"),
    ("bits-string", lambda: _edit("none|none|none", lambda h: _s(h).update(bits="4")), r"\.bits: expected int or null"),
    ("bf16-int", lambda: _edit("none|none|none", lambda h: _s(h).update(bf16=1)), r"\.bf16: expected bool"),
    ("n-negative", lambda: _edit("none|none|none", lambda h: _s(h).update(n=-1)), r"\.n: -1 bytes"),
    ("n-float", lambda: _edit("none|none|none", lambda h: _s(h).update(n=4096.0)), r"\.n: expected int"),
    ("n-past-end", lambda: _edit("none|none|none", lambda h: _s(h).update(n=10**9)), "run past the end"),
    ("dtype-subarray", lambda: _edit("none|none|none", lambda h: _s(h).update(dtype="(1000000000,)u1")),
     r"\.dtype: expected one of"),
    ("dtype-object", lambda: _edit("none|none|none", lambda h: _s(h).update(dtype="O")), r"\.dtype: expected one of"),
    ("dtype-big-endian", lambda: _edit("none|none|none", lambda h: _s(h).update(dtype=">u2")),
     r"\.dtype: expected one of"),
    ("bits-on-u2", lambda: _edit("none|none|none", lambda h: _s(h).update(bits=4)), r"\.bits: expected 1\.\.8"),
    ("stream-bigger-than-entry", lambda: _edit("none|none|none", lambda h: _s(h).update(shape=[2, 2, 48, 2, 32])),
     "more values than its entry"),
    ("duplicate-stream", lambda: _edit("none|none|none", lambda h: _e(h)["streams"].append(dict(_s(h), n=0))),
     "repeats an earlier stream"),
    ("duplicate-entry-key", lambda: _edit("none|none|none", lambda h: h["entries"].append(
        dict(_e(h), streams=[dict(_s(h), n=0)]))), "entry keys must be distinct"),
    ("flags", lambda: (lambda b: b[:5] + b"\x01" + b[6:])(_edit("none|none|none", lambda h: None)), None),
]


@pytest.mark.parametrize("make,match", [c[1:] for c in HEADER_CASES], ids=[c[0] for c in HEADER_CASES])
def test_crafted_header_rejected(make, match):
    blob = make()
    if match is None:  # the flags case: the CRC no longer matches either
        with pytest.raises(ContainerError):
            decode(blob)
        return
    with pytest.raises(ContainerError, match=match):
        decode(blob)
    with pytest.raises(ContainerError, match=match):
        Pipeline("none|none|none").decode(blob)


def test_header_length_bounded():
    blob = Pipeline("none|none|none").encode(kv())
    too_long = blob[:6] + struct.pack("<I", MAX_HEADER_BYTES + 1) + blob[10:]
    with pytest.raises(ContainerError, match="header length"):
        decode(reseal(too_long))


def test_max_values_is_the_callers_bound():
    x = kv()
    blob = Pipeline("none|none|zstd").encode(x)
    assert torch.equal(decode(blob, max_values=x.numel()).view(torch.int16), x.view(torch.int16))
    with pytest.raises(ContainerError, match="more than max_values"):
        decode(blob, max_values=x.numel() - 1)
    with pytest.raises(ContainerError, match="more than max_values"):
        Pipeline("none|none|zstd").decode(blob, max_values=100)


# --- what the pipeline's stages would meet: checked against the spec before decoding --------------------------
def _bm(v):
    return lambda h: _e(h)["meta"]["q"].update(bm=v)


LAYOUT_CASES = [
    ("entry-dtype", "none|none|none", lambda h: _e(h).update(dtype="float32"), "dtype 'float32', expected 'bfloat16'"),
    ("entry-4d", "none|none|none", lambda h: (_e(h).update(shape=[4, 24, 2, 32]), _s(h).update(shape=[4, 24, 2, 32])),
     r"expected \[layers, 2, tokens"),
    ("entry-kv-axis-3", "none|none|none", lambda h: (_e(h).update(shape=[2, 3, 16, 2, 32]),
                                                     _s(h).update(shape=[2, 3, 16, 2, 32])), r"expected \[layers, 2,"),
    ("stream-shape-not-entry", "none|none|none", lambda h: _s(h).update(shape=[2, 2, 32, 2, 24]),
     "stream 'q.v' is .* shape"),
    ("stream-prefix", "none|none|none", lambda h: _s(h).update(name="v"), "must start with 't.' or 'q.'"),
    ("meta-extra", "none|none|none", lambda h: _e(h)["meta"].update(z=1), "meta keys"),
    ("meta-x-not-bool", "none|none|none", lambda h: _e(h)["meta"]["q"].update(x=1), r"meta\.q\.x must be a bool"),
    ("bm-value", "none|uniform:k=3,v=3,g=16|pack", _bm([[[3, 17], [3, 3]], [[3, 3], [3, 3]]]), r"meta\.q\.bm must be"),
    ("bm-float", "none|uniform:k=3,v=3,g=16|pack", _bm([[[3, 3.0], [3, 3]], [[3, 3], [3, 3]]]), r"meta\.q\.bm must be"),
    ("bm-bool", "none|uniform:k=3,v=3,g=16|pack", _bm([[[3, True], [3, 3]], [[3, 3], [3, 3]]]), r"meta\.q\.bm must be"),
    ("bm-shape", "none|uniform:k=3,v=3,g=16|pack", _bm([[[3, 3], [3, 3]]]), r"meta\.q\.bm must be \[2\]\[2\]\[2\]"),
    ("bm-deep", "none|uniform:k=3,v=3,g=16|pack", _bm([[[[3]] * 2] * 2] * 2), r"meta\.q\.bm must be"),
    ("bm-class-without-streams", "none|uniform:k=3,v=3,g=16|pack", _bm([[[3, 5], [3, 3]], [[3, 3], [3, 3]]]),
     "quantizer streams"),
    ("code-bits", "none|uniform:k=3,v=3,g=16|pack", lambda h: _s(h, "q.0.3.c").update(bits=4), "stream 'q.0.3.c'"),
    ("scale-broadcast", "none|uniform:k=3,v=3,g=16|pack",
     lambda h: [_s(h, f"q.0.3.{k}").update(shape=[1, 1, 1, 96 * 16]) for k in "sm"], "does not broadcast"),
    ("side-shape", "affine|uniform:k=3,v=3,g=16|pack",
     lambda h: [_s(h, f"t.{k}").update(shape=[1, 1, 1, 1, 256]) for k in ("mu", "sd")], "stream 't.mu'"),
    ("side-missing", "affine|uniform:k=3,v=3,g=16|pack",
     lambda h: _e(h).update(streams=[s for s in _e(h)["streams"] if s["name"] != "t.mu"]), "side streams"),
    ("side-foreign", "none|none|none", lambda h: _e(h)["streams"].append(dict(_s(h), name="t.mu", n=0)),
     "side streams"),
]


@pytest.mark.parametrize("spec,fn,match", [c[1:] for c in LAYOUT_CASES], ids=[c[0] for c in LAYOUT_CASES])
def test_layout_checked_against_spec(spec, fn, match):
    header, payload = split(Pipeline(spec).encode(kv()))
    parts = {id(s): b for s, b in zip(header["entries"][0]["streams"], stream_payloads(header, payload).values())}
    fn(header)
    # re-cut the payload by stream record: cases drop streams or add empty ones
    body = b"".join(parts.get(id(s), b"")[: s["n"]] for s in header["entries"][0]["streams"])
    with pytest.raises(ContainerError, match=match):
        Pipeline(spec).decode(join(header, body))


def test_hadamard_matrix_bounded():
    """A head_dim of 2^20 would make the decoder build a 2^40-entry Hadamard matrix."""
    x = torch.zeros(1, 2, 1, 1, 2048, dtype=torch.bfloat16)
    blob = Pipeline("hadamard|none|none").encode(torch.zeros(1, 2, 1, 1, 8, dtype=torch.bfloat16))
    header, _ = split(blob)
    _e(header)["shape"] = list(x.shape)
    _s(header).update(shape=list(x.shape), n=x.numel() * 2)
    with pytest.raises(ContainerError, match="power-of-two head_dim <= 1024"):
        decode(join(header, bytes(x.numel() * 2)))


def test_invalid_spec_in_blob():
    for spec in ("foo|none|none", "none|kivi:k=" + "9" * 5000 + "|none"):
        blob = _edit("none|none|none", lambda h: h.update(spec=spec))
        with pytest.raises(ContainerError, match="invalid pipeline spec"):
            decode(blob)


# --- codecs: streams whose coded bytes disagree with their declared shape -------------------------------------
def _codec_blob(codec: str) -> tuple[bytes, bytes, int]:
    """(blob, the q.v stream's bytes, the raw bytes it must expand to)."""
    x = kv()
    blob = Pipeline(f"none|none|{codec}").encode(x)
    return blob, stream_payloads(*split(blob))["q.v"], x.numel() * 2


def _planes(x: torch.Tensor) -> bytes:
    return np.ascontiguousarray(x.view(torch.int16).numpy().view(np.uint16).ravel().view(np.uint8)
                                .reshape(-1, 2).T).tobytes()


def test_zstd_declared_size_must_match():
    import zstandard
    blob, _, size = _codec_blob("zstd")
    raw = _planes(kv())
    for bad, match in [
        (zstandard.ZstdCompressor().compress(raw + bytes(1000)), f"frame declares {size + 1000} bytes"),
        (zstandard.ZstdCompressor().compress(raw[:-2]), f"frame declares {size - 2} bytes"),
        (zstandard.ZstdCompressor(write_content_size=False).compress(raw + bytes(1000)), "cannot decompress"),
        (zstandard.ZstdCompressor(write_content_size=False).compress(raw[:-2]), f"holds {size - 2} bytes"),
        (zstandard.ZstdCompressor().compress(raw) + b"\0" * 8, "cannot decompress"),
        (zstandard.ZstdCompressor().compress(raw) * 2, "cannot decompress"),
        (b"\x28\xb5\x2f\xfd" + bytes(8), "zstd"),
        (b"", "zstd"),
    ]:
        with pytest.raises(ContainerError, match=match):
            decode(replace_stream(blob, "q.v", bad))
    good = zstandard.ZstdCompressor(write_content_size=False).compress(raw)  # size unknown but right: accepted
    assert torch.equal(decode(replace_stream(blob, "q.v", good)).view(torch.int16), kv().view(torch.int16))


def test_lz4_declared_size_must_match():
    import lz4.frame
    blob, _, size = _codec_blob("lz4")
    raw = _planes(kv())
    for bad, match in [
        (lz4.frame.compress(raw + bytes(1000)), f"frame declares {size + 1000} bytes"),
        (lz4.frame.compress(raw[:-2]), f"frame declares {size - 2} bytes"),
        (lz4.frame.compress(raw + bytes(1000), store_size=False), f"holds {size + 1}\\+ bytes"),
        (lz4.frame.compress(raw[:-2], store_size=False), f"holds {size - 2} bytes"),
        (lz4.frame.compress(raw) + b"\0" * 8, r"\+8 trailing"),
        (lz4.frame.compress(raw)[:-5], "lz4"),
        (b"\x04\x22\x4d\x18" + bytes(8), "lz4"),
        (b"", "lz4"),
    ]:
        with pytest.raises(ContainerError, match=match):
            decode(replace_stream(blob, "q.v", bad))
    good = lz4.frame.compress(raw, store_size=False)
    assert torch.equal(decode(replace_stream(blob, "q.v", good)).view(torch.int16), kv().view(torch.int16))


def _ans_planes(data: bytes) -> list[bytearray]:
    out, off = [], 0
    while off < len(data):
        (k,) = struct.unpack_from("<I", data, off)
        out.append(bytearray(data[off + 4: off + 4 + k]))
        off += 4 + k
    return out


def _ans_join(planes) -> bytes:
    return b"".join(struct.pack("<I", len(p)) + bytes(p) for p in planes)


def test_ans_counts_checked_before_the_native_decoder():
    blob, v, n_bytes = _codec_blob("ans")
    n = n_bytes // 2

    def plane0(fn):
        ps = _ans_planes(v)
        fn(ps[0])
        return _ans_join(ps)

    cases = [
        (plane0(lambda p: struct.pack_into("<I", p, 4, 2**32 - 1)), f"claims 4294967295 symbols.*holds {n}"),
        (plane0(lambda p: struct.pack_into("<I", p, 0, 16)), "alphabet 16, expected 256"),
        (plane0(lambda p: struct.pack_into("<I", p, 8, struct.unpack_from("<I", p, 8)[0] + 1)), "add up to"),
        (plane0(lambda p: p.__delitem__(slice(8 + 1024 + 4, None))), f"cannot hold {n} symbols"),
        (plane0(lambda p: p.__delitem__(slice(len(p) - 2, None))), "multiple of 4"),
        (plane0(lambda p: p.__delitem__(slice(6, None))), "shorter than its 8-byte header|expected 1032"),
        (v + b"\0\0\0", "after the last byte plane"),
        (v[:len(v) - 3], "claims .* bytes|truncated"),
        (struct.pack("<I", 1 << 30) + v[4:], "claims 1073741824 bytes"),
        (b"", "truncated"),
    ]
    for bad, match in cases:
        with pytest.raises(ContainerError, match=match):
            decode(replace_stream(blob, "q.v", bad))


def test_ans_code_stream_count():
    spec = "none|uniform:k=3,v=3,g=16|ans"
    blob = Pipeline(spec).encode(kv())
    c = bytearray(stream_payloads(*split(blob))["q.0.3.c"])
    struct.pack_into("<I", c, 4, 2**32 - 1)
    with pytest.raises(ContainerError, match="claims 4294967295 symbols"):
        Pipeline(spec).decode(replace_stream(blob, "q.0.3.c", bytes(c)))


def test_packed_codes_exact_length():
    spec = "none|uniform:k=3,v=3,g=16|pack"
    blob = Pipeline(spec).encode(kv())
    c = stream_payloads(*split(blob))["q.0.3.c"]
    for bad in (c + b"\0", c[:-1]):
        with pytest.raises(ContainerError, match="3-bit code stream of 3072 codes: expected 1152 bytes"):
            Pipeline(spec).decode(replace_stream(blob, "q.0.3.c", bad))


def test_zipf_stream_checked():
    pytest.importorskip("kvtide.cache.zip_format")
    from kvtide.cache import zip_format
    from kvtide.transfer.codecs import _serialise
    x = kv()
    blob = Pipeline("none|none|zipf").encode(x)
    v = stream_payloads(*split(blob))["q.v"]
    flat = torch.cat([x.reshape(-1), torch.zeros(-x.numel() % 512, dtype=torch.bfloat16)])
    e = zip_format.encode(flat, block_size=512)
    other_bs = _serialise(zip_format.encode(flat, block_size=256))
    wrong_shape = _serialise(zip_format.Encoded(e.data, e.starts, e.desc, (1 << 40,), 512))
    for bad, match in [(b"F" + v[1:], "stream encoding b'F'"), (v[:1] + b"garbage", "bad stream"),
                       (other_bs, "block_size 256, expected 512"), (wrong_shape, "shape"), (v[:-10], "bad stream"),
                       (b"", "stream encoding")]:
        with pytest.raises(ContainerError, match=match):
            decode(replace_stream(blob, "q.v", bad))
    assert torch.equal(decode(blob).view(torch.int16), x.view(torch.int16))


def test_ans_stream_of_real_codes_below_their_entropy_decodes():
    """Real 6-bit KV codes (CacheGen-like, a SmolLM2 layer) whose rANS words come out 248 bits under the counts'
    empirical information: the decoder's bound must let them through, bit-exact."""
    from pathlib import Path

    import numpy as np

    from kvtide.transfer import rans

    sym = np.load(Path(__file__).with_name("ans_real_codes.npz"))["sym"]
    blob = rans.encode(sym, 64)
    assert (rans.decode(memoryview(blob), 64, sym.size) == sym).all()
