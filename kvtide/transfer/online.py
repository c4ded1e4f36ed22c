"""Online layer of the controller (KVServe section 6.2): policy table + residual-corrected bandit.

* Offline, per quality bucket, the lower envelope of the lines T(x) = 1/s_p + x/cr_p over x = 1/B (per byte
  of KV) gives a piecewise-constant policy table (Theorem 6.2).
* Online, x is looked up; the candidates are the envelope profile and ``neighbours`` on each side, minus
  those that cannot beat BF16 at this bandwidth (Theorem 6.1).
* Each (bucket, interval) keeps an EWMA of the residual (observed - predicted) *per byte of KV*, so requests
  of different sizes share what they learn about drifted throughputs; epsilon-greedy picks among candidates
  whose corrected time meets the SLO.
* Guardrails: a profile with ``k_violations`` SLO misses in its last ``m_window`` uses sits out ``cooldown``
  decisions; if no candidate is feasible the ``safe`` profile (default BF16) is used.
"""
from __future__ import annotations

import bisect
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from .controller import BF16, Profile, benefit_threshold, check_context


@dataclass(frozen=True)
class OnlineConfig:
    buckets: tuple[float, ...] = (0.90, 0.95, 0.97, 0.99, 1.0)
    epsilon: float = 0.1
    alpha: float = 0.3
    neighbours: int = 1
    k_violations: int = 3
    m_window: int = 10
    cooldown: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        b = self.buckets
        if not b or list(b) != sorted(set(b)) or b[0] < 0 or b[-1] != 1.0:
            raise ValueError(f"buckets must be increasing, distinct, in [0, 1] and end at 1.0, got {b}")
        if not 0.0 <= self.epsilon <= 1.0 or not 0.0 < self.alpha <= 1.0:
            raise ValueError("epsilon must be in [0, 1] and alpha in (0, 1]")
        if self.neighbours < 0 or not 1 <= self.k_violations <= self.m_window or self.cooldown < 0:
            raise ValueError("need neighbours >= 0, 1 <= k_violations <= m_window, cooldown >= 0")


def lower_envelope(profiles: Sequence[Profile]) -> tuple[list[Profile], list[float]]:
    """Profiles on the lower envelope of T(x) = 1/s + x/cr for x >= 0 and where each starts (x_0 = 0)."""
    lines = [(1.0 / p.throughput, 1.0 / p.ratio, i, p) for i, p in enumerate(profiles)]
    if not lines:
        raise ValueError("no profiles")
    cur = min(lines, key=lambda l: (l[0], l[1], l[2]))
    env, starts, x = [cur[3]], [0.0], 0.0
    while True:
        nxt, nx = None, math.inf
        for l in lines:
            if l[1] < cur[1]:
                xi = max(x, (l[0] - cur[0]) / (cur[1] - l[1]))
                if nxt is None or (xi, l[1], l[2]) < (nx, nxt[1], nxt[2]):
                    nxt, nx = l, xi
        if nxt is None:
            return env, starts
        cur, x = nxt, nx
        env.append(cur[3])
        starts.append(x)


@dataclass
class Decision:
    profile: Profile
    predicted_time: float  # analytical T_p
    corrected_time: float  # T_p + V * EWMA residual
    env: tuple[int, int]
    volume: float
    slo: float | None
    explored: bool = False
    fallback: bool = False
    slo_miss: bool = False


@dataclass
class _Arm:
    residual: float = 0.0
    uses: int = 0


@dataclass
class _Guard:
    recent: deque = field(default_factory=deque)
    until: int = -1


class OnlineController:
    """Per-request profile choice; ``decide`` then, once the transfer finished, ``observe``."""

    def __init__(self, profiles: Sequence[Profile], config: OnlineConfig | None = None,
                 safe: Profile | None = None) -> None:
        self.cfg = config or OnlineConfig()
        self.profiles = list(profiles) + [BF16]
        self.safe = safe or BF16
        self.tables = []
        for thr in self.cfg.buckets:
            env, starts = lower_envelope([p for p in self.profiles if p.quality >= thr])
            self.tables.append((env, starts))
        self._arms: dict[tuple[int, int, str], _Arm] = {}
        self._guard: dict[str, _Guard] = {}
        self._rng = random.Random(self.cfg.seed)
        self.decisions = 0

    def bucket(self, min_quality: float) -> int:
        return bisect.bisect_left(self.cfg.buckets, min_quality)

    def candidates(self, bandwidth: float, min_quality: float) -> tuple[tuple[int, int], list[Profile]]:
        b = self.bucket(min_quality)
        env, starts = self.tables[b]
        i = bisect.bisect_right(starts, 1.0 / bandwidth) - 1
        n = self.cfg.neighbours
        cands = [p for j, p in enumerate(env[max(0, i - n): i + n + 1], max(0, i - n))
                 if j == i or p is BF16 or bandwidth < benefit_threshold(p)]
        return (b, i), cands

    def decide(self, bandwidth: float, volume: float, slo: float | None, min_quality: float,
               model_time: float = 0.0) -> Decision:
        check_context(bandwidth, volume, slo, min_quality, model_time)
        self.decisions += 1
        env, cands = self.candidates(bandwidth, min_quality)
        scored = []
        for p in cands:
            g = self._guard.get(p.name)
            if g is not None and g.until >= self.decisions:
                continue
            t = p.time(bandwidth, volume, model_time)
            arm = self._arms.get((*env, p.name))
            scored.append((t + (volume * arm.residual if arm else 0.0), t, p))
        ok = [s for s in scored if slo is None or s[0] <= slo]
        if not ok:
            t = self.safe.time(bandwidth, volume, model_time)
            arm = self._arms.get((*env, self.safe.name))
            tc = t + (volume * arm.residual if arm else 0.0)
            return Decision(self.safe, t, tc, env, volume, slo, fallback=True, slo_miss=slo is not None and tc > slo)
        best = min(ok, key=lambda s: s[0])
        explored = False
        if len(ok) > 1 and self._rng.random() < self.cfg.epsilon:
            best = self._rng.choice([s for s in ok if s is not best])
            explored = True
        return Decision(best[2], best[1], best[0], env, volume, slo, explored=explored)

    def observe(self, d: Decision, observed_time: float) -> None:
        """Fold the measured time of a decided transfer into the residual and the SLO guard."""
        if not math.isfinite(observed_time) or observed_time < 0:
            raise ValueError(f"observed_time must be finite and >= 0, got {observed_time!r}")
        if d.volume > 0:
            arm = self._arms.setdefault((*d.env, d.profile.name), _Arm())
            delta = (observed_time - d.predicted_time) / d.volume
            a = self.cfg.alpha if arm.uses else 1.0
            arm.residual = (1 - a) * arm.residual + a * delta
            arm.uses += 1
        if d.slo is not None:
            g = self._guard.setdefault(d.profile.name, _Guard(deque(maxlen=self.cfg.m_window)))
            g.recent.append(observed_time > d.slo)
            if sum(g.recent) >= self.cfg.k_violations:
                g.until = self.decisions + self.cfg.cooldown
                g.recent.clear()
