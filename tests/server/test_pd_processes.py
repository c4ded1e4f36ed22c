"""Prefill/decode disaggregation as users run it: `kvtide serve --role prefill` and `--role decode` as two processes,
KV over the Mooncake Transfer Engine (TCP on loopback), the proxy in front. Greedy tokens through the proxy equal
the same engine's own; the decode instance restored the prompt from the hand-off (its metrics); a prefill instance
killed in the middle of a (paced) transfer costs a recompute, never a wrong token. About 40 s (three engine starts).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvtide.benchmarks.procs import free_port, wait_ready
from kvtide.server.proxy import Proxy, build_proxy_app

from .app_thread import app_thread

pytest.importorskip("mooncake.engine", reason="the Mooncake Transfer Engine (pip install 'kvtide[pd]')")

MODEL = "smollm2-135m"
TOKENS = 8
PACING_GBPS = 0.05  # ~6 MB/s: a long prompt's hand-off takes over a second, long enough to kill it midway
PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based inks and a wooden press adapted from wine making. Within fifty years",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively so that large values of n "
    "do not exhaust the recursion limit of the interpreter.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n",
]
LONG = " ".join(f"Section {i}: the committee reviewed the budget, the schedule and the staffing plan." for i in range(24))


def _serve(role: str, port: int, log, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvtide.cli", "serve", MODEL, "--device", "cpu", "--num-pages", "512", "--port",
           str(port), "--role", role, "--advertise-url", f"http://127.0.0.1:{port}", "--log-level", "warning", *extra]
    env = {**os.environ, "KVTIDE_SERVER_LOG_STATS_INTERVAL_S": "0"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    d = tmp_path_factory.mktemp("pd")
    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    logs = [open(d / f"{name}.log", "w") for name in ("prefill", "decode")]
    procs = [_serve("prefill", ports[0], logs[0], ["--kv-pacing-gbps", str(PACING_GBPS)]),
             _serve("decode", ports[1], logs[1], ["--kv-transfer-timeout", "20", "--kv-accept-lossy"])]
    try:
        for p, u, name in zip(procs, urls, ("prefill", "decode")):
            wait_ready(p, u, 180, d / f"{name}.log")
        with app_thread(build_proxy_app(Proxy([urls[0]], [urls[1]])), ports[2]):
            yield {"prefill": urls[0], "decode": urls[1], "proxy": urls[2], "procs": procs}
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs:
            f.close()


def _complete(url: str, prompt: str, **extra) -> dict:
    with httpx.Client(timeout=120) as c:
        r = c.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
                                                  "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _metric(url: str, name: str, label: str = "") -> float:
    """The sum of a metric's samples (those whose labels contain ``label``)."""
    with httpx.Client(timeout=30) as c:
        text = c.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in " {" and label in line)


LOSSLESS = ["none|none|none", "none|none|zstd", "none|none|zipf"]


def test_tokens_through_the_proxy_equal_the_engines_own(pd):
    for i, prompt in enumerate(PROMPTS):
        want = _complete(pd["prefill"], prompt)["choices"][0]["text"]  # the same engine and flags, one instance
        body = _complete(pd["proxy"], prompt)  # the controller's choice (lossless by default)
        assert body["choices"][0]["text"] == want
        kv = body["kv_transfer"]
        assert kv["used"] and kv["quality"] == 1.0, kv
    for i, spec in enumerate(LOSSLESS):  # every lossless profile, named (fresh prompts: no cache holds them)
        prompt = f"Case {i}. " + PROMPTS[i % len(PROMPTS)]
        want = _complete(pd["prefill"], prompt)["choices"][0]["text"]
        body = _complete(pd["proxy"], f"Case {i}. " + PROMPTS[i % len(PROMPTS)], kv_transfer={"profile": spec})
        assert body["choices"][0]["text"] == want, spec
        assert body["kv_transfer"]["used"] and body["kv_transfer"]["spec"] == spec
    assert _metric(pd["decode"], "kvtide:kv_transfer_tokens_total") > 0
    assert _metric(pd["decode"], "kvtide:kv_transfer_fallbacks_total") == 0
    assert _metric(pd["decode"], "kvtide:external_prefix_cache_hits_total") == \
        _metric(pd["decode"], "kvtide:kv_transfer_tokens_total")  # the prompts came from the hand-offs
    assert _metric(pd["prefill"], "kvtide:kv_transfer_bytes_total", 'direction="sent"') > 0


def test_a_lossy_profile_finishes_with_its_quality(pd):
    body = _complete(pd["proxy"], "Lossy. " + LONG,
                     kv_transfer={"min_quality": 0.9, "profile": "none|kivi:k=2,v=2,g=32|pack"})
    kv = body["kv_transfer"]
    assert kv["used"] and 0.9 <= kv["quality"] < 1.0 and kv["wire_bytes"] < kv["raw_bytes"], kv
    assert body["usage"]["completion_tokens"] == TOKENS


def test_prefill_killed_midway_recomputes(pd):
    prompt = "Notes. " + LONG
    with httpx.Client(timeout=120) as c:
        leg = c.post(pd["prefill"] + "/v1/completions", json={
            "prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}})
    assert leg.status_code == 200, leg.text
    params = leg.json()["kv_transfer_params"]
    fallbacks = _metric(pd["decode"], "kvtide:kv_transfer_fallbacks_total")
    out: dict = {}

    def decode_leg() -> None:
        out["body"] = _complete(pd["decode"], prompt, kv_transfer_params=params)

    t = threading.Thread(target=decode_leg)
    t.start()
    time.sleep(0.6)  # the paced hand-off of ~10 MB takes well over a second
    pd["procs"][0].kill()
    t.join(60)
    assert not t.is_alive()
    body = out["body"]
    assert body["kv_transfer"]["used"] is False, body["kv_transfer"]
    assert _metric(pd["decode"], "kvtide:kv_transfer_fallbacks_total") == fallbacks + 1
    # the right tokens: what the decode engine answers for the prompt by itself
    assert body["choices"][0]["text"] == _complete(pd["decode"], prompt)["choices"][0]["text"]
