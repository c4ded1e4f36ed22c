"""The transport contract, for every transport in one process (in-process; Mooncake over TCP on 127.0.0.1 when its
extra is installed), plus the sender-side pacing and the goodput meter."""
from __future__ import annotations

import importlib.util
import json
import math
import threading
import time

import numpy as np
import pytest

from kvtide.transfer.transport import (BufferFreed, GoodputMeter, InProcTransport, PacedTransport, PeerUnreachable,
                                       RemoteBuffer, TransportError, TransportTimeout, open_transport)

KINDS = ["inproc", pytest.param("mooncake", marks=pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None, reason="the pd extra (Mooncake) is not installed"))]


@pytest.fixture(scope="module", params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def pair(kind):
    """Two endpoints shared by the module's tests (closing a Mooncake engine takes about a second)."""
    a, b = open_transport(kind), open_transport(kind)
    yield a, b
    a.close()
    b.close()


def _random(t, n: int, seed: int = 0):
    buf = t.alloc(n)
    buf.array[:] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return buf


# -- the contract ----------------------------------------------------------------------------------------------
def test_round_trip_at_offsets(pair):
    a, b = pair
    n = 1 << 20
    src, dst = _random(a, n), b.alloc(n)
    remote = RemoteBuffer.from_dict(json.loads(json.dumps(dst.remote().to_dict())))  # as it crosses HTTP
    assert remote == dst.remote() and remote.session == b.session and remote.nbytes == n
    expect = np.zeros(n, dtype=np.uint8)
    for src_off, dst_off, k in [(0, 0, n), (1, 3, 1), (12345, 777, 65537), (n - 10, n - 10, 10), (5, n - 4000, 4000),
                                (0, 0, 0)]:
        a.write(src, src_off, remote, dst_off, k)
        expect[dst_off:dst_off + k] = src.array[src_off:src_off + k]
        assert np.array_equal(dst.array, expect), (src_off, dst_off, k)


@pytest.mark.parametrize("case", ["src_end", "dst_end", "neg_src", "neg_dst", "neg_n", "float_off", "bool_n",
                                  "timeout0", "foreign_src", "not_remote"])
def test_bad_writes_are_value_errors_before_any_io(pair, case):
    a, b = pair
    src, dst, other = _random(a, 4096, 1), b.alloc(4096), b.alloc(64)
    r, sent = dst.remote(), getattr(a, "bytes_sent", 0)
    args = {"src_end": (src, 4000, r, 0, 100), "dst_end": (src, 0, r, 4000, 97), "neg_src": (src, -1, r, 0, 1),
            "neg_dst": (src, 0, r, -1, 1), "neg_n": (src, 0, r, 0, -1), "float_off": (src, 0.0, r, 0, 1),
            "bool_n": (src, 0, r, 0, True), "timeout0": (src, 0, r, 0, 1), "foreign_src": (other, 0, r, 0, 1),
            "not_remote": (src, 0, r.to_dict(), 0, 1)}[case]
    kwargs = {"timeout_s": 0} if case == "timeout0" else {}
    with pytest.raises(ValueError):
        a.write(*args, **kwargs)
    assert not dst.array.any()  # nothing moved
    if isinstance(a, InProcTransport):
        assert a.bytes_sent == sent


def test_the_destination_range_is_checked_against_the_advertised_size(pair):
    a, b = pair
    src, dst = _random(a, 4096), b.alloc(1024)
    bigger = RemoteBuffer(dst.remote().session, dst.addr, 4096)  # a lie the receiver must catch
    with pytest.raises(TransportError):
        a.write(src, 0, bigger, 0, 4096)


@pytest.mark.parametrize("bad, field", [
    ([], "expected a dict"), ({"addr": 1, "nbytes": 1}, "session"), ({"session": "s", "nbytes": 1}, "addr"),
    ({"session": "s", "addr": 1}, "nbytes"), ({"session": "", "addr": 1, "nbytes": 1}, "session"),
    ({"session": 5, "addr": 1, "nbytes": 1}, "session"), ({"session": "s", "addr": "1", "nbytes": 1}, "addr"),
    ({"session": "s", "addr": -1, "nbytes": 1}, "addr"), ({"session": "s", "addr": True, "nbytes": 1}, "addr"),
    ({"session": "s", "addr": 1.0, "nbytes": 1}, "addr"), ({"session": "s", "addr": 2 ** 64, "nbytes": 1}, "addr"),
    ({"session": "s", "addr": 1, "nbytes": -2}, "nbytes"), ({"session": "s", "addr": 1, "nbytes": None}, "nbytes"),
    ({"session": "s", "addr": 2 ** 64 - 8, "nbytes": 9}, "nbytes"),
])
def test_remote_buffer_from_dict_rejects_bad_dicts(bad, field):
    with pytest.raises(ValueError, match=field):
        RemoteBuffer.from_dict(bad)


def test_remote_buffer_round_trip_ignores_unknown_keys():
    r = RemoteBuffer("127.0.0.1:15000", 2 ** 47, 1 << 30)
    assert RemoteBuffer.from_dict({**json.loads(json.dumps(r.to_dict())), "future": 1}) == r


def test_writes_after_free_fail(pair):
    a, b = pair
    src, dst = _random(a, 8192), b.alloc(8192)
    remote = dst.remote()
    dst.free()
    dst.free()  # idempotent
    with pytest.raises(BufferFreed):
        dst.remote()
    with pytest.raises(TransportError):  # the receiver no longer has the buffer
        a.write(src, 0, remote, 0, 8192)
    src2 = _random(a, 16)
    src2.free()
    with pytest.raises(BufferFreed):
        a.write(src2, 0, b.alloc(16).remote(), 0, 16)


def test_a_closed_peer_is_an_error(pair, kind):
    a, b = pair[0], open_transport(kind)
    src, remote = _random(a, 4096), b.alloc(4096).remote()
    b.close()
    t0 = time.monotonic()
    with pytest.raises(TransportError):
        a.write(src, 0, remote, 0, 4096, timeout_s=3.0)
    assert time.monotonic() - t0 < 3.5
    with pytest.raises(BufferFreed):
        b.alloc(16)


def test_concurrent_writes_from_threads(pair):
    a, b = pair
    n, parts = 4 << 20, 8
    src, dst = _random(a, n, 3), b.alloc(n)
    remote, step, errors = dst.remote(), n // parts, []

    def work(i: int) -> None:
        try:
            for j in range(4):  # each thread writes its part in four pieces
                off = i * step + j * (step // 4)
                a.write(src, off, remote, off, step // 4)
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and np.array_equal(dst.array, src.array)


def test_open_transport_rejects_unknown_kinds():
    with pytest.raises(ValueError, match="unknown transport"):
        open_transport("carrier-pigeon")


def test_inproc_unknown_session_is_unreachable():
    with InProcTransport() as a:
        with pytest.raises(PeerUnreachable):
            a.write(_random(a, 8), 0, RemoteBuffer("inproc:999999", 4096, 8), 0, 8)


# -- the in-process test hooks ---------------------------------------------------------------------------------
def test_inproc_fail_after_bytes_breaks_a_write_mid_way():
    with InProcTransport(fail_after_bytes=5000) as a, InProcTransport() as b:
        src, dst = _random(a, 8192), b.alloc(8192)
        a.write(src, 0, dst.remote(), 0, 4096)
        with pytest.raises(TransportError, match="after 904 of 4096"):
            a.write(src, 4096, dst.remote(), 4096, 4096)
        assert np.array_equal(dst.array[:5000], src.array[:5000]) and not dst.array[5000:].any()
        with pytest.raises(TransportError):
            a.write(src, 0, dst.remote(), 0, 1)
        a.reset_hooks()
        a.write(src, 0, dst.remote(), 0, 8192)
        assert np.array_equal(dst.array, src.array)


def test_inproc_delay_past_the_timeout_is_a_timeout():
    with InProcTransport(delay_s=5.0) as a, InProcTransport() as b:
        src, dst = _random(a, 64), b.alloc(64)
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout):
            a.write(src, 0, dst.remote(), 0, 64, timeout_s=0.1)
        assert time.monotonic() - t0 < 0.5 and not dst.array.any()
        a.delay_s = 0.05
        a.write(src, 0, dst.remote(), 0, 64, timeout_s=1.0)
        assert np.array_equal(dst.array, src.array)


# -- pacing ----------------------------------------------------------------------------------------------------
@pytest.fixture
def inproc_pair():
    with InProcTransport() as a, InProcTransport() as b:
        yield a, b


def test_pacing_holds_the_rate(inproc_pair):
    a, b = inproc_pair
    n = 8 << 20
    src, dst = _random(a, n), b.alloc(n)
    paced = PacedTransport(a, 40e6, burst_bytes=256 << 10, slice_bytes=256 << 10)
    t0 = time.monotonic()
    paced.write(src, 0, dst.remote(), 0, n)
    took = time.monotonic() - t0
    assert 0.15 < took < 0.25, took  # 8 MiB at 40 MB/s: 0.21 s, less one bucket of 256 KiB
    assert np.array_equal(dst.array, src.array) and paced.session == a.session


def test_set_rate_mid_way(inproc_pair):
    a, b = inproc_pair
    n = 8 << 20
    src, dst = _random(a, n), b.alloc(n)
    paced = PacedTransport(a, 20e6)
    timer = threading.Timer(0.1, paced.set_rate, args=(80e6,))
    t0 = time.monotonic()
    timer.start()
    paced.write(src, 0, dst.remote(), 0, n)
    took = time.monotonic() - t0
    timer.join()
    # 0.1 s at 20 MB/s (2 MB + the 256 KiB bucket), the remaining ~6.1 MB at 80 MB/s: ~0.18 s (0.42 s unchanged)
    assert 0.14 < took < 0.24, took
    assert paced.rate == 80e6 and np.array_equal(dst.array, src.array)


def test_concurrent_paced_writes_share_one_bucket(inproc_pair):
    a, b = inproc_pair
    n = 4 << 20
    src, dst = _random(a, 2 * n), b.alloc(2 * n)
    paced = PacedTransport(a, 40e6, slice_bytes=128 << 10)
    threads = [threading.Thread(target=paced.write, args=(src, i * n, dst.remote(), i * n, n)) for i in range(2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    took = time.monotonic() - t0
    assert 0.16 < took < 0.26, took  # 8 MiB through one 40 MB/s link, not two
    assert np.array_equal(dst.array, src.array)


def test_pacing_gives_up_at_the_timeout_and_checks_first(inproc_pair):
    a, b = inproc_pair
    src, dst = _random(a, 4 << 20), b.alloc(4 << 20)
    paced = PacedTransport(a, 1e6)
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout):
        paced.write(src, 0, dst.remote(), 0, 4 << 20, timeout_s=0.3)
    assert time.monotonic() - t0 < 0.45
    with pytest.raises(ValueError):
        paced.write(src, 0, dst.remote(), 1, 4 << 20)
    for bad in (0, -1.0, math.nan, True):
        with pytest.raises(ValueError):
            paced.set_rate(bad)


def test_unlimited_pacing_and_the_meter(inproc_pair):
    a, b = inproc_pair
    src, dst = _random(a, 1 << 20), b.alloc(1 << 20)
    meter = GoodputMeter()
    paced = PacedTransport(a, math.inf, meter=meter)
    t0 = time.monotonic()
    paced.write(src, 0, dst.remote(), 0, 1 << 20)
    assert time.monotonic() - t0 < 0.1 and meter.count == 1 and meter.rate > 10e6


def test_goodput_meter_ewma():
    m = GoodputMeter(alpha=0.3)
    assert m.rate is None
    assert m.observe(100, 1.0) == 100  # the first sample is taken as it is
    assert m.observe(400, 2.0) == pytest.approx(0.3 * 200 + 0.7 * 100)
    assert m.observe(0, 1.0) == pytest.approx(0.7 * 130)
    assert m.rate == pytest.approx(91.0) and m.count == 3
    for bad in [(-1, 1.0), (1, 0.0), (1, -1.0), (1, math.inf), (1, math.nan)]:
        with pytest.raises(ValueError):
            m.observe(*bad)
    with pytest.raises(ValueError):
        GoodputMeter(alpha=0)


def test_goodput_meter_takes_link_paced_transfers_and_only_bounds_the_others():
    m = GoodputMeter(alpha=0.5)
    assert m.observe_transfer(1000, 9.0, 10.0) == pytest.approx(100.0)  # writes filled the span: the link's rate
    assert m.observe_transfer(1000, 4.0, 5.0) == pytest.approx(150.0)  # EWMA of 100 and 200
    # the encoder was the bottleneck (writes 10% of the span, each at burst speed): not a sample of the link ...
    assert m.observe_transfer(100, 0.1, 1.0) == pytest.approx(150.0)
    # ... only a lower bound on it, taken where it is above the estimate
    assert m.observe_transfer(1000, 0.5, 2.0) == pytest.approx(500.0) and m.count == 4
    assert m.observe_transfer(0, 1.0, 1.0) == pytest.approx(500.0)  # nothing moved, nothing learned
    fresh = GoodputMeter(alpha=0.5)
    assert fresh.observe_transfer(100, 0.1, 1.0) == pytest.approx(100.0)  # with no estimate, the bound is one
    assert fresh.observe_transfer(1000, 1.0, 1.0) == pytest.approx(550.0) and fresh.count == 2


def test_goodput_meter_is_thread_safe():
    m = GoodputMeter(alpha=0.5)

    def work() -> None:
        for _ in range(2000):
            m.observe(1000, 1.0)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert m.count == 8000 and m.rate == pytest.approx(1000.0)
