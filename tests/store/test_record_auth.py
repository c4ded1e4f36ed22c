"""Authenticated records: with a secret only records carrying its MAC are used; forged ones are counted, deleted and
logged. Without one a shared tier says once that it is trusted. Token ids can be kept out of records."""
from __future__ import annotations

import logging
import struct
from pathlib import Path

import pytest
import torch

from kvtide.config import RestoreConfig
from kvtide.log import reset_limits
from kvtide.store import ChunkForged, DiskStore, KeySpace, MemoryStore, TokenMismatch, chunk_keys
from kvtide.store.auth import SECRET_ENV, RecordAuth
from kvtide.store.base import FLAG_KEYED, FLAG_TOKEN_HASH, HEADER_BYTES, decode_record, encode_record
from kvtide.store.keys import token_bytes

SP = KeySpace("m", 16)
TOKENS = list(range(3000, 3032))
KEYS = chunk_keys(TOKENS, SP)


def toks(c: int) -> list[int]:
    return TOKENS[16 * c:16 * (c + 1)]


def kv(seed: int) -> torch.Tensor:
    return torch.randn(2, 16, 2, 8, generator=torch.Generator().manual_seed(seed)).bfloat16()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture(autouse=True)
def _no_env_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    reset_limits()


def test_swapped_kv_with_a_valid_plain_digest_is_rejected_with_a_secret() -> None:
    """Another chunk's KV under this entry's key, layer and tokens, with a correct XXH3 digest: accepted by a store
    without a secret (all it can check), rejected as forged, counted and deleted by one with a secret."""
    forged = bytes(encode_record(KEYS[0], 3, toks(0), kv(1)))  # chunk 1's KV, chunk 0's name, tokens and layer
    plain = MemoryStore(1 << 20)
    plain._poke(KEYS[0].entry_name(3), forged)
    assert same(plain.get(KEYS[0], 3, toks(0)), kv(1))  # what an unauthenticated tier cannot tell apart

    s = MemoryStore(1 << 20, secret="s3cret")
    s.put(KEYS[0], 3, toks(0), kv(0))
    assert same(s.get(KEYS[0], 3, toks(0)), kv(0))
    s._poke(KEYS[0].entry_name(3), forged)
    with pytest.raises(ChunkForged, match="no MAC"):
        s.get(KEYS[0], 3, toks(0))
    assert s.stats.forged == 1 and s.stats.hits == 1
    assert not s.contains(KEYS[0], 3)  # deleted: rewritten rather than re-failed


def test_another_secrets_records_and_legacy_versions_are_forged() -> None:
    mine = RecordAuth(b"mine")
    theirs = bytes(encode_record(KEYS[0], 0, toks(0), kv(0), auth=RecordAuth(b"theirs")))
    with pytest.raises(ChunkForged, match="MAC mismatch"):
        decode_record(theirs, KEYS[0], 0, toks(0), auth=mine)
    legacy = bytearray(encode_record(KEYS[0], 0, toks(0), kv(0)))
    struct.pack_into("<H", legacy, 4, 3)  # the same bytes as version 3 wrote them: valid there
    assert same(decode_record(bytes(legacy), KEYS[0], 0, toks(0)), kv(0))
    with pytest.raises(ChunkForged):
        decode_record(bytes(legacy), KEYS[0], 0, toks(0), auth=mine)
    # a keyed record where no secret is known cannot be checked: never used
    with pytest.raises(ChunkForged, match="has none"):
        decode_record(theirs, KEYS[0], 0, toks(0))


@pytest.mark.parametrize("where", ["flags", "meta_len", "meta", "tokens", "payload"])
def test_the_mac_covers_header_fields_meta_and_body(where: str) -> None:
    auth = RecordAuth(b"k")
    rec = bytearray(encode_record(KEYS[0], 1, toks(0), kv(0), auth=auth))
    assert struct.unpack_from("<H", rec, 6)[0] == FLAG_KEYED
    meta_len = struct.unpack_from("<I", rec, 8)[0]
    if where == "flags":
        struct.pack_into("<H", rec, 6, FLAG_KEYED | FLAG_TOKEN_HASH)
    elif where == "meta_len":  # shift the meta/body split (body_len too, so the length still adds up)
        struct.pack_into("<IQ", rec, 8, meta_len - 4, struct.unpack_from("<Q", rec, 12)[0] + 4)
    else:
        rec[{"meta": HEADER_BYTES + 2, "tokens": HEADER_BYTES + meta_len + 1, "payload": len(rec) - 1}[where]] ^= 1
    with pytest.raises(ChunkForged, match="MAC mismatch"):
        decode_record(bytes(rec), KEYS[0], 1, toks(0), auth=auth)


def test_secret_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "from-env")
    s = MemoryStore(1 << 20)
    assert s.authenticated
    s.put(KEYS[1], 0, toks(1), kv(2))
    blob = s._read(KEYS[1].entry_name(0))
    decode_record(blob, KEYS[1], 0, toks(1), auth=RecordAuth(b"from-env"))  # signed with it
    with pytest.raises(ChunkForged):
        decode_record(blob, KEYS[1], 0, toks(1), auth=RecordAuth(b"other"))
    monkeypatch.delenv(SECRET_ENV)
    assert not MemoryStore(1 << 20).authenticated
    with pytest.raises(ValueError):
        MemoryStore(1 << 20, secret="")


def test_a_shared_tier_without_a_secret_warns_once(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, "kvtide")
    d = DiskStore(tmp_path / "kv")
    for i in range(3):
        d.put(KEYS[0], i, toks(0), kv(i))
        d.get(KEYS[0], i, toks(0))
    trusted = [r for r in caplog.records if "no store secret" in r.getMessage()]
    assert len(trusted) == 1 and str(tmp_path) in trusted[0].getMessage()
    caplog.clear()
    m = MemoryStore(1 << 20)  # in-process: nobody else writes it
    m.put(KEYS[0], 0, toks(0), kv(0))
    DiskStore(tmp_path / "kv2", secret="x").put(KEYS[0], 0, toks(0), kv(0))
    assert not [r for r in caplog.records if "no store secret" in r.getMessage()]


def test_forged_entries_are_logged_rate_limited(caplog) -> None:
    caplog.set_level(logging.WARNING, "kvtide")
    s = MemoryStore(1 << 20, secret="k")
    for i in range(5):
        s._poke(KEYS[0].entry_name(i), bytes(encode_record(KEYS[0], i, toks(0), kv(i))))
        with pytest.raises(ChunkForged):
            s.get(KEYS[0], i, toks(0))
    lines = [r for r in caplog.records if "ChunkForged" in r.getMessage()]
    assert len(lines) == 1 and s.stats.forged == 5


@pytest.mark.parametrize("secret", [None, "k"])
def test_token_ids_kept_out_of_records(secret: str | None) -> None:
    s = MemoryStore(1 << 20, drop_bad=False, secret=secret, store_token_ids=False)
    s.put(KEYS[0], 0, toks(0), kv(0))
    blob = s._read(KEYS[0].entry_name(0))
    assert token_bytes(toks(0)) not in blob  # the prompt cannot be read back from the record
    assert struct.unpack_from("<H", blob, 6)[0] & FLAG_TOKEN_HASH
    assert same(s.get(KEYS[0], 0, toks(0)), kv(0))
    with pytest.raises(TokenMismatch):
        s.get(KEYS[0], 0, toks(0)[:-1] + [7])
    # a reader that stores ids itself still reads hashed records (the flag says which)
    s.configure_records(secret, store_token_ids=True)
    assert same(s.get(KEYS[0], 0, toks(0)), kv(0))


def test_keyed_token_hash_differs_per_secret() -> None:
    a = bytes(encode_record(KEYS[0], 0, toks(0), kv(0), auth=RecordAuth(b"a"), store_token_ids=False))
    b = bytes(encode_record(KEYS[0], 0, toks(0), kv(0), auth=RecordAuth(b"b"), store_token_ids=False))
    meta_len = struct.unpack_from("<I", a, 8)[0]
    start = HEADER_BYTES + meta_len
    assert a[start:start + 32] != b[start:start + 32]


def test_secret_stays_out_of_config_repr_and_keys_depend_on_it() -> None:
    cfg = RestoreConfig(secret="hunter2")
    assert "hunter2" not in repr(cfg)
    with pytest.raises(ValueError, match="secret"):
        RestoreConfig(secret="")
    a = KeySpace("m", 16, salt=RecordAuth(b"a").key_salt)
    b = KeySpace("m", 16, salt=RecordAuth(b"b").key_salt)
    assert chunk_keys(TOKENS, a)[0] != chunk_keys(TOKENS, b)[0] != chunk_keys(TOKENS, SP)[0]
