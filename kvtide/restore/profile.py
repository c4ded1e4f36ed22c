"""Online latency profile F(t) and load-bandwidth estimate for the planner (CacheFlow §3.2, "in practice").

The engine reports (tokens, seconds) after prefills it runs anyway; F is rebuilt from per-bucket medians so
one slow outlier (GC pause, page fault) does not move the plan. Buckets are log-spaced because prefill
lengths span orders of magnitude and relative accuracy is what matters.

Shape of F (``convex=True``, the default): isotonic (nondecreasing) medians, then their lower convex hull,
extended affinely below the first observation and clamped at 0 with F(0) = 0. That is "per-call overhead +
convex work": convex for t > 0 with a possible jump at 0, the structure the planner's fast solver needs,
and it smooths measurement noise that would otherwise fake non-convexity. With ``convex=False`` F is the
monotone piecewise-linear interpolation of the medians through (0, 0).
Above the largest observation F grows like a power law t^p with p in [1, 2] taken from the last two knots
(attention makes long prefixes superlinear), never below the linear continuation.
"""

from __future__ import annotations

import json
import math
import threading
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable, ClassVar

import numpy as np

from kvtide.restore.costs import AnalyticReplayTime

PROFILE_VERSION = 1


@dataclass(frozen=True)
class ProfileConfig:
    """How observations are bucketed and summarised."""

    buckets_per_octave: int = 4
    window: int = 32  # newest observations kept per bucket; the median is over these
    convex: bool = True
    bandwidth_alpha: float = 0.2  # EWMA weight of the newest load-bandwidth observation

    def __post_init__(self) -> None:
        if not isinstance(self.buckets_per_octave, int) or self.buckets_per_octave < 1:
            raise ValueError(f"buckets_per_octave must be an int >= 1, got {self.buckets_per_octave!r}")
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an int >= 1, got {self.window!r}")
        if not 0.0 < self.bandwidth_alpha <= 1.0:
            raise ValueError(f"bandwidth_alpha must be in (0, 1], got {self.bandwidth_alpha!r}")


def _isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted pool-adjacent-violators: the closest nondecreasing sequence."""
    vals: list[float] = []
    wts: list[float] = []
    lens: list[int] = []
    for yi, wi in zip(y.tolist(), w.tolist()):
        vals.append(yi)
        wts.append(wi)
        lens.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            v2, w2, l2 = vals.pop(), wts.pop(), lens.pop()
            v1, w1, l1 = vals.pop(), wts.pop(), lens.pop()
            vals.append((v1 * w1 + v2 * w2) / (w1 + w2))
            wts.append(w1 + w2)
            lens.append(l1 + l2)
    return np.repeat(np.array(vals), lens)


def _lower_hull(t: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Indices of the lower convex hull of points sorted by t (monotone chain)."""
    idx: list[int] = []
    for i in range(t.size):
        while len(idx) >= 2:
            a, b = idx[-2], idx[-1]
            # drop b if it lies on or above the segment a -> i
            if (y[b] - y[a]) * (t[i] - t[a]) >= (y[i] - y[a]) * (t[b] - t[a]):
                idx.pop()
            else:
                break
        idx.append(i)
    return np.array(idx, dtype=np.int64)


class LatencyProfile:
    """F(t): seconds to replay t tokens through one block; plus the measured load bandwidth (bytes/s)."""

    vectorized: ClassVar[bool] = True  # the planner may call it on arrays

    def __init__(self, config: ProfileConfig | None = None, fallback: Callable[[Any], Any] | None = None) -> None:
        self.config = config or ProfileConfig()
        self.fallback = fallback or AnalyticReplayTime()
        self._buckets: dict[int, deque[tuple[int, float]]] = {}
        self._bandwidth: float | None = None
        self._load_observations = 0
        self._lock = threading.Lock()
        self._knots: tuple[np.ndarray, np.ndarray] | None = None

    # ------------------------------------------------------------------ observations

    def _bucket(self, tokens: int) -> int:
        return int(math.floor(math.log2(tokens) * self.config.buckets_per_octave + 0.5))

    def observe(self, tokens: int, seconds: float, blocks: int = 1) -> None:
        """Record a replay of ``tokens`` tokens through ``blocks`` blocks that took ``seconds``."""
        tokens = int(tokens)
        seconds = float(seconds)
        if tokens <= 0 or blocks <= 0 or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"need tokens > 0, blocks > 0, finite seconds >= 0; got {tokens}, {blocks}, {seconds}")
        per_block = seconds / blocks
        with self._lock:
            b = self._bucket(tokens)
            q = self._buckets.get(b)
            if q is None:
                q = self._buckets[b] = deque(maxlen=self.config.window)
            q.append((tokens, per_block))
            self._knots = None

    def observe_load(self, nbytes: float, seconds: float) -> None:
        """Record a load of ``nbytes`` bytes that took ``seconds``; updates the bandwidth EWMA."""
        nbytes, seconds = float(nbytes), float(seconds)
        if nbytes <= 0 or seconds <= 0 or not (math.isfinite(nbytes) and math.isfinite(seconds)):
            return  # nothing measurable (cache hit in RAM, clock resolution): ignore rather than skew
        bw = nbytes / seconds
        a = self.config.bandwidth_alpha
        with self._lock:
            self._bandwidth = bw if self._bandwidth is None else a * bw + (1 - a) * self._bandwidth
            self._load_observations += 1

    def reset_bandwidth(self) -> None:
        """Forget the load-bandwidth estimate (the link changed); F(t) is kept."""
        with self._lock:
            self._bandwidth = None

    @property
    def bandwidth(self) -> float | None:
        """Bytes per second (EWMA), or None before any load was observed."""
        return self._bandwidth

    @property
    def num_observations(self) -> int:
        return sum(len(q) for q in self._buckets.values())

    # ------------------------------------------------------------------ the function

    def knots(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, seconds) points F interpolates, after median, isotonic and (optional) convex steps."""
        with self._lock:
            if self._knots is None:
                self._knots = self._fit()
            return self._knots

    def _fit(self) -> tuple[np.ndarray, np.ndarray]:
        if not self._buckets:
            return np.zeros(0), np.zeros(0)
        rows = []
        for q in self._buckets.values():
            arr = np.array(q, dtype=np.float64)
            rows.append((float(np.median(arr[:, 0])), float(np.median(arr[:, 1])), len(q)))
        rows.sort()
        t = np.array([r[0] for r in rows])
        y = _isotonic(np.array([r[1] for r in rows]), np.array([r[2] for r in rows], dtype=np.float64))
        if self.config.convex and t.size > 2:
            h = _lower_hull(t, y)
            t, y = t[h], y[h]
        return t, y

    def __call__(self, tokens):  # type: ignore[no-untyped-def]
        x = np.asarray(tokens, dtype=np.float64)
        t, y = self.knots()
        if t.size == 0:
            out = np.asarray(self.fallback(x), dtype=np.float64)
        else:
            out = self._interp(x, t, y)
        out = np.where(x <= 0, 0.0, out)
        return float(out) if out.ndim == 0 else out

    def _interp(self, x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        if t.size == 1:
            return y[0] * x / t[0]  # one point: proportional through the origin
        inside = np.interp(x, t, y)
        if self.config.convex:
            slope0 = (y[1] - y[0]) / (t[1] - t[0])
            below = np.maximum(y[0] + slope0 * (x - t[0]), 0.0)
        else:
            below = y[0] * x / t[0]
        slope_n = (y[-1] - y[-2]) / (t[-1] - t[-2])
        p = 1.0
        if y[-2] > 0 and y[-1] > y[-2]:
            p = min(max(math.log(y[-1] / y[-2]) / math.log(t[-1] / t[-2]), 1.0), 2.0)
        ratio = np.maximum(x, t[-1]) / t[-1]
        above = np.maximum(y[-1] + slope_n * (x - t[-1]), y[-1] * ratio**p)
        return np.where(x < t[0], below, np.where(x > t[-1], above, inside))

    # ------------------------------------------------------------------ persistence

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "version": PROFILE_VERSION,
                "config": asdict(self.config),
                "observations": {str(b): [list(o) for o in q] for b, q in sorted(self._buckets.items())},
                "bandwidth": self._bandwidth,
                "load_observations": self._load_observations,
            }

    @classmethod
    def from_dict(cls, d: dict[str, Any], fallback: Callable[[Any], Any] | None = None) -> "LatencyProfile":
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"unsupported profile version {d.get('version')!r} (expected {PROFILE_VERSION})")
        prof = cls(ProfileConfig(**d["config"]), fallback=fallback)
        for obs in d["observations"].values():
            for tok, sec in obs:
                prof.observe(int(tok), float(sec))
        bw = d.get("bandwidth")
        prof._bandwidth = None if bw is None else float(bw)
        prof._load_observations = int(d.get("load_observations", 0))
        return prof

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, s: str, fallback: Callable[[Any], Any] | None = None) -> "LatencyProfile":
        return cls.from_dict(json.loads(s), fallback=fallback)
