"""Request sets for the serving benchmark: what each request sends and when it arrives.

Prompts are token-id lists (the completions API takes them), so their lengths are exact on any server and a model
without a tokenizer (random weights) can be served. Equal trace block ids give equal tokens, so a trace's prefix
reuse reaches the server's prefix cache as it did in production.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK = 512  # tokens per hash block in the Mooncake trace


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    output_len: int
    arrival_s: float | None = None  # trace time from the start; None: the rate decides


@dataclass(frozen=True)
class TokenRange:
    """Prompt tokens are drawn from [lo, hi): clear of special tokens, inside every usual vocabulary."""
    lo: int = 100
    hi: int = 10000

    def __post_init__(self):
        if not 0 <= self.lo < self.hi:
            raise ValueError(f"token range [{self.lo}, {self.hi}) is empty; expected 0 <= lo < hi")


def _lengths(rng: random.Random, n: int, mean: int, ratio: float) -> list[int]:
    """``n`` lengths uniform in [mean * (1 - ratio), mean * (1 + ratio)], at least 1 (ratio 0: all ``mean``)."""
    if mean < 1:
        raise ValueError(f"length {mean} must be >= 1")
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"range ratio {ratio} must be in [0, 1)")
    lo, hi = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_requests(n: int, input_len: int, output_len: int, *, range_ratio: float = 0.0,
                    tokens: TokenRange = TokenRange(), seed: int = 0) -> list[BenchRequest]:
    """``n`` independent random prompts (no shared prefix between them)."""
    rng = random.Random(seed)
    ins, outs = _lengths(rng, n, input_len, range_ratio), _lengths(rng, n, output_len, range_ratio)
    return [BenchRequest([rng.randrange(tokens.lo, tokens.hi) for _ in range(a)], b) for a, b in zip(ins, outs)]


def prefix_repetition_requests(n: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int, *,
                               tokens: TokenRange = TokenRange(), seed: int = 0) -> list[BenchRequest]:
    """``n`` prompts, each one of ``num_prefixes`` shared prefixes plus its own random suffix, in shuffled order."""
    if num_prefixes < 1 or prefix_len < 1 or suffix_len < 0 or output_len < 1:
        raise ValueError(f"prefix-repetition needs num_prefixes >= 1, prefix_len >= 1, suffix_len >= 0, "
                         f"output_len >= 1; got {num_prefixes}, {prefix_len}, {suffix_len}, {output_len}")
    rng = random.Random(seed)
    prefixes = [[rng.randrange(tokens.lo, tokens.hi) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    out = [BenchRequest(prefixes[i % num_prefixes] + [rng.randrange(tokens.lo, tokens.hi) for _ in range(suffix_len)],
                        output_len) for i in range(n)]
    rng.shuffle(out)
    return out


def trace_requests(path: str | Path, n: int | None = None, *, length_scale: float = 1.0, max_len: int | None = None,
                   tokens: TokenRange = TokenRange(), seed: int = 0) -> list[BenchRequest]:
    """The first ``n`` requests of a Mooncake-format trace (JSON lines: timestamp ms, input_length, output_length,
    hash_ids), lengths times ``length_scale`` (blocks shrink with them, so reuse keeps its shape); requests whose
    scaled input + output exceed ``max_len`` are skipped. Arrival times are the trace's, in seconds."""
    if not 0.0 < length_scale <= 1.0:
        raise ValueError(f"length_scale {length_scale} must be in (0, 1]")
    block = max(1, round(TRACE_BLOCK * length_scale))
    blocks: dict[int, list[int]] = {}
    out: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if n is not None and len(out) >= n:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ts, n_in, n_out, ids = (float(rec["timestamp"]), int(rec["input_length"]),
                                        int(rec["output_length"]), [int(h) for h in rec["hash_ids"]])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a trace record ({e}); expected timestamp, input_length, "
                                 f"output_length, hash_ids") from None
            n_in, n_out = max(1, round(n_in * length_scale)), max(1, round(n_out * length_scale))
            if max_len is not None and n_in + n_out > max_len:
                continue
            prompt: list[int] = []
            for h in ids:
                if h not in blocks:
                    r = random.Random(f"{seed}:{h}")
                    blocks[h] = [r.randrange(tokens.lo, tokens.hi) for _ in range(block)]
                prompt += blocks[h]
                if len(prompt) >= n_in:
                    break
            if len(prompt) < n_in:  # a trace whose blocks do not cover its input: fill with this request's own
                r = random.Random(f"{seed}:tail:{lineno}")
                prompt += [r.randrange(tokens.lo, tokens.hi) for _ in range(n_in - len(prompt))]
            out.append(BenchRequest(prompt[:n_in], n_out, ts / 1000.0))
    if not out:
        raise ValueError(f"{path}: no request fits (max_len {max_len}, length_scale {length_scale})")
    t0 = out[0].arrival_s or 0.0
    return [BenchRequest(r.prompt, r.output_len, (r.arrival_s or 0.0) - t0) for r in out]


def arrival_times(reqs: list[BenchRequest], rate: float, *, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Send times in seconds from the start. ``rate`` inf: all at once. Requests with trace times: those times
    scaled so the mean rate is ``rate`` (nan: the trace's own timing). Otherwise gamma-distributed gaps of mean
    1/rate (``burstiness`` 1: a Poisson process)."""
    if burstiness <= 0:
        raise ValueError(f"burstiness {burstiness} must be > 0")
    if math.isinf(rate):
        return [0.0] * len(reqs)
    traced = all(r.arrival_s is not None for r in reqs)
    if traced:
        times = [float(r.arrival_s) for r in reqs]
        if math.isnan(rate):
            return times
        span = times[-1] - times[0]
        if span <= 0 or len(times) < 2:
            return [i / rate for i in range(len(reqs))]
        k = (len(times) - 1) / rate / span
        return [(t - times[0]) * k for t in times]
    if math.isnan(rate) or rate <= 0:
        raise ValueError(f"request rate {rate} needs a trace or a positive number (or inf)")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in reqs:
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out
