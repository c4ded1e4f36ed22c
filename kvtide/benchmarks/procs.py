"""Server processes the serving benchmarks start: a free loopback port, readiness, resident memory, and JSON that
keeps inf / nan (which JSON lacks) as strings."""
from __future__ import annotations

import math
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from ..extras import require

httpx = require("httpx", "bench", "kvtide bench serve")

RESULTS_DIR = Path("bench") / "results"  # where the suites write by default (relative to the checkout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float | None:
    """The resident set of process ``pid`` in MB (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def wait_ready(proc: subprocess.Popen, base: str, timeout: float, log_path: Path) -> float:
    """Seconds until ``base``/health answers 200; RuntimeError (naming ``log_path``) if ``proc`` exits or the
    ``timeout`` passes first."""
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready; see {log_path}:\n"
                               + log_path.read_text()[-3000:])
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s; see {log_path}")
        time.sleep(1)


def json_safe(x: Any) -> Any:
    """``x`` with non-finite floats as strings ("inf", "nan")."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [json_safe(v) for v in x]
    return x
