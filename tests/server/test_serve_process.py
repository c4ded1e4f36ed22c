"""`kvtide serve` as users run it: its config (flag > env > file > default) and SIGTERM's drain (a subprocess)."""
from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from kvtide.cli import main
from tests.server.conftest import MODEL, free_port

DRAIN_S = 8.0


@pytest.fixture(autouse=True)
def _kvtide_logger_restored():
    """main() configures the process's `kvtide` logger (a handler on the captured stderr); put it back."""
    logger = logging.getLogger("kvtide")
    saved = (logger.level, list(logger.handlers), logger.propagate)
    yield
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]
    logger.propagate = saved[2]


def test_print_config_resolves_the_server_section(tmp_path, capsys, monkeypatch):
    for name in list(os.environ):
        if name.startswith("KVTIDE_") and name != "KVTIDE_CACHE_DIR":
            monkeypatch.delenv(name)
    f = tmp_path / "kvtide.yaml"
    f.write_text("scheduler:\n  max_num_seqs: 3\nserver:\n  port: 9000\n  host: 0.0.0.0\n  max_queued_requests: 5\n")
    monkeypatch.setenv("KVTIDE_SERVER_PORT", "9001")
    monkeypatch.setenv("KVTIDE_SERVER_MAX_QUEUED_REQUESTS", "6")
    assert main(["serve", MODEL, "--config", str(f), "--port", "9002", "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["server"]["port"] == 9002  # flag over env over file
    assert cfg["server"]["max_queued_requests"] == 6  # env over file
    assert cfg["server"]["host"] == "0.0.0.0" and cfg["scheduler"]["max_num_seqs"] == 3  # file over default
    assert cfg["server"]["shutdown_timeout_s"] == 30.0 and cfg["model"] == MODEL  # defaults, the positional model
    monkeypatch.setenv("KVTIDE_SERVER_SHUTDOWN_TIMEOUT_S", "-1")
    assert main(["serve", "--print-config"]) == 2
    assert "ServerConfig.shutdown_timeout_s" in capsys.readouterr().err
    monkeypatch.delenv("KVTIDE_SERVER_SHUTDOWN_TIMEOUT_S")
    assert main(["serve", "--port", "70000", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "ServerConfig.port" in err and "--port" in err  # the value's origin is named
    assert main(["serve", "a-model", "--model", "another", "--print-config"]) == 2


def _events(lines) -> tuple[str, list, bool]:
    """(text, finish reasons, whether [DONE] came) of a completion stream's lines, until it ends or breaks."""
    text, reasons, done = "", [], False
    try:
        for line in lines:
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            reasons.append(choice["finish_reason"])
    except (httpx.RemoteProtocolError, httpx.ReadError):
        pass  # the server cut the stream
    return text, reasons, done


def _open_stream(http: httpx.Client, max_tokens: int):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    cm = http.stream("POST", "/v1/completions", json=body)
    r = cm.__enter__()
    assert r.status_code == 200
    lines = r.iter_lines()
    first = next(line for line in lines if line.startswith("data: "))
    return cm, r, [first], lines


def test_sigterm_drains_in_flight_requests_then_exits():
    port = free_port()
    env = {**os.environ, "KVTIDE_SERVER_LOG_STATS_INTERVAL_S": "0"}
    cmd = [sys.executable, "-m", "kvtide.cli", "serve", MODEL, "--port", str(port), "--device", "cpu",
           "--num-pages", "256", "--shutdown-timeout", str(DRAIN_S)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        with httpx.Client(base_url=url, timeout=60) as long_http, httpx.Client(base_url=url, timeout=60) as http:
            long_cm, _, long_head, long_lines = _open_stream(long_http, 3000)  # minutes of work: cut by the drain
            cm, _, head, lines = _open_stream(http, 8)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            text, reasons, done = _events(itertools.chain(head, lines))  # the short one finishes whole
            assert done and reasons[-1] == "length" and reasons.count("length") == 1
            with pytest.raises(httpx.TransportError):  # no new connections while draining
                httpx.get(url + "/health", timeout=2)
            _, long_reasons, long_done = _events(itertools.chain(long_head, long_lines))
            cut_after = time.monotonic() - t0
            assert not long_done and "length" not in long_reasons, "the long request cannot have finished"
            assert DRAIN_S - 1 <= cut_after <= DRAIN_S + 15, cut_after
            cm.__exit__(None, None, None)
            long_cm.__exit__(None, None, None)
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
        assert "SIGTERM: no new connections" in err and "engine loop stopped" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
