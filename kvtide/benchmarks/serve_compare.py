"""``kvtide bench serve-compare``: start each server in turn, load it with the same ``kvtide bench serve`` run, and
write one JSON and one PNG with all of them (kvtide against vLLM, or one kvtide setting against another).

Each ``--server LABEL=COMMAND`` is started with ``{port}`` in COMMAND replaced by a free loopback port, used once
``/health`` answers 200, then stopped with SIGTERM (SIGKILL after a grace period). Everything after ``--`` is
passed to ``kvtide bench serve``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
from pathlib import Path


from . import serve as bench_serve
from .header import machine_header
from .procs import RESULTS_DIR, free_port, json_safe, rss_mb, wait_ready
from ..extras import require

httpx = require("httpx", "bench", "kvtide bench serve")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtide bench serve-compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", action="append", required=True, metavar="LABEL=COMMAND",
                    help="a server to start; COMMAND holds {port}; repeat for each")
    ap.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to come up")
    ap.add_argument("--out", default=str(RESULTS_DIR / "serve_compare.json"))
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then `kvtide bench serve` arguments")
    return ap


def _start(command: str, port: int, log_path: Path) -> subprocess.Popen:
    args = shlex.split(command.replace("{port}", str(port)))
    log = open(log_path, "w")
    try:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()  # the child holds its own copy


def _stop(proc: subprocess.Popen, grace: float = 60.0) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait()


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    rest = a.bench_args[1:] if a.bench_args[:1] == ["--"] else a.bench_args
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results, failed = [], []
    for spec in a.server:
        label, sep, command = spec.partition("=")
        if not sep or "{port}" not in command:
            raise ValueError(f"--server {spec!r}: expected LABEL=COMMAND with {{port}} in COMMAND")
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log_path = out.with_name(f"{out.stem}.{label}.log")
        proc = _start(command, port, log_path)
        ok_log = False  # a server's log is kept only when it failed
        try:
            ready = wait_ready(proc, base, a.ready_timeout, log_path)
            print(f"{label}: ready in {ready:.1f} s", flush=True)
            args = bench_serve.build_parser().parse_args([*rest, "--base-url", base, "--label", label])
            res = asyncio.run(bench_serve.bench(args))
            res.update(command=command, ready_seconds=ready, server_rss_mb=rss_mb(proc.pid))
            results.append(res)
            ok_log = True
        except Exception as e:  # noqa: BLE001 - one server's failure is reported; the others still run
            print(f"{label}: failed: {e}", flush=True)
            failed.append({"label": label, "command": command, "error": str(e)[-3000:]})
        finally:
            _stop(proc)
            if ok_log:
                log_path.unlink(missing_ok=True)
    doc = {"header": machine_header(argv), "bench_args": rest, "servers": results, "failed": failed}
    out.write_text(json.dumps(json_safe(doc), indent=1) + "\n")
    if results:
        try:
            bench_serve.plot(json.loads(out.read_text())["servers"], out.with_suffix(".png"))
        except ImportError:
            pass
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
