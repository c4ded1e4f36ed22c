"""Sender-side bandwidth: a token-bucket `PacedTransport` that holds writes to a set rate, and a `GoodputMeter`.

`PacedTransport` wraps any `Transport`. A write is cut into slices (256 KiB by default); each slice waits until
the bucket holds its size in tokens, then goes to the inner transport. Tokens refill at ``rate`` bytes/s up to
``burst`` bytes, and the bucket starts full. All writes through one wrapper share its bucket (one emulated link),
and `set_rate` takes effect for the next slice of every write in flight, so a bandwidth trace can be played live.

`GoodputMeter` is what the controller reads instead of the nominal rate: an EWMA of measured bytes/seconds.
"""
from __future__ import annotations

import math
import threading
import time

from .base import LocalBuffer, RemoteBuffer, Transport, TransportTimeout

MIN_SLICE = 256 << 10  # bytes
WIRE_BOUND = 0.5  # a transfer whose writes fill this share of their span was paced by the link
SLICE_SECONDS = 2e-3  # an automatic slice carries this much time at the current rate


def _check_rate(rate: float) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0 or math.isnan(rate):
        raise ValueError(f"rate_bytes_per_s: expected a positive number (inf: no limit), got {rate!r}")
    return float(rate)


class TokenBucket:
    """Tokens (bytes) refill at ``rate``/s up to ``burst``; `take` blocks until it can remove ``n`` of them.

    The bucket starts full. A request larger than the burst (a slice cut before the burst shrank) goes once the
    bucket is full and leaves it in debt, so the long-run rate still holds."""

    def __init__(self, rate: float, burst: float):
        self._rate = _check_rate(rate)
        self._burst = float(burst)
        self._tokens = self._burst
        self._stamp = time.monotonic()
        self._cond = threading.Condition()

    @property
    def rate(self) -> float:
        return self._rate

    @property
    def burst(self) -> float:
        return self._burst

    def set_rate(self, rate: float, burst: float | None = None) -> None:
        rate = _check_rate(rate)
        with self._cond:
            self._refill()  # tokens earned so far at the old rate
            self._rate = rate
            if burst is not None:
                self._burst = float(burst)
                self._tokens = min(self._tokens, self._burst)
            self._cond.notify_all()

    def _refill(self) -> None:
        now = time.monotonic()
        if math.isinf(self._rate):
            self._tokens = self._burst
        else:
            self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now

    def take(self, n: int, deadline: float) -> None:
        """Remove ``n`` tokens, waiting for them; `TransportTimeout` if they have not come by ``deadline``."""
        with self._cond:
            while True:
                self._refill()
                need = min(n, self._burst)
                if self._tokens >= need:
                    self._tokens -= n
                    return
                now = time.monotonic()
                if now >= deadline:
                    raise TransportTimeout(f"pacing at {self._rate:.3g} B/s: no tokens for {n} bytes in time")
                self._cond.wait(min((need - self._tokens) / self._rate, deadline - now))  # set_rate wakes it


class PacedTransport(Transport):
    """``inner`` with its writes held to ``rate_bytes_per_s`` (a token bucket on the sender).

    ``slice_bytes`` None: slices of ``max(256 KiB, rate x 2 ms)``, so per-write overhead of the inner transport
    stays small at high rates; ``burst_bytes`` None: the bucket holds one slice. Both follow `set_rate` when
    left None. A slice never exceeds the burst (it could never be sent)."""

    def __init__(self, inner: Transport, rate_bytes_per_s: float, burst_bytes: int | None = None,
                 slice_bytes: int | None = None, meter: GoodputMeter | None = None):
        for name, v in (("burst_bytes", burst_bytes), ("slice_bytes", slice_bytes)):
            if v is not None and not (isinstance(v, int) and v > 0):
                raise ValueError(f"{name}: expected a positive int or None, got {v!r}")
        self.inner = inner
        self.meter = meter  # when given, every completed write is observed into it
        self._burst_arg, self._slice_arg = burst_bytes, slice_bytes
        rate = _check_rate(rate_bytes_per_s)
        self.slice_bytes, burst = self._sizes(rate)
        self.bucket = TokenBucket(rate, burst)

    def _sizes(self, rate: float) -> tuple[int, int]:
        """(slice, burst) at ``rate``."""
        auto = MIN_SLICE if math.isinf(rate) else max(MIN_SLICE, int(rate * SLICE_SECONDS))
        slice_bytes = self._slice_arg or auto
        burst = self._burst_arg or slice_bytes
        return min(slice_bytes, burst), burst

    @property
    def session(self) -> str:  # type: ignore[override]
        return self.inner.session

    @property
    def rate(self) -> float:
        return self.bucket.rate

    def set_rate(self, rate_bytes_per_s: float) -> None:
        """Change the rate live (thread-safe); writes in flight use it from their next slice."""
        rate = _check_rate(rate_bytes_per_s)
        slice_bytes, burst = self._sizes(rate)
        self.bucket.set_rate(rate, burst)
        self.slice_bytes = slice_bytes

    def owns(self, buf: LocalBuffer) -> bool:
        return self.inner.owns(buf)

    def alloc(self, nbytes: int) -> LocalBuffer:
        return self.inner.alloc(nbytes)

    def _release(self, buf: LocalBuffer, settled: bool) -> None:  # buffers belong to the inner transport
        self.inner._release(buf, settled)

    def _write(self, src: LocalBuffer, src_offset: int, dst: RemoteBuffer, dst_offset: int, nbytes: int,
               timeout_s: float) -> None:
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        done = 0
        while done < nbytes:
            n = min(self.slice_bytes, nbytes - done)
            self.bucket.take(n, deadline)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportTimeout(f"paced write of {nbytes} bytes to {dst.session} not done in {timeout_s:g} s")
            self.inner.write(src, src_offset + done, dst, dst_offset + done, n, timeout_s=left)
            done += n
        if self.meter is not None:
            self.meter.observe(nbytes, time.monotonic() - t0)

    def close(self) -> None:
        self.inner.close()


class GoodputMeter:
    """EWMA of observed transfer rates (bytes/s): ``rate = alpha * sample + (1 - alpha) * rate``. Thread-safe.

    ``rate`` is None until the first observation, which is taken as it is."""

    def __init__(self, alpha: float = 0.3):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha: expected a number in (0, 1], got {alpha!r}")
        self.alpha = alpha
        self._rate: float | None = None
        self._count = 0
        self._lock = threading.Lock()

    def observe(self, nbytes: int, seconds: float) -> float:
        """Add one transfer of ``nbytes`` that took ``seconds``; returns the new rate."""
        if nbytes < 0:
            raise ValueError(f"nbytes: must not be negative, got {nbytes}")
        if not seconds > 0 or math.isinf(seconds):
            raise ValueError(f"seconds: expected a positive, finite number, got {seconds!r}")
        sample = nbytes / seconds
        with self._lock:
            self._rate = sample if self._rate is None else self.alpha * sample + (1 - self.alpha) * self._rate
            self._count += 1
            return self._rate

    def observe_transfer(self, nbytes: int, write_s: float, span_s: float) -> float | None:
        """Add one multi-write transfer: ``write_s`` its writes' summed seconds, ``span_s`` from the start of its
        first write to the end of its last. Where the writes filled most of the span the link set the pace, and
        ``nbytes / span_s`` is its sustained rate. Where they did not (the encoder was slower than the link), each
        write found the link idle and went at burst speed (a shaper's bucket, a switch's buffer), which says nothing
        of the sustained rate: such a transfer only raises the estimate to ``nbytes / span_s``, a lower bound (or
        sets it, conservatively, where there is none yet)."""
        if nbytes <= 0 or not span_s > 0 or math.isinf(span_s) or not write_s >= 0:
            return self.rate
        sample = nbytes / span_s
        if write_s >= WIRE_BOUND * span_s:
            return self.observe(nbytes, span_s)
        with self._lock:
            if self._rate is None or sample > self._rate:  # a first bound is the estimate until a real sample
                self._rate = sample
            self._count += 1
            return self._rate

    @property
    def rate(self) -> float | None:
        with self._lock:
            return self._rate

    @property
    def count(self) -> int:
        with self._lock:
            return self._count
