"""Redis tier as a service meets it: credentials, TLS, db, TTL and prefix from the URL; a server down at start is one
warning, not an error; bounded reads (an oversized value is not transferred); per-entry failures stay per entry;
a stalled server costs one timeout per operation and then nothing while its breaker is open."""
from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from kvtide.log import reset_limits
from kvtide.store import ChunkMissing, KeySpace, StoreUnavailable, chunk_keys
from kvtide.store.base import ChunkOversize, EntryUnreadable, StoreError
from kvtide.store.breaker import TierSkipped
from kvtide.store.factory import check_spec, open_tier
from kvtide.store.writer import StoreWriter
from tests.store.redis_procs import Server

KEYS = chunk_keys(list(range(64)), KeySpace("redis-hardening", 16))
TOK = list(range(16))


def kv(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 16, 1, 8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path)
    yield srv
    srv.stop()


def raw(port: int, db: int = 0, **kw):
    import redis

    return redis.Redis(port=port, db=db, socket_timeout=2, **kw)


def test_password_in_the_url_is_used_and_a_missing_one_is_a_counted_failure(tmp_path: Path, caplog) -> None:
    srv = Server(tmp_path, "--requirepass", "s3 cr@t", "--user", "kv", "on", ">pw2", "~*", "&*", "+@all")
    try:
        for url in (f"redis://:s3%20cr%40t@127.0.0.1:{srv.port}/0", f"redis://kv:pw2@127.0.0.1:{srv.port}"):
            s = open_tier(url)
            assert s.ping()
            s.put(KEYS[0], 0, TOK, kv())
            assert torch.equal(s.get(KEYS[0], 0, TOK), kv()) and s.stats.puts == 1
            s.close()
        reset_limits()
        caplog.set_level(logging.WARNING, "kvtide")
        bare = open_tier(f"redis://127.0.0.1:{srv.port}", breaker_failures=0)  # no breaker: every op reaches it
        warned = [r.getMessage() for r in caplog.records if "does not answer at start" in r.getMessage()]
        assert len(warned) == 1 and "AuthenticationError" in warned[0]
        with pytest.raises(StoreUnavailable, match="AuthenticationError"):
            bare.put(KEYS[1], 0, TOK, kv())
        assert bare.stats.puts == 0 and bare.stats.put_failures == 1 and bare.stats.bytes_written == 0
        w = StoreWriter(bare)
        w.submit(KEYS[1], TOK, [kv(), kv(1)])
        assert w.flush(timeout=10)
        assert (w.stats.chunks, w.stats.entries, w.stats.failures) == (0, 0, 1)  # not counted as written
        assert bare.stats.puts == 0
        w.close()
        wrong = open_tier(f"redis://kv:nope@127.0.0.1:{srv.port}", breaker_failures=0)
        with pytest.raises(StoreUnavailable):
            wrong.get(KEYS[0], 0, TOK)
        assert raw(srv.port, password="s3 cr@t").dbsize() == 1
    finally:
        srv.stop()


def test_ttl_prefix_and_db_are_applied(server: Server) -> None:
    a = open_tier(f"redis://127.0.0.1:{server.port}/3?ttl=120&prefix=tenant-a:")
    b = open_tier(f"redis://127.0.0.1:{server.port}/3?prefix=tenant-b:")
    a.put(KEYS[0], 0, TOK, kv())
    b.put(KEYS[1], 0, TOK, kv(1))
    r3 = raw(server.port, db=3)
    name_a, name_b = "tenant-a:" + KEYS[0].entry_name(0), "tenant-b:" + KEYS[1].entry_name(0)
    assert sorted(k.decode() for k in r3.keys("*")) == sorted([name_a, name_b])
    assert 0 < r3.ttl(name_a) <= 120 and r3.ttl(name_b) == -1  # -1: no expiry
    assert raw(server.port, db=0).dbsize() == 0
    assert not b.contains(KEYS[0], 0) and a.contains(KEYS[0], 0)  # prefixes keep engines apart
    default = open_tier(f"redis://127.0.0.1:{server.port}?db=3")
    default.put(KEYS[2], 0, TOK, kv(2))
    assert r3.exists("kvtide:" + KEYS[2].entry_name(0))


@pytest.mark.parametrize("spec, words", [
    ("redis://:hunter2@h/abc", ["database", "'abc'"]),
    ("redis://:hunter2@h?ttl=0", ["ttl", "'0'"]),
    ("redis://:hunter2@h?ttl=1.5", ["ttl", "'1.5'"]),
    ("redis://:hunter2@h?tll=60", ["unknown query parameter", "'tll'"]),
    ("redis://:hunter2@h:99999", ["Port out of range"]),
    ("redis://:hunter2@", ["needs a host"]),
    ("redis://:hunter2@h?socket_timeout=abc", ["socket_timeout"]),
    ("rediz://:hunter2@h", ["unknown store"]),
])
def test_bad_specs_name_the_problem_and_never_the_password(spec: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as e:
        check_spec(spec)
    msg = str(e.value)
    assert all(w in msg for w in words), msg
    assert "hunter2" not in msg


def test_a_server_down_at_start_is_one_warning_then_skipped(caplog) -> None:
    reset_limits()
    caplog.set_level(logging.WARNING, "kvtide")
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    t0 = time.perf_counter()
    s = open_tier(f"redis://:hunter2@127.0.0.1:{port}/0", timeout_s=0.5)
    warned = [r.getMessage() for r in caplog.records if "does not answer at start" in r.getMessage()]
    assert len(warned) == 1 and f"127.0.0.1:{port}" in warned[0] and "hunter2" not in warned[0]
    assert "runs without it" in warned[0]
    with pytest.raises(TierSkipped):  # the breaker starts open: no connection attempt per operation
        s.get(KEYS[0], 0, TOK)
    assert not s.contains(KEYS[0], 0)
    assert time.perf_counter() - t0 < 1.0
    assert s.breaker.stats.opens == 1 and s.breaker.stats.skipped == 2


def test_bounded_reads_never_transfer_an_oversized_value_and_fail_alone(server: Server) -> None:
    s = open_tier(f"redis://127.0.0.1:{server.port}")
    r = raw(server.port)
    for c in range(2):
        s.put(KEYS[c], 0, TOK, kv(c))
    bound = len(r.get("kvtide:" + KEYS[0].entry_name(0)))
    big = KEYS[2].entry_name(0)
    r.set("kvtide:" + big, b"\0" * (8 << 20))  # 8 MiB under an entry's name
    r.rpush("kvtide:" + KEYS[1].entry_name(1), b"x")  # another Redis type
    sent = lambda: int(r.info("stats")["total_net_output_bytes"])  # noqa: E731
    before = sent()
    with pytest.raises(ChunkOversize, match=str(8 << 20)):
        s._read(big, max_bytes=bound)
    got = s._read_many([KEYS[0].entry_name(0), big, KEYS[3].entry_name(0), KEYS[1].entry_name(1),
                        KEYS[1].entry_name(0)], max_bytes=bound)
    assert isinstance(got[0], bytes) and len(got[0]) == bound
    assert isinstance(got[1], ChunkOversize) and got[2] is None and isinstance(got[3], EntryUnreadable)
    assert isinstance(got[4], bytes)
    assert sent() - before < 4 * bound + 16_384  # the 8 MiB value never crossed the link
    f = s.fetch([(KEYS[0], 0), (KEYS[2], 0), (KEYS[1], 1)], max_bytes=bound)
    assert not isinstance(f.blobs[0], StoreError)
    assert isinstance(f.blobs[1], ChunkOversize) and isinstance(f.blobs[2], EntryUnreadable)
    assert torch.equal(s.open(f.blobs[0], KEYS[0], 0, TOK).tensor, kv(0))
    assert s.stats.oversize == 1 and s.stats.read_errors == 1
    assert s.breaker.stats.failures == 0  # entries failed, the tier did not
    with pytest.raises(ChunkMissing):
        s._read(KEYS[3].entry_name(0), max_bytes=bound)
    r.set("kvtide:" + KEYS[3].entry_name(0), b"")
    assert s._read(KEYS[3].entry_name(0), max_bytes=bound) == b""  # empty but present: truncated, not missing


def test_a_stalled_server_costs_one_timeout_per_operation_then_nothing(server: Server) -> None:
    s = open_tier(f"redis://127.0.0.1:{server.port}", timeout_s=0.3, breaker_failures=3, breaker_backoff_s=1.0)
    s.put(KEYS[0], 0, TOK, kv())
    server.pause()
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            with pytest.raises(StoreUnavailable):
                s.get(KEYS[0], 0, TOK)
            dt = time.perf_counter() - t0
            assert 0.25 < dt < 0.55, dt  # one timeout, no retry of a timeout
        t0 = time.perf_counter()
        for _ in range(50):
            with pytest.raises(TierSkipped):
                s.get(KEYS[0], 0, TOK)
        assert time.perf_counter() - t0 < 0.1  # open: no network call
        assert s.breaker.stats.opens == 1 and s.breaker.stats.skipped == 50
    finally:
        server.resume()
    time.sleep(1.1)  # the back-off: the next operation probes, the server answers, the breaker closes
    assert torch.equal(s.get(KEYS[0], 0, TOK), kv()) and s.breaker.state == "closed"


def test_rediss_uses_tls(tmp_path: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl binary not installed (it makes the test's certificate)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost"], check=True, capture_output=True)
    srv = Server(tmp_path, "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                 "--tls-auth-clients", "no", tls=True)
    try:
        s = open_tier(f"rediss://127.0.0.1:{srv.port}?ssl_ca_certs={cert}&ssl_check_hostname=false")
        s.put(KEYS[0], 0, TOK, kv())
        assert torch.equal(s.get(KEYS[0], 0, TOK), kv())
        plain = open_tier(f"redis://127.0.0.1:{srv.port}", breaker_failures=0, timeout_s=0.5)
        assert not plain.ping()  # the port speaks TLS only
    finally:
        srv.stop()
