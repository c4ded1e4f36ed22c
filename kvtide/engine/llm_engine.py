"""The engine: admit requests, schedule a step, run it, turn sampled tokens into text and finished outputs.

Single-threaded: one thread calls ``add_request`` / ``step`` / ``abort`` (``EngineLoop`` is how many callers share
it). What fails in one request (non-finite logits, a stop check, detokenizing, its restoration) finishes that request
with ``finish_reason="error"`` and ``RequestOutput.error``; the batch and later requests go on. A step that fails as
a whole (the forward pass raised) ends the requests of that step the same way and leaves the engine serving.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from ..cache.zip_pages import ZipGeometry, ZipPagedKV
from ..config import EngineConfig
from ..log import get_logger
from ..models.cpu_linear import pack_linears
from ..models.loader import load_model
from .block_manager import BlockManager
from .model_runner import ModelRunner, StepHandle
from .outputs import RequestOutput
from .pool_kernels import triton_pool_kernels
from .restoration import make_restorer
from .sampler import BAD_TOKEN
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import PENDING, Sequence, Status

log = get_logger("engine")


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    step_seconds: float = 0.0
    last_step: tuple[int, int, float] = (0, 0, 0.0)  # (prefill tokens, decode tokens, seconds) of the latest step
    request_errors: int = 0  # requests finished with finish_reason "error"
    step_errors: int = 0  # steps whose forward pass raised (their requests failed)


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True):
        self.config = config
        device = config.torch_device
        if config.cuda_graphs and device.type != "cuda":
            raise ValueError(f"EngineConfig.cuda_graphs needs a CUDA device; this engine runs on {device}")
        dtype = config.torch_dtype
        sched_cfg = config.scheduler
        self.model, self.tokenizer, self.model_dir = load_model(config.model, device, dtype, progress=progress)
        if config.cpu_onednn and device.type == "cpu" and dtype == torch.float32:
            pack_linears(self.model)
        args = self.model.args
        self.max_model_len = min(sched_cfg.max_model_len or args.max_position_embeddings, args.max_position_embeddings,
                                 self.model.rope_cos.shape[0])
        cache = config.cache
        page_bytes = ModelRunner.page_bytes(args, cache.page_size, cache.torch_kv_dtype)
        if cache.num_pages is None:
            budget = self._kv_budget(device)
            if budget < 2 * page_bytes:
                raise ValueError(f"no room for the KV cache: the budget is {budget / 2**20:.0f} MiB but one page takes "
                                 f"{page_bytes / 2**20:.2f} MiB (free device memory after the weights is too small; "
                                 "set CacheConfig.kv_cache_bytes or num_pages, or free memory)")
        num_pages = cache.num_pages or budget // page_bytes
        self.pool = self._make_pool(num_pages * page_bytes, device) if cache.compress else None
        self.runner = ModelRunner(self.model, num_pages, cache.page_size, cache.torch_kv_dtype, config.attention_backend,
                                  pool=self.pool, cuda_graphs=config.cuda_graphs,
                                  compress_spread_steps=cache.compress_spread_steps,
                                  full_cuda_graphs=config.full_cuda_graphs)
        self.block_manager = BlockManager(num_pages, cache.page_size, cache.enable_prefix_caching, pool=self.pool)
        if self.pool is not None:  # a compression short of slots evicts cached pages before it compresses in place
            self.pool.evictor = self.block_manager.evict_lru
        self.scheduler = Scheduler(sched_cfg, self.block_manager)
        # A sequence may never outgrow the whole cache, or it would preempt itself forever.
        fit = num_pages if self.pool is None else self.pool.free_pages()
        self.max_seq_len = min(self.max_model_len, fit * cache.page_size)
        self.seqs: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._generator = torch.Generator().manual_seed(config.seed)
        self.restorer = make_restorer(self)  # CacheFlow restoration from a KV store (config.restore)
        self.async_scheduling = config.async_scheduling_on
        self._pending: StepHandle | None = None  # launched, tokens not read yet (async scheduling)

    def _kv_budget(self, device: torch.device) -> int:
        cache = self.config.cache
        if cache.kv_cache_bytes is not None:
            return cache.kv_cache_bytes
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            return int(free - (1 - cache.gpu_memory_utilization) * total)
        return 256 << 20  # CPU: ~11k tokens of SmolLM2 KV, ~21k of Qwen2.5-0.5B (bf16)

    def _make_pool(self, budget: int, device: torch.device) -> ZipPagedKV:
        """The compressed pool over the same byte budget the fixed cache would take."""
        a, c = self.model.args, self.config.cache
        order = c.value_order
        if order == "auto":  # the CUDA kernel's order where it can serve this model here, else the Triton/torch one
            from ..kernels import zip_attention_cuda as zc

            why = zc.store_unsupported(device, a.num_heads, a.num_kv_heads, a.head_dim, c.page_size, c.block_size,
                                       budget)
            order = "token" if why or self.config.attention_backend == "torch" else "mma"
        geo = ZipGeometry(a.num_layers, a.num_kv_heads, a.head_dim, c.page_size, c.block_size, c.format_version, order)
        kernels = triton_pool_kernels() if device.type == "cuda" else None
        return ZipPagedKV(geo, budget, device, chunk_bytes=c.chunk_bytes, private_chunks=c.private_chunks,
                          shared_slabs=c.shared_slabs, kernels=kernels)

    @property
    def num_pages(self) -> int:
        """Pages the cache holds uncompressed (page ids can be more with compression: see kv_stats)."""
        return self.block_manager.num_pages if self.pool is None else self.pool.raw_capacity_pages

    def kv_stats(self) -> dict:
        """KV cache figures: compression ratio of K and V (stored / raw bytes of completed pages held),
        pages compressed, capacity in pages with and without compression, pool waste (compress=True)."""
        if self.pool is None:
            n = self.block_manager.num_pages
            return {"compress": False, "k_ratio": 1.0, "v_ratio": 1.0, "pages_compressed_total": 0,
                    "pages_held": n - len(self.block_manager.free), "free_pages": len(self.block_manager.free),
                    "capacity_pages": n, "capacity_pages_uncompressed": n}
        return {**self.pool.stats(), "prefix_evictions": self.block_manager.stats["evictions"],
                "preemptions": self.scheduler.num_preemptions}

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; a bad one raises ValueError and leaves the engine untouched."""
        seq = self.make_sequence(prompt, params, request_id)
        self.enqueue(seq)
        return seq.request_id

    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None) -> Sequence:
        """Validate and tokenize a request without touching the engine's state (safe from any thread)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids, text = list(prompt), None
        else:
            raise TypeError("prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError("prompt is empty: it has no tokens")
        vocab = self.model.args.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.max_seq_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but the context window is {self.max_seq_len} tokens "
                f"(model {self.max_model_len}, KV cache {self.num_pages * self.block_manager.page_size}); "
                "shorten it to leave room for at least one generated token")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(rid, text, ids, params)
        seq.detok = self.tokenizer.detokenizer()
        seq.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        return seq

    def enqueue(self, seq: Sequence) -> None:
        """Queue a sequence from ``make_sequence``; ValueError if its request id is in use."""
        if seq.request_id in self.seqs:
            raise ValueError(f"request id '{seq.request_id}' is already in use")
        if seq.generator is None:
            seq.generator = self._generator
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None and not seq.finished:
            seq.status = Status.FINISHED
            seq.finish_reason = "abort"
            if self.restorer is not None and self.restorer.holds(seq):  # its pages are being written
                self.restorer.abort(seq)
            else:
                self.scheduler.finish(seq)

    def fail(self, seq: Sequence, message: str) -> RequestOutput:
        """Finish ``seq`` with an error (its pages released, nothing of it runs again); returns its final output."""
        if not seq.finished:
            queued = seq.status is not Status.WAITING or seq in self.scheduler.waiting
            seq.status = Status.FINISHED
            seq.finish_reason = "error"
            seq.finish_time = time.perf_counter()
            self.stats.request_errors += 1
            log.warning("request %s failed: %s", seq.request_id, message)
            try:
                if queued:
                    self.scheduler.finish(seq)
            except Exception:  # noqa: BLE001 - a failed release must not stop the loop
                log.exception("request %s: releasing its pages failed", seq.request_id)
        if self.seqs.get(seq.request_id) is seq:  # (a duplicate id's sequence never entered the engine)
            del self.seqs[seq.request_id]
        done = [t for t in seq.output_token_ids if t >= 0]
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
            text=seq.text[:seq.emitted_chars], token_ids=done, finished=True, finish_reason="error",
            num_cached_tokens=seq.num_cached_tokens, queue_time=seq.queue_time, ttft=seq.ttft, num_preemptions=seq.num_preemptions,
            latency=seq.finish_time - seq.arrival if seq.finish_time is not None else None, error=message)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._pending is not None

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling step; returns an output for every request that made visible progress.

        With async scheduling (``EngineConfig.async_scheduling``) the step scheduled here is launched before the
        previous one's tokens are read: the host schedules and plans step N+1 while the device runs step N, and the
        outputs returned are step N's. A sequence that stops (EOS, stop string) in step N has already been launched
        in step N+1; that token is dropped, and its pages are released."""
        restored = self._restore_step()
        with record_function("kvtide.schedule"):
            plan = self.scheduler.schedule()
        prev, self._pending = self._pending, None
        if not plan.batch and prev is None:
            if self.scheduler.waiting and not self.scheduler.running and not self.scheduler.restoring:
                # cannot happen for a validated request (add_request bounds its length by the whole cache);
                # fail it rather than the loop
                seq = self.scheduler.waiting[0]
                return restored + [self.fail(seq, "the KV cache cannot hold this request even when empty")]
            return restored
        try:
            return restored + self._run(plan, prev)
        except Exception as e:  # noqa: BLE001 - a failed step ends its own requests, not the engine
            self.stats.step_errors += 1
            log.exception("engine step failed; its requests end with an error")
            self._pending = None
            seqs = {id(s): s for s, _ in plan.batch}
            if prev is not None:
                seqs.update((id(s), s) for s in prev.seqs)
            msg = f"engine step failed: {type(e).__name__}: {e}"
            return restored + [self.fail(s, msg) for s in seqs.values() if not s.finished]

    def _restore_step(self) -> list[RequestOutput]:
        if self.restorer is None:
            return []
        try:
            return self.restorer.step()
        except Exception:  # noqa: BLE001 - a restoration bug costs a plain prefill, never the loop
            log.exception("restoration step failed; waiting requests are prefilled instead")
            return []

    def _run(self, plan, prev: StepHandle | None) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        t0 = time.perf_counter()
        if plan.batch:
            handle = self.runner.launch(plan.batch, [s.generator for s, _ in plan.batch], prev)
            n_prefill = sum(n for s, n in plan.batch if n > 1 or s.num_computed_tokens < s.num_prompt_tokens)
            self._advance(plan.batch, handle)
            self._pending = handle
        if prev is not None:
            outputs += self._finish(prev)
        if self._pending is not None and not self.async_scheduling:
            outputs += self._finish(self._pending)
            self._pending = None
        if plan.batch:
            dt = time.perf_counter() - t0
            if self.restorer is not None:
                self.restorer.observe_step(plan.batch, dt)
            n_decode = plan.num_tokens - n_prefill
            self.stats.steps += 1
            self.stats.last_step = (n_prefill, n_decode, dt)
            self.stats.step_seconds += dt
            self.stats.prefill_tokens += n_prefill
            self.stats.decode_tokens += n_decode
            if n_prefill:
                self.stats.prefill_seconds += dt
            else:
                self.stats.decode_seconds += dt
        if self.pool is not None and self._pending is None and not self.scheduler.has_work():
            self.pool.compress_finish()  # idle: no next step to overlap the last filled pages' placement with
        return outputs

    def _advance(self, batch: list[tuple[Sequence, int]], handle: StepHandle) -> None:
        """Book a launched step: its tokens are computed, and each sampling sequence that will go on gets a
        ``PENDING`` token, so that the next schedule already gives it its next decode step."""
        for seq, n in batch:
            seq.num_computed_tokens += n
        for seq in handle.seqs:
            slot = len(seq.output_token_ids)  # where this step's token goes
            handle.slots.append(slot)
            p = seq.params
            if slot + 1 < p.max_tokens and seq.num_prompt_tokens + slot + 1 < self.max_seq_len:
                seq.output_token_ids.append(PENDING)
        handle.batch = batch

    def _finish(self, handle: StepHandle) -> list[RequestOutput]:
        """Read a launched step's tokens and turn them into outputs; sequences finished meanwhile are skipped."""
        tokens = handle.result()
        now = time.perf_counter()
        live = []
        for seq, slot, token in zip(handle.seqs, handle.slots, tokens):
            if seq.finished:  # stopped or aborted while this step ran
                continue
            out = seq.output_token_ids
            if slot < len(out):
                assert out[slot] == PENDING, "a sampled token would overwrite a known one"
                out[slot] = token
            else:
                out.append(token)
            live.append((seq, slot, token))
        with record_function("kvtide.postprocess"):
            for seq, _ in handle.batch:
                if not seq.finished:
                    self.block_manager.commit(seq)
            outputs = []
            for seq, slot, token in live:
                try:
                    out = self._append_token(seq, slot, token, now)
                except Exception as e:  # noqa: BLE001 - stop checks / detokenizing of one request
                    out = self.fail(seq, f"processing its output failed: {type(e).__name__}: {e}")
                if out is not None:
                    outputs.append(out)
        return outputs

    def emit_first_token(self, seq: Sequence, token: int, now: float) -> RequestOutput | None:
        """Output the first token of a request whose prompt was computed outside a step (a restoration), once the
        scheduler runs it (``Scheduler.run_restored``): the token is appended, then text, stop checks and finish
        as for any sampled token."""
        slot = len(seq.output_token_ids)
        seq.output_token_ids.append(token)
        return self._append_token(seq, slot, token, now)

    def _append_token(self, seq: Sequence, slot: int, token: int, now: float) -> RequestOutput | None:
        """Output ``token`` (already at ``output_token_ids[slot]``): text, stop checks, finish."""
        if token == BAD_TOKEN:
            del seq.output_token_ids[slot:]
            return self.fail(seq, "the model produced non-finite logits (NaN or Inf) for this request")
        p = seq.params
        if seq.first_token_time is None:
            seq.first_token_time = now
        old_len = len(seq.text)
        seq.text += seq.detok.step(token)
        reason = None
        if not p.ignore_eos and token in self.tokenizer.eos_token_ids:
            reason = "stop"
        elif token in p.stop_token_ids:
            reason = "stop"
        elif p.stop:
            hit = _find_stop(seq.text, p.stop, old_len)
            if hit is not None:
                seq.text = seq.text[:hit]
                reason = "stop"
        if reason is None and (slot + 1 >= p.max_tokens or seq.num_prompt_tokens + slot + 1 >= self.max_seq_len):
            reason = "length"
        if reason is not None:
            del seq.output_token_ids[slot + 1:]  # a PENDING token of a step launched after this one
            seq.status = Status.FINISHED
            seq.finish_reason = reason
            seq.finish_time = now
            if self.restorer is not None:
                self.restorer.on_finish(seq)
            self.scheduler.finish(seq)
            self.seqs.pop(seq.request_id, None)
        # Hold back a possible stop-string prefix until it is decided.
        hold = 0 if seq.finished or not p.stop else max(len(s) for s in p.stop) - 1
        visible = max(seq.emitted_chars, len(seq.text) - hold)
        new_text = seq.text[seq.emitted_chars:visible]
        seq.emitted_chars = visible
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
            text=seq.text if seq.finished else seq.text[:visible], token_ids=seq.output_token_ids[:slot + 1],
            finished=seq.finished, finish_reason=seq.finish_reason, new_text=new_text, new_token_ids=[token],
            num_cached_tokens=seq.num_cached_tokens, queue_time=seq.queue_time, ttft=seq.ttft, num_preemptions=seq.num_preemptions,
            latency=(seq.finish_time - seq.arrival) if seq.finish_time is not None else None,
        )


def _find_stop(text: str, stops: list[str], old_len: int) -> int | None:
    """Earliest stop-string position that overlaps the newly added text."""
    best = None
    for s in stops:
        i = text.find(s, max(0, old_len - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best
