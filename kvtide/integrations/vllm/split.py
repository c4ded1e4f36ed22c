"""Planned split: how much of a store match to load when vLLM can recompute the rest (CacheFlow, token-wise).

vLLM lets a connector say only "the next k tokens are external": the loaded part is a prefix of the match, shared
by every layer, and vLLM computes everything after it. That is CacheFlow's staircase restricted to one boundary j
for all layers, with the roles mirrored (load the front, recompute the back). The step then runs as a two-stage
pipeline over the L layers: the loader fills layer i while the forward pass computes layer i - 1, and layer i's
attention waits for its load. With l the load time of one layer and c the compute time of one layer,

    T(j) = max(L * l(j) + c(j), l(j) + L * c(j))

(the last layer computed after every load, or the first load followed by every layer's compute; exact for equal
layers, ``simulate`` is the event-by-event version the tests compare with). l(j) = (j - start) * tau, tau the
measured seconds per token and layer of the connector's loads (link, checks, decoding and placing together), and
L * c(j) = G(end) - G(j) from ``PrefillModel``, vLLM's own measured prefill steps. The plan is the j on the chunk
grid (plus the match's end) with the least T; j = start is "recompute all", j = the match's end "load all", so
under the model the plan is never worse than the better of the two. A plan that recomputes part of the match must
beat loading all of it by ``margin`` (a fraction of the load-all time), else the whole match is loaded: the
recompute and the loads beside it share the host (cores, GIL, memory bandwidth), which slows both in a way the two
separately measured rates do not see, and the model's error runs that way (on a CPU, ZipFusion decoding beside a
recompute ran at half its speed alone).

What vLLM's API does not let a connector do: recompute the *front* of a match and load the back (CacheFlow's and
Cake's other half), give layers different boundaries (the staircase), or split the recompute and the loads of a
batch of requests jointly; ``docs/design/vllm_connector.md`` says more.
"""
from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


def pipeline_seconds(load_per_layer: float, compute_per_layer: float, layers: int) -> float:
    """Finish time of L layers where layer i's compute waits for its own load and for layer i - 1's compute."""
    l, c = load_per_layer, compute_per_layer
    return max(layers * l + c, l + layers * c)


def simulate(load_per_layer: float, compute_per_layer: float, layers: int) -> float:
    """The same pipeline event by event (what ``pipeline_seconds`` has in closed form)."""
    loaded = computed = 0.0
    for _ in range(layers):
        loaded += load_per_layer
        computed = max(computed, loaded) + compute_per_layer
    return computed


class PrefillModel:
    """Seconds of a vLLM forward step from the tokens it computes: a + sum_r [b n_r + c ((p_r + n_r)^2 - p_r^2)]
    for requests r computing n_r tokens after p_r already in the cache (linear work and attention over the
    context). Fitted with non-negative coefficients over the last ``window`` steps of at least ``min_tokens`` tokens
    (decode-only steps, memory-bound, would skew it); until three steps of different sizes are known, the
    proportional model b = seconds / tokens (which overstates short recomputes, so it errs toward loading)."""

    def __init__(self, window: int = 64, min_tokens: int = 64) -> None:
        self.min_tokens = min_tokens
        self._rows: deque[tuple[float, float, float]] = deque(maxlen=window)  # (tokens, context term, seconds)
        self._lock = threading.Lock()
        self._coef: tuple[float, float, float] | None = None

    def observe(self, parts: Sequence[tuple[int, int]], seconds: float) -> None:
        """A step that computed ``n`` tokens after ``p`` cached ones for each (p, n) in ``parts``."""
        n = sum(b for _, b in parts)
        if n < self.min_tokens or not (math.isfinite(seconds) and seconds > 0):
            return
        ctx = float(sum((p + b) ** 2 - p ** 2 for p, b in parts))
        with self._lock:
            self._rows.append((float(n), ctx, float(seconds)))
            self._coef = None

    @property
    def ready(self) -> bool:
        return bool(self._rows)

    def coefficients(self) -> tuple[float, float, float]:
        """(a, b, c) of the model; (0, 0, 0) before any observation."""
        with self._lock:
            if self._coef is None:
                self._coef = self._fit(list(self._rows))
            return self._coef

    @staticmethod
    def _fit(rows: list[tuple[float, float, float]]) -> tuple[float, float, float]:
        if not rows:
            return 0.0, 0.0, 0.0
        arr = np.array(rows)
        n, ctx, y = arr[:, 0], arr[:, 1], arr[:, 2]
        if len(rows) < 3 or n.max() < 2 * n.min():
            return 0.0, float(y.sum() / n.sum()), 0.0
        from scipy.optimize import nnls

        A = np.stack([np.ones_like(n), n, ctx], axis=1)
        w = 1.0 / np.maximum(y, 1e-9)  # relative error: short steps count as much as long ones
        norm = np.maximum(np.abs(A).max(0), 1e-300)
        beta, _ = nnls(A * w[:, None] / norm, y * w)
        a, b, c = (beta / norm).tolist()
        if b <= 0 and c <= 0:  # every second put on the per-step constant: no use for a split
            return 0.0, float(y.sum() / n.sum()), 0.0
        return a, b, c

    def compute_seconds(self, start: int, end: int) -> float:
        """Predicted seconds to compute tokens [start, end) of one request whose first ``start`` are cached."""
        if end <= start:
            return 0.0
        _, b, c = self.coefficients()
        return b * (end - start) + c * (float(end) ** 2 - float(start) ** 2)


class LoadRate:
    """Seconds per (token x layer) of the connector's loads, an EWMA over load jobs; with the bytes, the
    effective link rate for the stats."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self.seconds_per_token_layer: float | None = None
        self.bytes_per_second: float | None = None

    def observe(self, token_layers: int, nbytes: int, seconds: float) -> None:
        if token_layers <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        a = self.alpha
        tau, bw = seconds / token_layers, nbytes / seconds
        old_t, old_b = self.seconds_per_token_layer, self.bytes_per_second
        self.seconds_per_token_layer = tau if old_t is None else a * tau + (1 - a) * old_t
        self.bytes_per_second = bw if old_b is None else a * bw + (1 - a) * old_b


@dataclass(frozen=True)
class SplitPlan:
    """Load tokens [start, load_end) and let vLLM recompute [load_end, end); predicted seconds of the plan and of
    the two extremes."""

    start: int
    load_end: int
    match_end: int
    predicted_seconds: float
    load_all_seconds: float
    recompute_all_seconds: float

    @property
    def load_tokens(self) -> int:
        return self.load_end - self.start

    @property
    def recompute_tokens(self) -> int:
        """Tokens of the match that vLLM recomputes instead of loading."""
        return self.match_end - self.load_end


def candidates(start: int, match_end: int, chunk: int) -> list[int]:
    """Boundaries j a plan may pick: ``start``, the chunk boundaries between, and ``match_end``."""
    if chunk <= 0:
        raise ValueError(f"chunk must be > 0, got {chunk}")
    if match_end < start:
        raise ValueError(f"match end {match_end} is before its start {start}")
    first = start // chunk + 1
    return [start] + [k * chunk for k in range(first, -(-match_end // chunk)) if k * chunk < match_end] + \
        ([match_end] if match_end > start else [])


def plan_split(start: int, match_end: int, end: int, chunk: int, layers: int, seconds_per_token_layer: float,
               compute: Callable[[int, int], float], margin: float = 0.0) -> SplitPlan:
    """The boundary with the least predicted time: tokens [start, match_end) are in the store, [start, end) must
    be in place after the step (``end`` > ``match_end``: vLLM computes at least the last token).
    ``compute(j, end)``: seconds of the forward pass that computes tokens [j, end) (``PrefillModel``).
    ``margin``: a boundary before ``match_end`` is taken only if it beats loading the whole match by this
    fraction of the load-all time."""
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if not (seconds_per_token_layer >= 0 and math.isfinite(seconds_per_token_layer)):
        raise ValueError(f"seconds_per_token_layer must be finite and >= 0, got {seconds_per_token_layer!r}")
    if end < match_end:
        raise ValueError(f"end {end} is before the match end {match_end}")
    js = candidates(start, match_end, chunk)
    times = [pipeline_seconds((j - start) * seconds_per_token_layer, compute(j, end) / layers, layers) for j in js]
    best = min(range(len(js)), key=lambda i: (times[i], -js[i]))  # ties: load more (no recompute)
    if times[best] > (1.0 - margin) * times[-1]:
        best = len(js) - 1
    return SplitPlan(start, js[best], match_end, times[best], times[-1], times[0])
