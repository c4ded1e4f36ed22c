"""Mooncake conversation trace -> a replayable workload for the restoration benchmark.

Scaling (stated in every result): each 512-token block of the trace becomes ``block_tokens`` tokens
(scale = block_tokens / 512) of fixed content per block id (equal ids -> equal tokens, so reuse is real),
inputs are capped at ``max_input`` tokens, outputs scaled the same way and capped at ``max_output``.
Arrival times keep the trace's pattern, stretched by one factor chosen so the offered load is a given
fraction of the recompute-only baseline's saturation throughput (bench/restore.py measures it with a
closed-loop replay: ``replay(..., stretch=0)`` puts every arrival at time 0).

How the lengths fit the machine: on the 2-core CPU, SmolLM2 replays ~600 tokens a second through all 30
layers, so 512-token blocks become 16 tokens (scale 1/32: a 15.6k-token mean input becomes ~490, capped at
512) and 24 requests replay in ~40 s per method; on the H200 the 8B shape runs the trace at full scale
(blocks of 512 tokens, inputs capped at 16k). The reuse structure (which blocks repeat, 72% of the input of
the selected requests on average) is the trace's own at every scale.
"""
from __future__ import annotations

import json
import math
import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

_ROOT = Path(__file__).resolve().parents[1]
_CANDIDATES = [_ROOT / "shared", _ROOT.parent / "shared"]  # repo-local copy (device machines) or the sibling
TRACE = next((c for c in _CANDIDATES if (c / "data/mooncake").is_dir()), _CANDIDATES[-1]) / "data" / "mooncake" / \
    "conversation_trace.jsonl"


@dataclass
class TraceRequest:
    arrival: float  # seconds (trace time, before stretching)
    tokens: list[int]
    output: int
    reused_blocks: int  # leading blocks seen before the replay window (their KV is pre-loaded in the store)
    hash_ids: list[int]


def load_trace(path: Path = TRACE) -> list[dict]:
    rows = [json.loads(line) for line in path.open()]
    rows.sort(key=lambda r: r["timestamp"])
    return rows


def block_content(vocab_text: list[int], block_tokens: int, vocab: int) -> Callable[[int], list[int]]:
    """Tokens of a block id: a slice of real text (or random ids when there is no tokenizer), same per id."""
    cache: dict[int, list[int]] = {}

    def f(hid: int) -> list[int]:
        if hid not in cache:
            if len(vocab_text) > block_tokens:
                o = (hid * 7919) % (len(vocab_text) - block_tokens)
                cache[hid] = vocab_text[o:o + block_tokens]
            else:
                rng = random.Random(hid)
                cache[hid] = [rng.randrange(vocab) for _ in range(block_tokens)]
        return cache[hid]

    return f


def build_workload(rows: list[dict], start: int, count: int, block_tokens: int, max_input: int, max_output: int,
                   min_reuse_blocks: int, content: Callable[[int], list[int]]) -> list[TraceRequest]:
    """``count`` requests from index ``start`` on that reuse >= ``min_reuse_blocks`` leading blocks of earlier ones."""
    seen: set[int] = set()
    for r in rows[:start]:
        seen.update(r["hash_ids"])
    out: list[TraceRequest] = []
    scale = block_tokens / 512
    t0 = None
    for r in rows[start:]:
        k = 0
        for h in r["hash_ids"]:
            if h not in seen:
                break
            k += 1
        seen.update(r["hash_ids"])
        if k < min_reuse_blocks:
            continue
        n = min(max_input, max(block_tokens + 1, math.ceil(r["input_length"] * scale)))
        toks: list[int] = []
        for h in r["hash_ids"]:
            toks += content(h)
            if len(toks) >= n:
                break
        toks = toks[:n]
        if t0 is None:
            t0 = r["timestamp"]
        out.append(TraceRequest((r["timestamp"] - t0) / 1000.0, toks,
                                max(1, min(max_output, math.ceil(r["output_length"] * scale))), k, r["hash_ids"]))
        if len(out) == count:
            break
    return out


def prefixes_to_preload(reqs: list[TraceRequest], block_tokens: int) -> list[list[int]]:
    """Token prefixes (the blocks reused from before the window) whose KV must be in the store at start."""
    seen: dict[tuple[int, ...], list[int]] = {}
    for r in reqs:
        k = min(r.reused_blocks * block_tokens, len(r.tokens) - 1)
        if k > 0:
            seen.setdefault(tuple(r.hash_ids[: r.reused_blocks]), r.tokens[:k])
    return sorted(seen.values(), key=len, reverse=True)


def replay(engine, reqs: list[TraceRequest], stretch: float, params_for, on_first=None) -> dict[str, float]:
    """Feed the engine at the (stretched) arrival times; returns request id -> TTFT (queueing included)."""
    pending = deque(sorted(enumerate(reqs), key=lambda x: x[1].arrival))
    ttft: dict[str, float] = {}
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0][1].arrival * stretch <= now:
            i, r = pending.popleft()
            rid = engine.add_request(r.tokens, params_for(r), request_id=f"trace-{i}")
            engine.seqs[rid].arrival = t0 + r.arrival * stretch  # TTFT counts from the scheduled arrival
        if engine.has_unfinished():
            for out in engine.step():
                if out.request_id not in ttft and out.ttft is not None:
                    ttft[out.request_id] = out.ttft
                    if on_first is not None:
                        on_first()
        elif pending:
            time.sleep(min(0.05, max(0.0, pending[0][1].arrival * stretch - now)))
    return ttft


def text_tokens(tokenizer, vocab_size: int, n: int) -> list[int]:
    """Real text (Python's own pydoc topics) where there is a tokenizer; random ids for random-weight models."""
    try:
        from pydoc_data.topics import topics

        ids = tokenizer.encode(" ".join(topics[k] for k in sorted(topics)))
        if len(ids) >= n:
            return ids[:n]
    except Exception:  # noqa: BLE001 - NullTokenizer (random weights) has no encode
        pass
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (n,), generator=g).tolist()
