"""What `kvtide bench serve` reports of one run, in the terms `vllm bench serve` uses."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from .client import RequestResult

PERCENTILES = (50, 90, 99)


def percentile(xs: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _stats(xs: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean, median, std and percentiles, in ms (``scale``)."""
    if not xs:
        return {"mean": float("nan"), "median": float("nan"), "std": float("nan"),
                **{f"p{p}": float("nan") for p in PERCENTILES}}
    return {"mean": statistics.fmean(xs) * scale, "median": statistics.median(xs) * scale,
            "std": (statistics.pstdev(xs) if len(xs) > 1 else 0.0) * scale,
            **{f"p{p}": percentile(xs, p) * scale for p in PERCENTILES}}


@dataclass(frozen=True)
class SLO:
    """Per-request goodput limits in ms (None: not limited), as ``--goodput ttft:2000 tpot:100``."""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, items: list[str] | None) -> "SLO | None":
        if not items:
            return None
        vals: dict[str, float] = {}
        for item in items:
            name, sep, val = item.partition(":")
            if not sep or name not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"--goodput {item!r}: expected NAME:MS with NAME one of ttft, tpot, e2el")
            try:
                vals[name + "_ms"] = float(val)
            except ValueError:
                raise ValueError(f"--goodput {item!r}: {val!r} is not a number of milliseconds") from None
            if vals[name + "_ms"] <= 0:
                raise ValueError(f"--goodput {item!r}: the limit must be > 0 ms")
        return cls(**vals)

    def met(self, r: RequestResult) -> bool:
        tpot = r.tpot or 0.0
        return r.ok and (self.ttft_ms is None or r.ttft * 1000 <= self.ttft_ms) \
            and (self.tpot_ms is None or tpot * 1000 <= self.tpot_ms) \
            and (self.e2el_ms is None or r.latency * 1000 <= self.e2el_ms)


def summarize(results: list[RequestResult], duration_s: float, slo: SLO | None = None) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = f"HTTP {r.status}" if r.status not in (None, 200) else r.error.split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    d = max(duration_s, 1e-9)
    out = {
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors,
        "duration_s": duration_s, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / d, "output_throughput": out_tokens / d,
        "total_token_throughput": (in_tokens + out_tokens) / d,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2el_ms": _stats([r.latency for r in ok]),
    }
    if slo is not None:
        good = sum(1 for r in ok if slo.met(r))
        out["goodput"] = {"slo": {k: v for k, v in vars(slo).items() if v is not None},
                          "good_requests": good, "request_goodput": good / d}
    return out
