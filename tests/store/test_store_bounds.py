"""Bounded parsing of records: an entry larger than the caller's bound is refused before it is read (a 4 GiB sparse
file costs no memory), every malformed metadata field is ``ChunkCorrupt`` (never RecursionError, OverflowError, ...),
and a record's dtype must be the caller's."""
from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import xxhash

from kvtide.store import ChunkCorrupt, ChunkOversize, KeySpace, MemoryStore, chunk_keys, record_bytes_bound
from kvtide.store.auth import RecordAuth
from kvtide.store.base import META_MAX_BYTES, decode_record, encode_record
from kvtide.store.keys import token_bytes
from kvtide.store.zip_entry import from_tensor

ROOT = Path(__file__).resolve().parents[2]
SP = KeySpace("m", 16)
TOKENS = list(range(7000, 7016))
KEY = chunk_keys(TOKENS, SP)[0]
SHAPE = (2, 16, 2, 8)


def kv(seed: int = 0) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).bfloat16()


def crafted(meta: bytes, payload: bytes | None = None) -> bytes:
    """A version-4 record with this metadata and a valid checksum: what a buggy or hostile writer could store."""
    body = token_bytes(TOKENS) + (payload if payload is not None else kv().view(torch.uint8).numpy().tobytes())
    digest = xxhash.xxh3_128_intdigest(meta + body).to_bytes(16, "little")
    return struct.pack("<4sHHIQ16s", b"KVTR", 4, 0, len(meta), len(body), digest) + meta + body


def meta_with(**fields: object) -> bytes:
    m = {"key": KEY.hex, "layer": 1, "dtype": "bfloat16", "shape": list(SHAPE), "num_tokens": 16,
         "byteorder": sys.byteorder}
    m.update(fields)
    return json.dumps(m, separators=(",", ":")).encode()


def test_a_crafted_record_of_valid_fields_is_read() -> None:  # the helper makes records that pass: the cases
    assert torch.equal(decode_record(crafted(meta_with()), KEY, 1, TOKENS).view(torch.int16),  # below fail by
                       kv().view(torch.int16))  # their one bad field


DEEP = 30000
BAD_META = {
    "deep_list": b"[" * DEEP + b"]" * DEEP,
    "deep_in_field": meta_with()[:-1] + b',"x":' + b"[" * DEEP + b"]" * DEEP + b"}",
    "infinity_dim": meta_with().replace(b"[2,16,2,8]", b"[2,16,Infinity,8]"),
    "nan_tokens": meta_with().replace(b'"num_tokens":16', b'"num_tokens":NaN'),
    "float_overflow": meta_with().replace(b'"num_tokens":16', b'"num_tokens":1e400'),
    "float_dim": meta_with().replace(b"[2,16,2,8]", b"[2,16,2.0,8]"),
    "negative_dims": meta_with(shape=[2, 16, -2, -8]),
    "huge_dim": meta_with(shape=[2, 16, 2 ** 62, 8]),
    "huge_prod": meta_with(shape=[2, 16] + [2 ** 40] * 6),
    "too_many_dims": meta_with(shape=[2, 16] + [1] * 20),
    "huge_int_literal": meta_with().replace(b'"num_tokens":16', b'"num_tokens":' + b"9" * 5000),
    "shape_string": meta_with(shape="2,16,2,8"),
    "shape_object": meta_with(shape={"a": 1}),
    "shape_bools": meta_with(shape=[2, 16, True, 8]),
    "tokens_string": meta_with(num_tokens="16"),
    "layer_bool": meta_with(layer=True),
    "dtype_number": meta_with(dtype=5),
    "dtype_unknown": meta_with(dtype="complex128"),
    "meta_list": b"[1,2,3]",
    "meta_string": b'"KVTR"',
    "not_utf8": b"\xff\xfe\xfa" + meta_with(),
    "byteorder_number": meta_with(byteorder=5),
    "codec_number": meta_with(codec=7),
    "block_size_negative": meta_with(codec="zip1", block_size=-512),
    "truncated_json": meta_with()[:-5],
    "shape_not_kv": meta_with(shape=[16, 2, 2, 8]),
}


@pytest.mark.parametrize("case", sorted(BAD_META))
def test_malformed_metadata_is_chunk_corrupt(case: str) -> None:
    meta = BAD_META[case]
    assert len(meta) <= META_MAX_BYTES
    with pytest.raises(ChunkCorrupt):
        decode_record(crafted(meta), KEY, 1, TOKENS)


def test_metadata_longer_than_the_limit_is_refused_unparsed() -> None:
    rec = crafted(meta_with() + b" " * META_MAX_BYTES)
    with pytest.raises(ChunkCorrupt, match="metadata of"):
        decode_record(rec, KEY, 1, TOKENS)


def test_a_record_of_another_dtype_is_refused() -> None:
    """A uint8 record of the right shape: without the check it would be cast into the pages (garbage KV)."""
    rec = bytes(encode_record(KEY, 1, TOKENS, torch.randint(0, 255, SHAPE, dtype=torch.uint8)))
    assert decode_record(rec, KEY, 1, TOKENS).dtype == torch.uint8
    with pytest.raises(ChunkCorrupt, match="dtype uint8"):
        decode_record(rec, KEY, 1, TOKENS, dtype=torch.bfloat16)
    s = MemoryStore(1 << 20)
    s._poke(KEY.entry_name(1), rec)
    with pytest.raises(ChunkCorrupt):
        s.open(rec, KEY, 1, TOKENS, dtype=torch.bfloat16)
    assert s.stats.corrupt == 1 and not s.contains(KEY, 1)  # counted and deleted


def test_oversize_entries_fail_alone_in_a_fetch() -> None:
    s = MemoryStore(1 << 20)
    keys = chunk_keys(list(range(48)), SP)
    for c, k in enumerate(keys):
        s.put(k, 0, list(range(16 * c, 16 * (c + 1))), kv(c))
    big = bytes(encode_record(keys[1], 0, list(range(16, 32)), torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)))
    s._poke(keys[1].entry_name(0), big)
    bound = record_bytes_bound(SHAPE, torch.bfloat16, 16)
    f = s.fetch([(k, 0) for k in keys], max_bytes=bound)
    assert isinstance(f.blobs[1], ChunkOversize)
    assert not isinstance(f.blobs[0], Exception) and not isinstance(f.blobs[2], Exception)
    assert s.stats.oversize == 1 and not s.contains(keys[1], 0)
    with pytest.raises(ChunkOversize):
        decode_record(big, keys[1], 0, list(range(16, 32)), max_bytes=bound)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hashed", [False, True])
def test_record_bytes_bound_holds_every_record_of_the_shape(dtype: torch.dtype, hashed: bool) -> None:
    shape = (2, 16, 3, 64)
    auth = RecordAuth(b"k") if hashed else None
    x = (torch.randn(shape) * torch.logspace(-20, 20, 64)).to(dtype)  # wide exponents: raw ZipFusion blocks
    sizes = [len(encode_record(KEY, 29, TOKENS, x, auth=auth, store_token_ids=not hashed))]
    if dtype == torch.bfloat16:
        sizes.append(len(encode_record(KEY, 29, TOKENS, from_tensor(x), auth=auth, store_token_ids=not hashed)))
    bound = record_bytes_bound(shape, dtype, 16)
    assert max(sizes) <= bound < max(sizes) + 1024  # holds, and tight (a meta allowance, no more)


_SPARSE = textwrap.dedent("""
    import json, resource, sys
    import torch
    from kvtide.store import ChunkOversize, DiskStore, KeySpace, chunk_keys, record_bytes_bound
    C, shape = 256, (2, 256, 8, 64)  # a 512 KiB entry
    toks = list(range(2 * C))
    keys = chunk_keys(toks, KeySpace("m", C))
    s = DiskStore(sys.argv[1])
    s.put(keys[0], 0, toks[:C], torch.zeros(shape, dtype=torch.bfloat16))
    bound = record_bytes_bound(shape, torch.bfloat16, C)
    for _ in range(3):  # warm every path once on a good entry
        s.fetch([(keys[0], 0)], max_bytes=bound)
        s.get_entry(keys[0], 0, toks[:C], max_bytes=bound)

    def sparse():
        p = s.path(keys[1].entry_name(0))
        p.parent.mkdir(exist_ok=True)
        with open(p, "wb") as f:
            f.truncate(4 << 30)  # 4 GiB of holes: reading it would take 4 GiB of memory

    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sparse()
    before = rss()
    f = s.fetch([(keys[1], 0), (keys[0], 0)], max_bytes=bound)
    kinds = [type(b).__name__ for b in f.blobs]
    sparse()
    try:
        s.get_entry(keys[1], 0, toks[C:], max_bytes=bound)
        kinds.append("read")
    except ChunkOversize:
        kinds.append("ChunkOversize")
    print(json.dumps({"before": before, "after": rss(), "bound": bound, "kinds": kinds,
                      "oversize": s.stats.oversize}))
""")


def test_a_4gib_sparse_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", _SPARSE, str(tmp_path / "kv")], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["kinds"] == ["ChunkOversize", "bytes", "ChunkOversize"] and r["oversize"] == 2
    assert r["after"] - r["before"] <= r["bound"], r  # peak RSS grew by less than one expected record
    assert math.isfinite(r["after"])
