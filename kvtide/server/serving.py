"""Completions and chat completions on one `LLM`: checks, admission, engine requests, whole or streamed answers.

A request is checked (`protocol`), admitted (503 with Retry-After past the queue bound), its prompts rendered and
tokenized in a worker thread, checked against the context window (400), then run as ``len(prompts) * n`` engine
requests (copy ``j`` of a prompt samples with ``seed + j`` when a seed is given). A request the engine fails gets a
500 of its own (streaming: a final ``data: {"error": ...}`` event, then ``data: [DONE]``); every other request goes
on. A client that leaves aborts its engine requests at once, streamed or not.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.sampling_params import SamplingParams
from ..log import get_logger
from .config import ServerConfig
from .generation import Admission, Generation
from .metrics import ServerMetrics
from .protocol import (DEFAULT_COMPLETION_TOKENS, APIError, GenerationRequest, bad, error_body, parse_chat,
                       parse_completion)
from .responses import DONE, ResponseBuilder, Usage, sse
from .streaming import EventStream

if TYPE_CHECKING:
    from ..engine.llm import LLM

log = get_logger("server")

SEED_SPACE = 2**63


class Serving:
    def __init__(self, llm: "LLM", cfg: ServerConfig, model_name: str):
        self.llm = llm
        self.cfg = cfg
        self.model_name = model_name
        self.metrics = ServerMetrics(llm.engine, model_name)
        self.admission = Admission(llm.engine.scheduler.config.max_num_seqs + cfg.max_queued_requests)
        self.open: set[Generation] = set()
        self.pd: Any = None  # a PrefillRole or DecodeRole (kvtide/server/pd.py) where ServerConfig.role says so
        self.url = cfg.advertise_url or f"http://{cfg.host}:{cfg.port}"

    @property
    def max_seq_len(self) -> int:
        return self.llm.engine.max_seq_len

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, parse_completion(await read_json(request, self.cfg.max_request_bytes),
                                                           self.cfg.max_choices))

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, parse_chat(await read_json(request, self.cfg.max_request_bytes),
                                                     self.cfg.max_choices))

    def close_all(self) -> None:
        """Abort every open generation (the end of a shutdown)."""
        for gen in list(self.open):
            gen.close()

    # ---- one request ------------------------------------------------------------------------------------------
    async def _serve(self, request: Request, req: GenerationRequest) -> Response:
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{self.model_name}'",
                           "model")
        size = len(req.prompts or [None]) * req.n
        if not self.admission.try_acquire(size):
            raise APIError(503, f"the server is at capacity ({self.admission.in_flight} requests in flight, "
                           f"{self.admission.limit} allowed); retry later", None,
                           {"Retry-After": str(self.cfg.retry_after_s)})
        gen = Generation(self.llm.loop, self.metrics, self.admission, size, self.open, finals_only=not req.stream)
        try:
            prompts = await run_in_threadpool(self._tokenize, req)
            params = self._params(req, prompts)
            kv = await self._hand_off(req, prompts)
            try:
                gen.submit([p for p in prompts for _ in range(req.n)], params)
            except (ValueError, TypeError) as e:
                raise bad(req.prompt_param, str(e)) from None
            except RuntimeError as e:  # the engine loop stopped
                raise APIError(503, f"the engine is not running: {e}") from None
        except BaseException:
            gen.close()
            raise
        builder = ResponseBuilder(req.chat, self.model_name)
        lens = [len(p) for p in prompts]
        if req.stream:
            return EventStream(self._events(gen, req, builder, lens), gen.close)
        return await self._whole(request, gen, req, builder, lens, kv)

    async def _hand_off(self, req: GenerationRequest, prompts: list[list[int]]) -> dict[str, Any] | None:
        """The prefill leg's params to answer with, or, on a decode instance, the KV pulled for the prompt (its
        outcome goes into the answer as ``kv_transfer``; a failed pull has the prompt recomputed)."""
        from .pd import DecodeRole, PrefillRole

        p = req.kv_transfer_params
        if p is None or self.pd is None:
            return None
        if isinstance(self.pd, PrefillRole):
            return {"kv_transfer_params": self.pd.params(self.url)} if p.get("do_remote_decode") else None
        if isinstance(self.pd, DecodeRole) and p.get("remote_url"):
            q = req.kv_min_quality if req.kv_min_quality is not None else self.cfg.kv_min_quality
            return {"kv_transfer": await self.pd.receive(prompts[0], p, q, req.kv_slo_s, req.kv_profile,
                                                                req.kv_policy_key)}
        return None

    def _tokenize(self, req: GenerationRequest) -> list[list[int]]:
        """Token ids of every prompt (chat: the template's rendering of the messages); a worker thread."""
        tok = self.llm.tokenizer
        if req.chat:
            try:
                text = tok.apply_chat_template(req.messages, add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 - the template's raise_exception, a Jinja error: the messages' fault
                raise bad("messages", f"the chat template cannot render these messages: {e}") from None
            req.prompts = [text]
        out = []
        for p in req.prompts:
            ids = tok.encode(p) if isinstance(p, str) else p
            if not ids:
                raise bad(req.prompt_param, f"the {req.prompt_param} has no tokens")
            out.append(ids)
        return out

    def _params(self, req: GenerationRequest, prompts: list[list[int]]) -> list[SamplingParams]:
        window = self.max_seq_len
        out = []
        for ids in prompts:
            n = len(ids)
            if n >= window:
                raise bad(req.prompt_param, f"this model's maximum context length is {window} tokens, but the "
                          f"{req.prompt_param} has {n} tokens; shorten it to leave room for the completion")
            max_tokens = req.max_tokens
            if max_tokens is None:
                max_tokens = window - n if req.chat else min(DEFAULT_COMPLETION_TOKENS, window - n)
            elif n + max_tokens > window:
                param = "max_completion_tokens" if req.chat else "max_tokens"
                raise bad(param, f"this model's maximum context length is {window} tokens, but {n + max_tokens} "
                          f"were requested ({n} in the {req.prompt_param}, {max_tokens} for the completion); "
                          f"reduce the length of the {req.prompt_param} or of the completion")
            for j in range(req.n):
                seed = None if req.seed is None else (req.seed + j) % SEED_SPACE
                try:
                    # kv_transfer.min_quality (else the server's default) also bounds what a restoration may load
                    q = req.kv_min_quality if req.kv_min_quality is not None else self.cfg.kv_min_quality
                    out.append(SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                              max_tokens=max_tokens, stop=list(req.stop), ignore_eos=req.ignore_eos,
                                              seed=seed, kv_min_quality=q))
                except ValueError as e:  # protocol checked every field: a mismatch of the two checks
                    raise bad(None, str(e)) from None
        return out

    async def _whole(self, request: Request, gen: Generation, req: GenerationRequest, builder: ResponseBuilder,
                     lens: list[int], extra: dict[str, Any] | None = None) -> Response:
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            finals: dict[int, Any] = {}
            while not gen.finished:
                waiter = asyncio.ensure_future(gen.next())
                await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not waiter.done():
                    waiter.cancel()
                    log.debug("client left before its answer: request aborted")
                    return Response(status_code=499)  # nobody reads it
                i, out = waiter.result()
                if out.finished:
                    finals[i] = out
            failed = [(i, o) for i, o in sorted(finals.items()) if o.finish_reason == "error"]
            if failed:
                i, o = failed[0]
                raise APIError(500, f"the engine failed this request (choice {i}): {o.error}")
            outs = [finals[i] for i in range(len(finals))]
            usage = _usage(outs, lens, req.n)
            body = builder.whole([o.text for o in outs], [o.finish_reason for o in outs], usage)
            if extra:
                body.update(extra)
                kv = extra.get("kv_transfer")
                if isinstance(kv, dict) and kv.get("used") and self.pd is not None:
                    kv["restore"] = self.pd.restoration(gen.request_ids)  # how the engine put the KV in place
            return JSONResponse(body)
        finally:
            gone.cancel()
            gen.close()

    async def _events(self, gen: Generation, req: GenerationRequest, builder: ResponseBuilder,
                      lens: list[int]) -> AsyncIterator[bytes]:
        try:
            size = len(gen.request_ids)
            if req.chat:
                for i in range(size):
                    yield sse(builder.chunk(i, "", None, role=True, include_usage=req.include_usage))
            finals: dict[int, Any] = {}
            while not gen.finished:
                i, out = await gen.next()
                if out.finish_reason == "error":
                    yield sse(error_body(500, f"the engine failed this request (choice {i}): {out.error}"))
                    yield DONE
                    return
                if out.new_token_ids or out.new_text or out.finished:  # a chunk per step with tokens, text or not
                    reason = out.finish_reason if out.finished else None
                    yield sse(builder.chunk(i, out.new_text, reason, include_usage=req.include_usage))
                if out.finished:
                    finals[i] = out
            if req.include_usage:
                yield sse(builder.usage_chunk(_usage([finals[i] for i in range(size)], lens, req.n)))
            yield DONE
        finally:
            gen.close()


def _usage(outs: list[Any], lens: list[int], n: int) -> Usage:
    """Each prompt once (copy 0 of it for the cached tokens), every choice's tokens."""
    return Usage(prompt_tokens=sum(lens), completion_tokens=sum(len(o.token_ids) for o in outs),
                 cached_tokens=sum(outs[k * n].num_cached_tokens for k in range(len(lens))))


async def _disconnected(request: Request) -> None:
    """Returns when the client of ``request`` (its body already read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_json(request: Request, limit: int) -> Any:
    """The request's JSON body, at most ``limit`` bytes (413 beyond, unread past the bound; 400 if not JSON)."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise bad(None, f"the Content-Length header {length[:40]!r} is not a number")
        if int(length) > limit:
            raise APIError(413, f"the request body has {int(length)} bytes; at most {limit} are allowed")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body has more than {limit} bytes; at most {limit} are allowed")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad(None, "the request body is empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")  # JSON is UTF-8 (RFC 8259); json.loads would guess UTF-16 / 32 from bytes
    except UnicodeDecodeError as e:
        raise bad(None, f"the request body is not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(None, f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (ValueError, RecursionError) as e:  # an integer of too many digits, nesting too deep
        raise bad(None, f"the request body cannot be decoded: {type(e).__name__}: {str(e)[:120]}") from None
