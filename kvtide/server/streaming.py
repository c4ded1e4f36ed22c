"""A server-sent-events response that notices its client leaving.

uvicorn's ``send`` silently drops what is sent after the client disconnected, so a stream cannot learn from a
failed write that nobody reads it. `EventStream` listens on ``receive`` for ``http.disconnect`` while it sends and
stops at once when it comes; ``on_close`` then runs however the response ends (finished, client gone, server
cancelling it at the end of a shutdown drain), before the event source is closed.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..log import get_logger

log = get_logger("server")


class EventStream(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, receive, tg.cancel_scope)
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for chunk in self.events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        except OSError as e:  # the connection broke while sending
            log.debug("stream ended by the connection: %s", e)
        finally:
            self.on_close()
            with anyio.CancelScope(shield=True):
                await self.events.aclose()  # type: ignore[attr-defined]

    @staticmethod
    async def _watch(receive: Receive, scope: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        log.debug("client disconnected: the stream stops")
        scope.cancel()
