"""`kvtide bench serve` and the soak's hostile requests against the live test server."""
from __future__ import annotations

import asyncio
import json
import random

import httpx

from kvtide.benchmarks.hostile import KINDS, Target, send_hostile
from kvtide.benchmarks.serve import main

from .conftest import MAX_REQUEST_BYTES


def test_bench_serve_counts_every_token(live, tmp_path, capsys):
    out = tmp_path / "serve_random.json"
    assert main(["--base-url", live.url, "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "4",
                 "--request-rate", "inf,3", "--max-concurrency", "4", "--warmup", "1", "--no-progress",
                 "--goodput", "ttft:60000", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["label"] == "smollm2-135m" and res["server"]["version"]
    assert [r["request_rate"] for r in res["runs"]] == ["inf", 3.0]
    for run in res["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["total_output_tokens"] == 24 and run["total_input_tokens"] == 96
        assert 0 < run["ttft_ms"]["median"] <= run["e2el_ms"]["median"]
        assert run["goodput"]["good_requests"] == 6
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "request throughput" in capsys.readouterr().out
    live.wait_idle()


def test_bench_serve_sweep_runs_fractions_of_saturation(live, tmp_path):
    out = tmp_path / "sweep.json"
    assert main(["--base-url", live.url, "--dataset", "prefix-repetition", "--num-prompts", "4",
                 "--prefix-repetition-prefix-len", "32", "--prefix-repetition-suffix-len", "4",
                 "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "3",
                 "--sweep", "0.5", "--warmup", "0", "--no-progress", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    sat, half = res["runs"]
    assert half["fraction_of_saturation"] == 0.5
    assert half["request_rate"] == res["saturation"]["request_throughput"] * 0.5
    assert sat["cached_tokens"] > 0  # the second request of each prefix found it cached
    live.wait_idle()


def test_hostile_requests_get_their_statuses(live):
    async def go():
        t = Target(live.url, "smollm2-135m", live.llm.engine.config.scheduler.max_model_len or 8192,
                   MAX_REQUEST_BYTES)
        async with httpx.AsyncClient(timeout=60) as c:
            return {k: await send_hostile(c, t, k, random.Random(i)) for i, k in enumerate(sorted(KINDS))}

    got = asyncio.run(go())
    wrong = {k: v for k, v in got.items() if v[0] not in KINDS[k][1]}
    assert not wrong, wrong
    live.wait_idle()
    with live.client() as client:  # and the next request is served
        assert client.completions.create(model="smollm2-135m", prompt="Once upon a time", max_tokens=2).choices
