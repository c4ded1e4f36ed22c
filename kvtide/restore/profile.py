"""Online latency profile F(t) and load-bandwidth estimate for the planner (CacheFlow §3.2, "in practice").

The engine and the executor report (tokens, seconds) of work they run anyway. F is a convex, nondecreasing
piecewise-linear least-squares fit of log-spaced bucket medians (per-call overhead + convex work, the shape the
planner's fast solver needs), extended as a power law above the largest observation. Beside F the profile keeps
what predicting the executor needs: separate bandwidths for loads alone and beside a replay, and the suffix,
fixed-overhead and compute-scale corrections as lower medians of recent measurements (one-off slow runs do not
stick). Why each of these: docs/design/executor.md.
"""

from __future__ import annotations

import bisect
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
    overhead_window: int = 9  # executor measurements kept for the suffix/fixed overheads and the compute scale
    # loads that ran beside a replay get their own bandwidth estimate, which hybrid plans read (False: one estimate
    # over every load, for comparison)
    separate_overlapped_loads: bool = True
    # the executor's first layer call at each token count in a process is not recorded (observe_call): it carries a
    # new shape's one-off costs, and one such observation alone in a bucket can lift F flat over a wide range of
    # token counts. Prefill observations are kept.
    skip_first_layer_call: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.buckets_per_octave, int) or self.buckets_per_octave < 1:
            raise ValueError(f"buckets_per_octave must be an int >= 1, got {self.buckets_per_octave!r}")
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an int >= 1, got {self.window!r}")
        if not isinstance(self.overhead_window, int) or self.overhead_window < 1:
            raise ValueError(f"overhead_window must be an int >= 1, got {self.overhead_window!r}")
        if not 0.0 < self.bandwidth_alpha <= 1.0:
            raise ValueError(f"bandwidth_alpha must be in (0, 1], got {self.bandwidth_alpha!r}")
        if not isinstance(self.separate_overlapped_loads, bool):
            raise ValueError(f"separate_overlapped_loads must be a bool, got {self.separate_overlapped_loads!r}")
        if not isinstance(self.skip_first_layer_call, bool):
            raise ValueError(f"skip_first_layer_call must be a bool, got {self.skip_first_layer_call!r}")


class _Recent:
    """The lower median of the last ``n`` values (None before any): robust to one-off slow runs."""

    def __init__(self, n: int, values: Any = None) -> None:
        self.values: deque[float] = deque(maxlen=n)
        if isinstance(values, (int, float)):  # profiles saved before the window kept a single average
            values = [values]
        for v in values or []:
            self.values.append(float(v))

    def add(self, x: float) -> None:
        self.values.append(float(x))

    @property
    def value(self) -> float | None:
        if not self.values:
            return None
        v = sorted(self.values)
        return v[(len(v) - 1) // 2]


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


def _convex_fit(t: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Values at ``t`` of the convex nondecreasing piecewise-linear function with least weighted relative squared
    error: a + b t + sum_k c_k max(0, t - t_k), all coefficients >= 0 (NNLS)."""
    from scipy.optimize import nnls

    cols = [np.ones_like(t), t] + [np.maximum(0.0, t - tk) for tk in t[1:-1]]
    A = np.stack(cols, axis=1)
    scale = np.sqrt(w) / np.maximum(y, 1e-12)  # relative error, more weight to fuller buckets
    colnorm = np.maximum(np.abs(A).max(0), 1e-300)  # conditioning: t spans orders of magnitude
    beta, _ = nnls(A * scale[:, None] / colnorm, y * scale, maxiter=50 * A.shape[1])
    f = A @ (beta / colnorm)
    return np.maximum.accumulate(np.maximum(f, 0.0))


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


def _pieces(t: np.ndarray, y: np.ndarray, convex: bool) -> tuple:
    """Constants of F outside the knots: (tokens, seconds) lists, first slope, last slope, power p."""
    tl, yl = t.tolist(), y.tolist()
    if t.size < 2:
        return tl, yl, 0.0, 0.0, 1.0, convex
    slope0 = (yl[1] - yl[0]) / (tl[1] - tl[0])
    slope_n = (yl[-1] - yl[-2]) / (tl[-1] - tl[-2])
    p = 1.0
    if yl[-2] > 0 and yl[-1] > yl[-2]:
        p = min(max(math.log(yl[-1] / yl[-2]) / math.log(tl[-1] / tl[-2]), 1.0), 2.0)
    return tl, yl, slope0, slope_n, p, convex


def _eval_scalar(x: float, pieces: tuple) -> float:
    """F(x) for x > 0 (the same function as ``_eval_array``)."""
    tl, yl, slope0, slope_n, p, convex = pieces
    if len(tl) == 1:
        return yl[0] * x / tl[0]
    if x < tl[0]:
        return max(yl[0] + slope0 * (x - tl[0]), 0.0) if convex else yl[0] * x / tl[0]
    if x > tl[-1]:
        return max(yl[-1] + slope_n * (x - tl[-1]), yl[-1] * (x / tl[-1]) ** p)
    i = bisect.bisect_right(tl, x)
    if i >= len(tl):
        return yl[-1]
    t0, t1, y0, y1 = tl[i - 1], tl[i], yl[i - 1], yl[i]
    return y0 + (y1 - y0) * (x - t0) / (t1 - t0)


def _eval_array(x: np.ndarray, t: np.ndarray, y: np.ndarray, pieces: tuple) -> np.ndarray:
    """F(x) where x > 0; entries with x <= 0 are left to the caller, which sets them to 0 (so the planner's
    grid point 0 does not cost the extension below the first knot)."""
    tl, yl, slope0, slope_n, p, convex = pieces
    if t.size == 1:
        return y[0] * x / t[0]  # one point: proportional through the origin
    out = np.interp(x, t, y)
    # count_nonzero rather than any(): a ufunc reduction costs several times more on arrays this small
    lo = (x < tl[0]) & (x > 0)
    if np.count_nonzero(lo):
        below = np.maximum(yl[0] + slope0 * (x - tl[0]), 0.0) if convex else yl[0] * x / tl[0]
        out = np.where(lo, below, out)
    hi = x > tl[-1]
    if np.count_nonzero(hi):
        ratio = np.maximum(x, tl[-1]) / tl[-1]
        out = np.where(hi, np.maximum(yl[-1] + slope_n * (x - tl[-1]), yl[-1] * ratio**p), out)
    return out


class LatencyProfile:
    """F(t): seconds to replay t tokens through one block; plus the measured load bandwidth (bytes/s)."""

    vectorized: ClassVar[bool] = True  # the planner may call it on arrays

    def __init__(self, config: ProfileConfig | None = None, fallback: Callable[[Any], Any] | None = None) -> None:
        self.config = config or ProfileConfig()
        self.fallback = fallback or AnalyticReplayTime()
        self._buckets: dict[int, deque[tuple[int, float, int]]] = {}  # (tokens, s per block, from a prefill)
        self._bandwidth: float | None = None  # loads with no replay beside them (load-only plans)
        self._bandwidth_overlap: float | None = None  # loads while the compute side replayed (hybrid plans)
        # the load path's own rate per (tier, overlapped): bytes over the seconds a load worked, link waits excluded.
        # Kept across link changes (reset_bandwidth): it belongs to the tier and codec, not to the link.
        self._path: dict[tuple[str, bool], float] = {}
        self._load_observations = 0
        n = self.config.overhead_window
        self._suffix_pairs: deque[tuple[float, float]] = deque(maxlen=2 * n)  # (modelled, measured) per block
        self._fixed = _Recent(n)
        self._scale = _Recent(n)
        self._scale_by_batch: dict[int, _Recent] = {}
        self._lock = threading.Lock()
        self._knots: tuple[tuple[np.ndarray, np.ndarray], tuple] | None = None
        self._warm: set[int] = set()  # token counts whose first layer call was seen (this process; not saved)

    # ------------------------------------------------------------------ observations

    def _bucket(self, tokens: int) -> int:
        return int(math.floor(math.log2(tokens) * self.config.buckets_per_octave + 0.5))

    def observe(self, tokens: int, seconds: float, blocks: int = 1, source: str = "layer") -> None:
        """Record a replay of ``tokens`` tokens through ``blocks`` blocks that took ``seconds``.

        ``source``: "layer" for a layer call timed alone (the executor's replay, what F predicts), "prefill" for a
        whole-model step divided by its blocks (the engine's prefills; it carries per-step costs a layer call does
        not). A bucket that holds layer calls uses only them: mixed with prefills, F flattens where prefills
        dominate and predictions drift."""
        if source not in ("layer", "prefill"):
            raise ValueError(f"source must be 'layer' or 'prefill', got {source!r}")
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
            q.append((tokens, per_block, int(source == "prefill")))
            self._knots = None

    def observe_call(self, tokens: int, seconds: float) -> None:
        """A layer call the executor timed: ``observe`` it, unless it is the first at this token count in this
        process and ``ProfileConfig.skip_first_layer_call`` (one-off costs of a new shape, not F)."""
        tokens = int(tokens)
        with self._lock:
            first = tokens not in self._warm
            self._warm.add(tokens)
        if not (first and self.config.skip_first_layer_call):
            self.observe(tokens, seconds)

    def observe_load(self, nbytes: float, seconds: float, overlapped: bool = False) -> None:
        """Record a load of ``nbytes`` bytes that took ``seconds``; updates the bandwidth EWMA.

        ``overlapped``: the compute side replayed layers while this load ran. Such loads get their own estimate:
        the load path shares the host (GIL, memory copies) and the device with the replay, so those loads run
        slower, and plans made with one mixed figure load more than the link delivers in time."""
        nbytes, seconds = float(nbytes), float(seconds)
        if nbytes <= 0 or seconds <= 0 or not (math.isfinite(nbytes) and math.isfinite(seconds)):
            return  # nothing measurable (cache hit in RAM, clock resolution): ignore rather than skew
        bw = nbytes / seconds
        a = self.config.bandwidth_alpha
        with self._lock:
            if overlapped and self.config.separate_overlapped_loads:
                old = self._bandwidth_overlap
                self._bandwidth_overlap = bw if old is None else a * bw + (1 - a) * old
            else:
                self._bandwidth = bw if self._bandwidth is None else a * bw + (1 - a) * self._bandwidth
            self._load_observations += 1

    def observe_path(self, tier: str, nbytes: float, seconds: float, overlapped: bool = False) -> None:
        """A load of ``nbytes`` whose path (fetch, verify, decode, copy) worked ``seconds``: its time less the time
        spent waiting for the link. The rate the tier and codec deliver where the link is not the bottleneck, so a
        plan at a faster link than the path can carry assumes the path's rate (EWMA per tier, loads beside a
        replay apart as for the bandwidth)."""
        nbytes, seconds = float(nbytes), float(seconds)
        if nbytes <= 0 or seconds <= 0 or not (math.isfinite(nbytes) and math.isfinite(seconds)):
            return
        key = (str(tier), bool(overlapped and self.config.separate_overlapped_loads))
        bw, a = nbytes / seconds, self.config.bandwidth_alpha
        with self._lock:
            old = self._path.get(key)
            self._path[key] = bw if old is None else a * bw + (1 - a) * old

    def path_bandwidth_for(self, tier: str, overlapped: bool) -> float | None:
        """The load path's measured rate for ``tier`` (bytes/s; the other kind of load if this one has none)."""
        ov = bool(overlapped and self.config.separate_overlapped_loads)
        with self._lock:
            v = self._path.get((str(tier), ov))
            return v if v is not None else self._path.get((str(tier), not ov))

    def observe_suffix(self, per_block_seconds: float, modelled_seconds: float) -> None:
        """A suffix layer call took ``per_block_seconds`` where F(N + Ns) - F(N) summed to ``modelled_seconds``."""
        m, x = float(modelled_seconds), float(per_block_seconds)
        if math.isfinite(m) and math.isfinite(x) and m >= 0 and x >= 0:
            with self._lock:
                self._suffix_pairs.append((m, x))

    def observe_overhead(self, seconds: float) -> None:
        """A restoration spent ``seconds`` outside its compute and load paths."""
        x = float(seconds)
        if math.isfinite(x) and x >= 0:
            with self._lock:
                self._fixed.add(x)

    def observe_compute(self, seconds: float, modelled_seconds: float, batch: int = 1) -> None:
        """A staircase of ``batch`` requests took ``seconds`` where the cost model (F summed over its layers) said
        ``modelled_seconds``.

        F is a per-bucket median of single layer calls; a sum over many layers runs at their mean, above the
        median on a shared host (a descheduled layer is slow, none is fast), and batched layer calls differ from
        the additive model. The ratio (clamped to [0.5, 2], lower median of the recent ones) scales F in the
        plan's cost, per batch size: the additive model's error depends on it, and one scale for all sizes is
        wrong for each.
        """
        s, m = float(seconds), float(modelled_seconds)
        if s > 0 and m > 0 and math.isfinite(s / m) and batch >= 1:
            r = min(max(s / m, 0.5), 2.0)
            with self._lock:
                self._scale.add(r)
                q = self._scale_by_batch.get(int(batch))
                if q is None:
                    q = self._scale_by_batch[int(batch)] = _Recent(self.config.overhead_window)
                q.add(r)

    @property
    def compute_scale(self) -> float:
        """The measured/modelled compute ratio over all batch sizes (1 before any observation)."""
        return self._scale.value or 1.0

    def compute_scale_for(self, batch: int) -> float:
        """The ratio for restorations of ``batch`` requests; the all-sizes ratio until that size was observed."""
        with self._lock:
            q = self._scale_by_batch.get(int(batch))
        v = q.value if q is not None else None
        return v if v is not None else self.compute_scale

    @property
    def call_overhead(self) -> float:
        """F's fixed cost of one layer call (its value at t -> 0+): the intercept of the fit, in [0, F(first knot)]."""
        (t, _), pieces = self._curve()
        if t.size < 2:
            return 0.0
        tl, yl, slope0 = pieces[0], pieces[1], pieces[2]
        return min(max(0.0, yl[0] - slope0 * tl[0]), yl[0])

    def call_overhead_at(self, tokens: float) -> float:
        """The part of a layer call of ~``tokens`` tokens that a batch of such calls pays once: the intercept of F's
        secant over [tokens/2, tokens], 2 F(t/2) - F(t), in [0, ``call_overhead``].

        F's global intercept is the cost of a nearly empty call; whether batching saves it depends on where the
        calls sit. Streaming a small model's weights on a CPU is a fixed cost per call, but a large layer over
        thousands of tokens on a GPU is compute-bound, linear in the tokens of the batch, so a batch of such calls
        saves almost none of the global intercept."""
        c = self.call_overhead
        t = float(tokens)
        if c <= 0.0 or t <= 1.0:
            return c
        return min(max(0.0, 2.0 * float(self(t / 2)) - float(self(t))), c)

    @property
    def suffix_scale(self) -> float:
        """Measured suffix call time over F(N + Ns) - F(N), as a slope: the Theil-Sen median of the pairwise slopes
        between recent suffix calls whose modelled times differ by 2x or more (robust to a cold run), clamped to
        [0.25, 4]; 1 until three such pairs exist (short suffixes alone say nothing about it)."""
        with self._lock:
            obs = list(self._suffix_pairs)
        slopes = sorted((xi - xj) / (mi - mj) for mi, xi in obs for mj, xj in obs if mi > 0 and mi >= 2 * mj)
        if len(slopes) < 3:
            return 1.0
        return min(max(slopes[(len(slopes) - 1) // 2], 0.25), 4.0)

    @property
    def suffix_overhead(self) -> float:
        """Seconds per block a suffix call costs beyond ``suffix_scale`` x the F difference: the lower median of the
        recent residuals, at least 0 (prior: F(1), a one-token call)."""
        with self._lock:
            obs = list(self._suffix_pairs)[-self.config.overhead_window:]
        if not obs:
            return float(self(1))
        k = self.suffix_scale
        res = sorted(max(0.0, x - k * m) for m, x in obs)
        return res[(len(res) - 1) // 2]

    @property
    def fixed_overhead(self) -> float:
        return self._fixed.value or 0.0

    def reset_bandwidth(self) -> None:
        """Forget the load-bandwidth estimates (the link changed); F(t) and the load paths' rates are kept."""
        with self._lock:
            self._bandwidth = self._bandwidth_overlap = None

    def bandwidth_for(self, overlapped: bool) -> float | None:
        """Bytes per second (EWMA) of loads with (``overlapped``) or without a replay beside them; the other
        estimate where this one has no observation yet; None before any load was observed."""
        first, other = (self._bandwidth_overlap, self._bandwidth) if overlapped else \
            (self._bandwidth, self._bandwidth_overlap)
        return first if first is not None else other

    @property
    def bandwidth(self) -> float | None:
        """What a hybrid plan's loads get (bytes/s): the overlapped estimate, else the load-alone one."""
        return self.bandwidth_for(True)

    @property
    def solo_bandwidth(self) -> float | None:
        """Bytes per second of loads that ran with no replay beside them (None: none observed)."""
        return self._bandwidth

    @property
    def overlap_bandwidth(self) -> float | None:
        """Bytes per second of loads that ran beside a replay (None: none observed)."""
        return self._bandwidth_overlap

    @property
    def num_observations(self) -> int:
        return sum(len(q) for q in self._buckets.values())

    # ------------------------------------------------------------------ the function

    def knots(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, seconds) points F interpolates, after median, isotonic and (optional) convex steps."""
        return self._curve()[0]

    def _curve(self) -> tuple[tuple[np.ndarray, np.ndarray], tuple]:
        """Knots and the constants of the pieces outside them, refit only after new observations (the planner
        calls F on every plan: this keeps a call to a few microseconds)."""
        with self._lock:
            if self._knots is None:
                t, y = self._fit()
                self._knots = ((t, y), _pieces(t, y, self.config.convex))
            return self._knots

    def _fit(self) -> tuple[np.ndarray, np.ndarray]:
        if not self._buckets:
            return np.zeros(0), np.zeros(0)
        rows = []
        for q in self._buckets.values():
            arr = np.array(q, dtype=np.float64)
            layer = arr[arr[:, 2] == 0]
            if len(layer):
                arr = layer
            rows.append((float(np.median(arr[:, 0])), float(np.median(arr[:, 1])), len(arr)))
        rows.sort()
        t = np.array([r[0] for r in rows])
        w = np.array([r[2] for r in rows], dtype=np.float64)
        y = np.array([r[1] for r in rows])
        if self.config.convex and t.size > 2:
            return t, _convex_fit(t, y, w)
        return t, _isotonic(y, w)

    def __call__(self, tokens):  # type: ignore[no-untyped-def]
        (t, y), pieces = self._curve()
        if isinstance(tokens, (int, float, np.integer, np.floating)):  # scalar: plain Python, no arrays
            x = float(tokens)
            if x <= 0:
                return 0.0
            if t.size == 0:
                return float(self.fallback(x))
            return _eval_scalar(x, pieces)
        x = np.asarray(tokens, dtype=np.float64)
        if t.size == 0:
            out = np.asarray(self.fallback(x), dtype=np.float64)
        else:
            out = _eval_array(x, t, y, pieces)
        out = np.where(x <= 0, 0.0, out)
        return float(out) if out.ndim == 0 else out

    # ------------------------------------------------------------------ persistence

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "version": PROFILE_VERSION,
                "config": asdict(self.config),
                "observations": {str(b): [list(o) for o in q] for b, q in sorted(self._buckets.items())},
                "bandwidth": self._bandwidth,
                "bandwidth_overlapped": self._bandwidth_overlap,
                "load_observations": self._load_observations,
                "load_paths": [[tier, ov, v] for (tier, ov), v in sorted(self._path.items())],
                "suffix_pairs": [list(o) for o in self._suffix_pairs],
                "fixed_overhead": list(self._fixed.values),
                "compute_scale": list(self._scale.values),
                "compute_scale_by_batch": {str(b): list(q.values) for b, q in sorted(self._scale_by_batch.items())},
            }

    @classmethod
    def from_dict(cls, d: dict[str, Any], fallback: Callable[[Any], Any] | None = None) -> "LatencyProfile":
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"unsupported profile version {d.get('version')!r} (expected {PROFILE_VERSION})")
        prof = cls(ProfileConfig(**d["config"]), fallback=fallback)
        for obs in d["observations"].values():
            for o in obs:  # [tokens, seconds] (saved before sources were kept) or [tokens, seconds, from_prefill]
                prof.observe(int(o[0]), float(o[1]), source="prefill" if len(o) > 2 and o[2] else "layer")
        bw = d.get("bandwidth")
        prof._bandwidth = None if bw is None else float(bw)
        bwo = d.get("bandwidth_overlapped")  # absent in profiles saved before the two were kept apart
        prof._bandwidth_overlap = None if bwo is None else float(bwo)
        prof._load_observations = int(d.get("load_observations", 0))
        for tier, ov, v in d.get("load_paths", []):  # absent in profiles saved before paths were measured
            prof._path[(str(tier), bool(ov))] = float(v)
        n = prof.config.overhead_window
        old = d.get("suffix_overhead")  # saved before pairs were kept: overheads over a zero difference
        old = [old] if isinstance(old, (int, float)) else (old or [])
        prof._suffix_pairs = deque([(0.0, float(v)) for v in old], maxlen=2 * n)
        prof._suffix_pairs.extend((float(m), float(x)) for m, x in d.get("suffix_pairs", []))
        prof._fixed = _Recent(n, d.get("fixed_overhead"))
        prof._scale = _Recent(n, d.get("compute_scale"))
        prof._scale_by_batch = {int(b): _Recent(n, v) for b, v in d.get("compute_scale_by_batch", {}).items()}
        return prof

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, s: str, fallback: Callable[[Any], Any] | None = None) -> "LatencyProfile":
        return cls.from_dict(json.loads(s), fallback=fallback)
