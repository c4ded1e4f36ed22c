"""Mooncake transport across processes (TCP on 127.0.0.1): 64 MB arrive intact; a dead or stalled peer fails the
write within its timeout instead of hanging it.

Run as a script, this file is the peer program (also used by test_netns.py):
``receive --host H --nbytes N`` allocates a buffer, prints its RemoteBuffer as JSON and answers ``sha`` (the
buffer's sha256) and ``exit`` on stdin; ``send --host H`` reads ``write <nbytes> <seed> <remote json>`` lines and
prints each write's seconds and the sha256 of what it sent.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve()


def _needs_mooncake() -> None:
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("the pd extra (mooncake-transfer-engine-non-cuda) is not installed")


# -- the peer program ------------------------------------------------------------------------------------------
def _receive(host: str, nbytes: int) -> None:
    from kvtide.transfer.transport import RemoteBuffer, open_transport

    t = open_transport("mooncake", host=host)
    buf = t.alloc(nbytes)
    print(json.dumps(RemoteBuffer.to_dict(buf.remote())), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "sha":
            print(hashlib.sha256(buf.array).hexdigest(), flush=True)
        elif cmd == "exit":
            break
    t.close()


def _send(host: str) -> None:
    from kvtide.transfer.transport import RemoteBuffer, open_transport

    t = open_transport("mooncake", host=host)
    bufs: dict[int, object] = {}
    for line in sys.stdin:
        parts = line.split(" ", 3)
        if parts[0] != "write":
            break
        nbytes, seed, dst = int(parts[1]), int(parts[2]), RemoteBuffer.from_dict(json.loads(parts[3]))
        if nbytes not in bufs:
            bufs[nbytes] = t.alloc(nbytes)
        src = bufs[nbytes]
        src.array[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
        t0 = time.perf_counter()
        t.write(src, 0, dst, 0, nbytes, timeout_s=20)
        seconds = time.perf_counter() - t0
        print(json.dumps({"seconds": seconds, "sha": hashlib.sha256(src.array).hexdigest()}), flush=True)
    t.close()


def peer_argv(*args: str) -> list[str]:
    return [sys.executable, str(HERE), *args]


class Peer:
    """A peer process spoken to over its stdin/stdout (lines), killed on exit."""

    def __init__(self, argv: list[str]):
        env = {**os.environ, "MC_LOG_LEVEL": "ERROR"}
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     text=True, env=env)

    def stderr_tail(self) -> str:
        self.err.seek(0)
        return self.err.read()[-2000:].decode(errors="replace")

    def ask(self, line: str | None = None, timeout: float = 20.0) -> str:
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"peer {self.proc.args} said nothing in {timeout} s: {self.stderr_tail()}")
        out = self.proc.stdout.readline()
        if not out:
            raise RuntimeError(f"peer {self.proc.args} exited ({self.proc.wait(5)}): {self.stderr_tail()}")
        return out.strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.err.close()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- tests -----------------------------------------------------------------------------------------------------
@pytest.fixture
def sender():
    _needs_mooncake()
    from kvtide.transfer.transport import open_transport

    t = open_transport("mooncake")
    yield t
    t.close()


def test_64mb_into_another_process_arrive_intact(sender):
    from kvtide.transfer.transport import RemoteBuffer

    n = 64 << 20
    with Peer(peer_argv("receive", "--host", "127.0.0.1", "--nbytes", str(n))) as peer:
        dst = RemoteBuffer.from_dict(json.loads(peer.ask()))
        assert dst.nbytes == n and dst.session.startswith("127.0.0.1:")
        src = sender.alloc(n)
        src.array[:] = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)
        # two halves in the other order, the second write from the middle of the source
        sender.write(src, n // 2, dst, n // 2, n // 2, timeout_s=20)
        t0 = time.perf_counter()
        sender.write(src, 0, dst, 0, n // 2, timeout_s=20)
        assert time.perf_counter() - t0 < 20
        assert peer.ask("sha") == hashlib.sha256(src.array).hexdigest()


def test_write_to_a_killed_peer_raises_within_its_timeout(sender):
    from kvtide.transfer.transport import RemoteBuffer, TransportError

    with Peer(peer_argv("receive", "--host", "127.0.0.1", "--nbytes", str(1 << 20))) as peer:
        dst = RemoteBuffer.from_dict(json.loads(peer.ask()))
        src = sender.alloc(1 << 20)
        sender.write(src, 0, dst, 0, 1 << 20)  # the connection is up
        peer.proc.kill()
        peer.proc.wait(timeout=10)
        for _ in range(2):  # the cached connection, then a fresh handshake to nobody
            t0 = time.monotonic()
            with pytest.raises(TransportError):
                sender.write(src, 0, dst, 0, 1 << 20, timeout_s=2.0)
            assert time.monotonic() - t0 < 2.5


def test_write_to_a_stalled_peer_times_out_and_the_transport_stays_usable(sender):
    from kvtide.transfer.transport import RemoteBuffer, TransportTimeout

    n = 32 << 20
    with Peer(peer_argv("receive", "--host", "127.0.0.1", "--nbytes", str(n))) as peer, \
            Peer(peer_argv("receive", "--host", "127.0.0.1", "--nbytes", str(1 << 20))) as healthy:
        dst = RemoteBuffer.from_dict(json.loads(peer.ask()))
        ok = RemoteBuffer.from_dict(json.loads(healthy.ask()))
        src = sender.alloc(n)
        sender.write(src, 0, dst, 0, 4096)
        os.kill(peer.proc.pid, signal.SIGSTOP)  # alive but silent: the engine alone would wait ~30 s
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout):
            sender.write(src, 0, dst, 0, n, timeout_s=1.0)
        assert 0.9 < time.monotonic() - t0 < 1.5
        assert sender.held_bytes() >= n  # the source of the given-up write is kept for the native transfer
        src.array[: 1 << 20] = 5
        sender.write(src, 0, ok, 0, 1 << 20, timeout_s=5.0)  # another peer is still reachable meanwhile
        assert healthy.ask("sha") == hashlib.sha256(src.array[: 1 << 20]).hexdigest()
        os.kill(peer.proc.pid, signal.SIGCONT)


def test_freed_memory_is_held_unless_settled(sender):
    held = sender.held_bytes()
    sender.alloc(1 << 20).free()
    assert sender.held_bytes() == held + (1 << 20)  # a late peer write must not land in freed memory
    sender.alloc(1 << 20).free(settled=True)
    assert sender.held_bytes() == held + (1 << 20)


def test_missing_package_names_pip_and_apt(monkeypatch):
    from kvtide.extras import MissingExtra
    from kvtide.transfer.transport import mooncake

    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(MissingExtra) as e:
        mooncake.MooncakeTransport()
    assert "kvtide[pd]" in str(e.value) and "apt-get install libibverbs1" in str(e.value)
    assert mooncake.mooncake_available()[0] is False


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["receive", "send"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--nbytes", type=int, default=0)
    a = ap.parse_args()
    _receive(a.host, a.nbytes) if a.role == "receive" else _send(a.host)
