"""Session fixtures of the vLLM connector tests: vLLM's venv, the model directory, and the scenario runs.

Each run is one vLLM process (``vllm_scenarios.py``); the runs are shared by the tests that read them, so vLLM
starts four times in all: a reference without the connector, a first and a second process over one disk store,
and a process over a Redis server.

Exact token equality holds by construction, not by luck: vLLM's CPU GEMMs round differently for different batch
shapes, so each connector run is compared with the reference run that computes the same token ranges in the same
batches. A first pass (nothing stored) against the reference's first pass; a pass that loads a prefix against the
reference's second pass, which takes the same prefix from vLLM's own prefix cache (chunks of 128 tokens, vLLM's
CPU block size, so a stored prefix ends where a cached one does); a pass whose loads fail at the first chunk
(vLLM recomputes every token) against a cold pass of the same prompts.
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.integrations import vllm_env
from tests.store.redis_procs import REDIS_BIN, Server

SCENARIOS = Path(__file__).with_name("vllm_scenarios.py")
S6 = ["assignment/0", "class/0", "import/0", "assignment/1", "class/1", "import/1"]
S3 = ["assignment/0", "class/0", "import/0"]
S7 = S6 + ["calls/0"]  # one document no run before has seen
COMMON = {"doc_tokens": 800, "max_tokens": 24}
SECRET = "kvtide-test-secret"


def _say(request: pytest.FixtureRequest, line: str) -> None:
    tr = request.config.pluginmanager.getplugin("terminalreporter")
    if tr is not None:
        tr.write_line(line)


@pytest.fixture(scope="session")
def vllm_python(request: pytest.FixtureRequest) -> Path:
    t0 = time.monotonic()
    try:
        python, took = vllm_env.ensure_venv()
    except vllm_env.VenvUnavailable as e:
        pytest.skip(f"vLLM venv cannot be made here: {e}")
    where = vllm_env.venv_dir()
    _say(request, f"\nvLLM venv {where}: " + (f"installed in {took:.0f} s" if took is not None else
                                               f"found (checked in {time.monotonic() - t0:.0f} s)"))
    return python


@pytest.fixture(scope="session")
def hf_model() -> Path:
    return vllm_env.ensure_hf_model()


class Runner:
    """Runs scenario specs in vLLM's venv; ``run`` returns the phases' results."""

    def __init__(self, python: Path, model: Path, workdir: Path, request: pytest.FixtureRequest) -> None:
        self.python, self.model, self.workdir, self.request = python, model, workdir, request

    def run(self, name: str, spec: dict[str, Any], timeout: float = 900) -> list[dict[str, Any]]:
        spec = {"model": str(self.model), **COMMON, **spec}
        path = self.workdir / f"{name}.json"
        path.write_text(json.dumps(spec))
        t0 = time.monotonic()
        r = subprocess.run([str(self.python), str(SCENARIOS), str(path)], capture_output=True, text=True,
                           timeout=timeout, cwd=self.workdir, env=vllm_env.scenario_env())
        (self.workdir / f"{name}.log").write_text(r.stderr)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if r.returncode or not lines:
            raise AssertionError(f"vLLM scenario {name} failed (rc {r.returncode}):\n{r.stderr[-6000:]}")
        _say(self.request, f"vLLM scenario {name}: {time.monotonic() - t0:.0f} s")
        return json.loads(lines[-1])["phases"]


@pytest.fixture(scope="session")
def runner(vllm_python: Path, hf_model: Path, tmp_path_factory: pytest.TempPathFactory,
           request: pytest.FixtureRequest) -> Runner:
    return Runner(vllm_python, hf_model, tmp_path_factory.mktemp("vllm"), request)


def connector(store: str, **kw: Any) -> dict[str, Any]:
    return {"store": store, "chunk_tokens": 128, **kw}


@pytest.fixture(scope="session")
def reference(runner: Runner) -> dict[str, list[list[int]]]:
    """vLLM without the connector: S6 cold, S6 again (prefixes from vLLM's prefix cache), S3 cold, S7 cold."""
    p = runner.run("reference", {"connector": None, "phases": [
        {"op": "generate", "prompts": S6}, {"op": "generate", "prompts": S6}, {"op": "reset"},
        {"op": "generate", "prompts": S3}, {"op": "reset"}, {"op": "generate", "prompts": S7}]})
    return {"cold6": p[0]["tokens"], "warm6": p[1]["tokens"], "cold3": p[3]["tokens"], "cold7": p[5]["tokens"]}


@pytest.fixture(scope="session")
def disk_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"disk:{tmp_path_factory.mktemp('kvstore')}"


@pytest.fixture(scope="session")
def first_process(runner: Runner, disk_store: str) -> list[dict[str, Any]]:
    """A fresh disk store: S6 (computed, saved), then S6 again after vLLM's prefix cache is emptied (loaded), then
    the layout probe."""
    return runner.run("first", {"connector": connector(disk_store, secret=SECRET), "phases": [
        {"op": "generate", "prompts": S6}, {"op": "flush"}, {"op": "reset"}, {"op": "generate", "prompts": S6},
        {"op": "layout"}]})


@pytest.fixture(scope="session")
def second_process(runner: Runner, disk_store: str, first_process: list) -> list[dict[str, Any]]:
    """Another vLLM process over the first one's store: S6 (loaded), vLLM's metrics, then the first chunk of each
    document damaged three ways and S3 again."""
    return runner.run("second", {"connector": connector(disk_store, secret=SECRET, planned_split=False),
                                 "log_stats": True, "phases": [
        {"op": "generate", "prompts": S6}, {"op": "metrics"}, {"op": "flush"},
        {"op": "damage", "what": {"assignment": "corrupt", "class": "truncate", "import": "forge"}},
        {"op": "reset"}, {"op": "generate", "prompts": S3}]})


@pytest.fixture(scope="session")
def redis_process(runner: Runner, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    """A Redis store with the ZipFusion codec: S6 (saved), S6 after a prefix-cache reset (loaded), then the Redis
    server killed and S7 (S6 and a new document, whose chunks cannot be saved)."""
    if REDIS_BIN is None:
        pytest.skip("redis-server binary not installed (apt-get install redis-server); CI installs it")
    srv = Server(tmp_path_factory.mktemp("redis-vllm"))
    try:
        yield runner.run("redis", {"connector": connector(f"redis://127.0.0.1:{srv.port}/0", store_codec="zip",
                                                          planned_split=False, breaker_backoff_s=60.0),
                                   "phases": [
            {"op": "generate", "prompts": S6}, {"op": "flush"}, {"op": "reset"}, {"op": "generate", "prompts": S6},
            {"op": "kill", "pid": srv.proc.pid}, {"op": "reset"}, {"op": "generate", "prompts": S7},
            {"op": "flush", "timeout": 60}]})
    finally:
        srv.stop()
