"""/metrics parses with prometheus-client's own parser, carries vLLM's names, and its counters move by the right
amounts for known requests."""
from __future__ import annotations

import logging
import time

from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL

LABEL = (("model_name", MODEL),)
NAMES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens",
         "generation_tokens", "prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_hits",
         "num_preemptions", "request_success", "time_to_first_token_seconds", "inter_token_latency_seconds",
         "e2e_request_latency_seconds", "request_queue_time_seconds", "kv_compression_ratio", "restorations",
         "restore_fallbacks", "store_bytes_loaded", "store_bytes_written"]
# > 2 pages of 16 tokens, so that a repeat finds whole pages in the prefix cache
PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
          "books were made, sold and read across Europe and then the world. Printers in Venice, Paris and London "
          "soon competed for authors, paper and buyers.")


def scrape(live) -> tuple[dict[str, str], dict[tuple, float]]:
    with live.http() as http:
        r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    kinds, samples = {}, {}
    for fam in text_string_to_metric_families(r.text):
        kinds[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return kinds, samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get(("kvtide:" + name, tuple(sorted({**dict(LABEL), **labels}.items()))), 0.0)


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def settle(live) -> dict:
    """Samples once the engine is idle and its snapshot shows it."""
    live.wait_idle()
    deadline = time.monotonic() + 10
    while True:
        _, s = scrape(live)
        if value(s, "num_requests_running") == 0 and value(s, "num_requests_waiting") == 0:
            return s
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_names_and_types_are_vllms(live):
    kinds, samples = scrape(live)
    for name in NAMES:
        assert "kvtide:" + name in kinds, name
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_compression_ratio"):
        assert kinds["kvtide:" + name] == "gauge"
    for name in ("prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits",
                 "num_preemptions", "request_success", "external_prefix_cache_hits"):
        assert kinds["kvtide:" + name] == "counter"
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert kinds["kvtide:" + name] == "histogram"
    assert value(samples, "kv_compression_ratio") == 1.0  # no compression on this engine
    assert ("process_resident_memory_bytes", ()) in samples


def test_counters_move_by_the_right_amounts(live):
    client = live.client()
    before = settle(live)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    p = r.usage.prompt_tokens
    assert p > 32 and r.usage.completion_tokens == 5
    after = settle(live)
    assert delta(before, after, "prompt_tokens_total") == p
    assert delta(before, after, "generation_tokens_total") == 5
    assert delta(before, after, "request_success_total", finished_reason="length") == 1
    assert delta(before, after, "request_success_total", finished_reason="stop") == 0
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(before, after, hist + "_count") == 1, hist
    assert 0 <= delta(before, after, "request_queue_time_seconds_sum") \
        <= delta(before, after, "time_to_first_token_seconds_sum")
    assert delta(before, after, "inter_token_latency_seconds_count") == 4  # between 5 tokens
    assert delta(before, after, "prefix_cache_queries_total") == p
    assert delta(before, after, "prefix_cache_hits_total") == r.usage.prompt_tokens_details.cached_tokens
    assert value(after, "kv_cache_usage_perc") == 0.0  # finished: its pages are free (cached, reusable)

    word = r.choices[0].text.split()[1]  # the repeat generates the same text: it stops there
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stop=[word],
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].finish_reason == "stop"
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0, "the repeat must reuse the first request's full pages"
    last = settle(live)
    assert delta(after, last, "prefix_cache_hits_total") == cached
    assert delta(after, last, "prefix_cache_queries_total") == p
    assert delta(after, last, "prompt_tokens_total") == p
    assert delta(after, last, "generation_tokens_total") == again.usage.completion_tokens
    assert delta(after, last, "request_success_total", finished_reason="stop") == 1
    assert delta(after, last, "request_success_total", finished_reason="length") == 0


def test_running_requests_and_kv_usage_while_streaming(live):
    client = live.client()
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    seen_running, seen_usage = 0.0, 0.0
    for i, _ in enumerate(stream):
        if i in (5, 20):
            _, s = scrape(live)
            seen_running = max(seen_running, value(s, "num_requests_running"))
            seen_usage = max(seen_usage, value(s, "kv_cache_usage_perc"))
    assert seen_running == 1
    pages = -(-(len(live.llm.tokenizer.encode(PROMPT)) + 20) // 16)
    assert seen_usage >= pages / live.llm.engine.num_pages * 0.99
    after = settle(live)
    assert value(after, "kv_cache_usage_perc") == 0.0


def test_the_periodic_log_line(live, caplog):
    caplog.set_level(logging.INFO, logger="kvtide.server")
    r = live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    deadline = time.monotonic() + 10  # the fixture's server logs every 0.5 s while there is something to say
    while not any("generation throughput" in m for m in caplog.messages):
        assert time.monotonic() < deadline, caplog.messages
        time.sleep(0.1)
    line = next(m for m in caplog.messages if "generation throughput" in m)
    assert "prompt throughput" in line and "KV cache usage" in line and "prefix cache hit rate" in line
    live.wait_idle()
    time.sleep(1.2)
    caplog.clear()
    time.sleep(1.2)
    assert not any("throughput" in m for m in caplog.messages), "an idle server stays quiet"
