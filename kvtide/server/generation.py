"""The engine requests of one HTTP request, bridged from the engine's driver thread into asyncio.

`Admission` bounds the engine requests the server has accepted and not finished (503 beyond it). A `Generation`
submits one engine request per choice to the `EngineLoop`; their outputs arrive in the driver thread, are counted
for the metrics there, and are handed to the event loop with ``call_soon_threadsafe`` (never blocking the driver).
`Generation.close` (idempotent; called when the response ends, fails, or its client goes away) aborts every request
of it that has not finished, so their pages are freed before the engine's next step, and returns its admission.
Admission and generations are touched only from the event loop's thread.
"""
from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING

from ..log import get_logger
from .metrics import ServerMetrics, Track

if TYPE_CHECKING:
    from ..engine.llm_engine import RequestOutput
    from ..engine.loop import EngineLoop
    from ..engine.sampling_params import SamplingParams

log = get_logger("server")


class Admission:
    """Engine requests accepted and not finished, at most ``limit``."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight = 0

    def try_acquire(self, k: int) -> bool:
        if self.in_flight + k > self.limit:
            return False
        self.in_flight += k
        return True

    def release(self, k: int) -> None:
        self.in_flight -= k
        assert self.in_flight >= 0, "admission released more than it acquired"


class Generation:
    def __init__(self, loop: "EngineLoop", metrics: ServerMetrics, admission: Admission, size: int,
                 registry: set["Generation"], finals_only: bool = False):
        self.loop = loop
        self.metrics = metrics
        self.admission = admission
        self.size = size  # engine requests admitted for it
        self.registry = registry  # the server's open generations (closed at shutdown)
        self.finals_only = finals_only  # only final outputs reach the event loop (a whole, unstreamed answer)
        self.aio = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, "RequestOutput"]] = asyncio.Queue()
        self.tag = uuid.uuid4().hex
        self.request_ids: list[str] = []
        self.done: set[int] = set()
        self.closed = False
        registry.add(self)

    def submit(self, prompts: list[list[int]], params: list["SamplingParams"]) -> None:
        """Queue choice ``i`` = (``prompts[i]``, ``params[i]``) for every i; ValueError / TypeError of the engine's
        validation (the caller closes this generation, which aborts the choices already queued)."""
        for i, (ids, p) in enumerate(zip(prompts, params)):
            rid = f"{self.tag}-{i}"
            self.loop.submit(ids, p, request_id=rid, sink=self._sink(i))
            self.request_ids.append(rid)

    def _sink(self, index: int):
        track = Track()
        metrics, post = self.metrics, self._post

        finals_only = self.finals_only

        def sink(out: "RequestOutput") -> None:  # the driver thread
            metrics.observe(track, out)
            if out.finished or not finals_only:
                post(index, out)

        return sink

    def _post(self, index: int, out: "RequestOutput") -> None:
        try:
            self.aio.call_soon_threadsafe(self.queue.put_nowait, (index, out))
        except RuntimeError:  # the event loop is closed: nobody waits for this output any more
            pass

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.request_ids)

    async def next(self) -> tuple[int, "RequestOutput"]:
        """The next output of any choice: (choice index, output)."""
        index, out = await self.queue.get()
        if out.finished:
            self.done.add(index)
        return index, out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.registry.discard(self)
        for i, rid in enumerate(self.request_ids):
            if i not in self.done:
                try:
                    self.loop.abort(rid)
                except RuntimeError as e:  # the engine loop is gone: nothing left to free
                    log.debug("aborting %s: %s", rid, e)
        self.admission.release(self.size)
