"""redis-server processes of one test (extra arguments: auth, ACL users, TLS), stopped by their own pid only."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

REDIS_BIN = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def need_redis() -> None:
    if REDIS_BIN is None:
        pytest.skip("redis-server binary not installed (apt-get install redis-server); CI installs it")


class Server:
    """A redis-server of this test alone (extra arguments: auth, ACL users, TLS); stopped by its own pid."""

    def __init__(self, workdir: Path, *args: str, tls: bool = False) -> None:
        need_redis()
        self.port = free_port()
        ports = ["--port", "0", "--tls-port", str(self.port)] if tls else ["--port", str(self.port)]
        self.proc = subprocess.Popen(
            [REDIS_BIN, *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.02)
        self.stop()
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a stopped server cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the server keeps its socket (connections are accepted by the kernel) and answers nothing."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
