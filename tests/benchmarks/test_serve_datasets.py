"""`kvtide bench serve`'s datasets, arrival schedules and summary statistics."""
from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest

from kvtide.benchmarks.client import RequestResult
from kvtide.benchmarks.datasets import (TokenRange, arrival_times, prefix_repetition_requests, random_requests,
                                        trace_requests)
from kvtide.benchmarks.summary import SLO, percentile, summarize


def test_random_lengths_and_tokens():
    reqs = random_requests(50, 32, 8, tokens=TokenRange(100, 200), seed=1)
    assert [len(r.prompt) for r in reqs] == [32] * 50 and {r.output_len for r in reqs} == {8}
    assert all(100 <= t < 200 for r in reqs for t in r.prompt)
    assert len({tuple(r.prompt) for r in reqs}) == 50
    assert random_requests(3, 32, 8, seed=1) == random_requests(3, 32, 8, seed=1)
    varied = random_requests(200, 100, 10, range_ratio=0.5, seed=2)
    assert min(len(r.prompt) for r in varied) >= 50 and max(len(r.prompt) for r in varied) <= 150
    assert len({len(r.prompt) for r in varied}) > 20
    with pytest.raises(ValueError, match="range ratio"):
        random_requests(1, 8, 8, range_ratio=1.0)


def test_prefix_repetition_shares_prefixes():
    reqs = prefix_repetition_requests(20, 64, 16, 4, 8, seed=3)
    assert all(len(r.prompt) == 80 for r in reqs)
    prefixes = {tuple(r.prompt[:64]) for r in reqs}
    assert len(prefixes) == 4
    assert len({tuple(r.prompt[64:]) for r in reqs}) == 20


def test_trace_equal_blocks_equal_tokens(tmp_path):
    lines = [{"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
             {"timestamp": 500, "input_length": 700, "output_length": 20, "hash_ids": [0, 2]},
             {"timestamp": 2000, "input_length": 5000, "output_length": 5, "hash_ids": [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]}]
    f = tmp_path / "trace.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    reqs = trace_requests(f)
    assert [len(r.prompt) for r in reqs] == [1000, 700, 5000] and [r.arrival_s for r in reqs] == [0, 0.5, 2.0]
    assert reqs[0].prompt[:512] == reqs[1].prompt[:512] and reqs[0].prompt[512:700] != reqs[1].prompt[512:700]
    half = trace_requests(f, length_scale=0.5, max_len=1000)
    assert [len(r.prompt) for r in half] == [500, 350]  # the 2500 + 3 token request is skipped
    assert half[0].prompt[:256] == half[1].prompt[:256] and half[0].output_len == 5
    f.write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(ValueError, match="trace.jsonl:1: not a trace record"):
        trace_requests(f)


def test_arrival_times():
    reqs = random_requests(4000, 4, 4)
    assert arrival_times(reqs[:5], math.inf) == [0.0] * 5
    t = arrival_times(reqs, 10.0, seed=5)
    gaps = np.diff(t)
    assert abs(gaps.mean() - 0.1) < 0.01 and abs(gaps.std() - 0.1) < 0.015  # exponential: std = mean
    bursty = np.diff(arrival_times(reqs, 10.0, seed=5, burstiness=0.25))
    assert abs(bursty.mean() - 0.1) < 0.015 and bursty.std() > 1.5 * gaps.std()
    traced = [r.__class__(r.prompt, r.output_len, s) for r, s in zip(reqs[:3], (0.0, 1.0, 4.0))]
    assert arrival_times(traced, math.nan) == [0.0, 1.0, 4.0]
    assert arrival_times(traced, 1.0) == pytest.approx([0.0, 0.5, 2.0])  # 2 gaps over 4 s scaled to 1 req/s
    with pytest.raises(ValueError, match="needs a trace"):
        arrival_times(reqs[:2], math.nan)


def _result(ttft, latency, n, ok=True, status=200):
    r = RequestResult(prompt_len=10, output_len=n, ok=ok, status=status, ttft=ttft, latency=latency, output_tokens=n)
    r.itl = [(latency - ttft) / max(1, n - 1)] * (n - 1)
    return r


def test_summary_statistics_and_goodput():
    xs = [0.3, 1.7, 0.2, 5.0, 2.2, 0.9]
    for p in (50, 90, 99):
        assert percentile(xs, p) == pytest.approx(np.percentile(xs, p))
    res = [_result(0.5, 1.5, 11), _result(3.0, 4.0, 11), _result(0.2, 5.2, 11),
           _result(0, 0, 0, ok=False, status=503)]
    s = summarize(res, 10.0, SLO.parse(["ttft:1000", "tpot:200"]))
    assert s["completed"] == 3 and s["failed"] == 1 and s["errors"] == {"HTTP 503": 1}
    assert s["output_throughput"] == pytest.approx(3.3) and s["request_throughput"] == pytest.approx(0.3)
    assert s["ttft_ms"]["median"] == pytest.approx(500) and s["tpot_ms"]["mean"] == pytest.approx(
        statistics.fmean([100, 100, 500]))
    assert s["goodput"]["good_requests"] == 1  # the 2nd misses TTFT, the 3rd TPOT (500 ms)
    with pytest.raises(ValueError, match="NAME:MS"):
        SLO.parse(["latency:5"])
