"""One engine, many callers: requests go in through a thread-safe inbox, each caller gets only its own outputs.

``EngineLoop`` owns an ``LLMEngine`` (which is single-threaded) and steps it on behalf of everyone:

* ``submit`` validates and tokenizes in the caller's thread (a bad request raises there and touches nothing),
  then queues the sequence; each request has a ``RequestHandle`` that receives every output of that request, in
  order, from whichever thread stepped the engine.
* Without a background thread (``LLM``'s default) the callers drive: a caller waiting for an output that has not
  come takes the driver's role if nobody holds it and runs one step, else it sleeps on a condition until the driver
  finishes its step. No busy-waiting, and a caller that stops consuming never stalls the others.
* ``start()`` runs a driver thread instead (the server): it steps while there is work and sleeps otherwise; outputs
  reach each request's sink (``RequestHandle`` queues, or a callback such as an asyncio bridge).
* ``abort`` from any thread (a stream closed or garbage-collected, a client gone) is applied before the next step,
  at once if no step is running.
"""
from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ..log import get_logger
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .llm_engine import LLMEngine, RequestOutput

log = get_logger("engine")

Sink = Callable[["RequestOutput"], None]


class RequestError(RuntimeError):
    """A request that the engine ended with an error (``RequestOutput.error``); other requests are unaffected."""

    def __init__(self, output: "RequestOutput"):
        super().__init__(f"request {output.request_id} failed: {output.error}")
        self.output = output


class RequestHandle:
    """The outputs of one request as they arrive; iterate for every delta, or ``result()`` for the final one."""

    def __init__(self, loop: "EngineLoop", request_id: str):
        self.loop = loop
        self.request_id = request_id
        self._outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self.finished = False  # the final output has been taken by the caller
        self.final: RequestOutput | None = None  # the final output, once it was delivered

    def _put(self, out: "RequestOutput") -> None:
        if out.finished:
            self.final = out
        self._outputs.put(out)

    def next(self) -> "RequestOutput | None":
        """The next output of this request (waiting for it), or None once its final output was taken."""
        if self.finished:
            return None
        out = self.loop._wait_for(self)
        if out.finished:
            self.finished = True
        return out

    def __iter__(self) -> Iterator["RequestOutput"]:
        while (out := self.next()) is not None:
            yield out

    def result(self) -> "RequestOutput":
        """The final output (every delta before it is consumed and dropped)."""
        last = None
        for last in self:
            pass
        if last is None:
            raise RuntimeError(f"request {self.request_id}: its final output was already taken")
        return last

    def abort(self) -> None:
        if not self.finished:
            self.loop.abort(self.request_id)


class EngineLoop:
    def __init__(self, engine: "LLMEngine"):
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: deque[tuple] = deque()  # ("add", seq, sink) | ("abort", request_id)
        self._sinks: dict[str, Sink] = {}
        self._driving = False  # a thread is inside _step_once (guarded by _cv)
        self._thread: threading.Thread | None = None
        self._stop = False
        self._dead: BaseException | None = None  # the driver thread died of this

    # ---- callers (any thread) ---------------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
               sink: Sink | None = None) -> RequestHandle:
        """Validate and queue one request. With ``sink`` every output of it is passed there (called from the
        stepping thread; it must not block); the handle then receives nothing."""
        seq = self.engine.make_sequence(prompt, params, request_id)
        handle = RequestHandle(self, seq.request_id)
        self._post(("add", seq, sink or handle._put))
        return handle

    def submit_many(self, prompts: list, params: list[SamplingParams | None]) -> list[RequestHandle]:
        """All validated first (the first bad one raises, naming its index, and nothing is queued), then queued."""
        seqs = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                seqs.append(self.engine.make_sequence(p, sp))
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
        handles = [RequestHandle(self, s.request_id) for s in seqs]
        with self._cv:
            for s, h in zip(seqs, handles):
                self._inbox.append(("add", s, h._put))
            self._cv.notify_all()
        return handles

    def abort(self, request_id: str) -> None:
        """End a request from any thread; applied before the next step (at once when no step is running)."""
        self._post(("abort", request_id))
        if self._thread is None:
            self._apply_inbox_if_free()

    def _post(self, item: tuple) -> None:
        with self._cv:
            if self._dead is not None:
                raise RuntimeError("the engine loop has stopped") from self._dead
            self._inbox.append(item)
            self._cv.notify_all()

    # ---- background driver ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Step the engine from a daemon thread from now on (callers then only wait on their handles)."""
        with self._cv:
            if self._thread is not None:
                return
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="kvtide-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the driver thread after its current step (requests still in the engine stay there)."""
        t = self._thread
        if t is None:
            return
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        t.join(timeout)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._stop and not self._inbox and not self.engine.has_unfinished():
                        self._cv.wait()
                    if self._stop:
                        return
                    self._driving = True
                self._as_driver(self._step_once)
        except BaseException as e:  # the loop itself broke (a bug): fail every waiter instead of hanging them
            log.exception("the engine loop died")
            with self._cv:
                self._dead = e
                self._cv.notify_all()
            self._fail_all(f"the engine loop died: {type(e).__name__}: {e}")

    # ---- stepping ---------------------------------------------------------------------------------------------
    def _wait_for(self, handle: RequestHandle) -> "RequestOutput":
        while True:
            try:
                return handle._outputs.get_nowait()
            except queue.Empty:
                pass
            with self._cv:
                if self._dead is not None:
                    raise RuntimeError("the engine loop has stopped") from self._dead
                if self._thread is not None or self._driving:
                    if handle._outputs.empty():
                        self._cv.wait(timeout=1.0)  # woken after every step; the timeout only guards a dead driver
                    continue
                self._driving = True
            self._as_driver(self._step_once)

    def _apply_inbox_if_free(self) -> None:
        """Apply the inbox now if no thread is stepping (else the stepping thread does, before its next step)."""
        with self._cv:
            if self._driving or self._thread is not None:
                return
            self._driving = True
        self._as_driver(self._apply_inbox)

    def _as_driver(self, work: Callable[[], None]) -> None:
        """Run ``work`` holding the driver's role (taken by the caller under the condition), then hand it back and
        wake every waiter: their outputs may have come, or the role is free to take."""
        try:
            work()
        finally:
            with self._cv:
                self._driving = False
                self._cv.notify_all()

    def _apply_inbox(self) -> None:
        eng = self.engine
        while True:
            with self._cv:
                if not self._inbox:
                    return
                item = self._inbox.popleft()
            if item[0] == "add":
                _, seq, sink = item
                try:
                    eng.enqueue(seq)
                except Exception as e:  # noqa: BLE001 - e.g. a request id in use: that request's error only
                    self._deliver(sink, eng.fail(seq, str(e)))
                    continue
                self._sinks[seq.request_id] = sink
            else:
                rid = item[1]
                sink = self._sinks.pop(rid, None)
                seq = eng.seqs.get(rid)
                eng.abort(rid)
                if sink is not None and seq is not None:
                    self._deliver(sink, _aborted(seq))

    def _step_once(self) -> None:
        self._apply_inbox()
        if not self.engine.has_unfinished():
            return
        for out in self.engine.step():
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue  # a request added to the engine directly, or aborted meanwhile
            if out.finished:
                del self._sinks[out.request_id]
            self._deliver(sink, out)
        orphans = [rid for rid in self._sinks if rid not in self.engine.seqs]
        for rid in orphans:  # left the engine without a final output: a bug, but never a caller waiting forever
            log.error("request %s left the engine without a final output", rid)
            self._deliver(self._sinks.pop(rid), _error_output(rid, "the request left the engine without an output"))

    @staticmethod
    def _deliver(sink: Sink, out: "RequestOutput") -> None:
        try:
            sink(out)
        except Exception:  # noqa: BLE001 - a caller's broken sink must not stop the loop
            log.exception("delivering an output of request %s failed", out.request_id)

    def _fail_all(self, message: str) -> None:
        sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            self._deliver(sink, _error_output(rid, message))


def _error_output(request_id: str, message: str) -> "RequestOutput":
    from .llm_engine import RequestOutput

    return RequestOutput(request_id, None, [], "", [], True, "error", error=message)


def _aborted(seq) -> "RequestOutput":
    from .llm_engine import RequestOutput

    return RequestOutput(
        request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
        text=seq.text[:seq.emitted_chars], token_ids=[t for t in seq.output_token_ids if t >= 0], finished=True,
        finish_reason="abort", num_cached_tokens=seq.num_cached_tokens, ttft=seq.ttft,
        num_preemptions=seq.num_preemptions)
