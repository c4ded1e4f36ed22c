"""Owns the model and the paged KV tensors; turns one scheduled step into a forward pass and sampled tokens."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from ..cache.zip_pages import ZipPagedKV
from ..kernels.h2d import to_device
from ..models.llama import CausalLM
from .attention import BatchLayout, PageArrays, make_backend, make_pool_backend
from .cuda_graphs import DecodeGraphs, LayerGraphs
from .sampler import greedy_tokens, sample
from .sequence import PENDING, Sequence


@dataclass
class StepHandle:
    """A launched step's sampled tokens: on the device (where the next step's decode rows read their input ids
    from, with no trip through the host) and, for greedy steps on CUDA, on their way to pinned host memory.

    ``seqs[i]`` sampled ``tokens_dev[i]``; ``rows`` maps a sequence (by id) to its row."""

    seqs: list[Sequence]
    tokens_dev: torch.Tensor
    host: torch.Tensor | None = None  # pinned copy in flight (CUDA), ready once ``event`` has run; BAD_TOKEN rows
    event: torch.cuda.Event | None = None
    tokens: list[int] | None = None  # already on the host (sampled there, or read)
    # booked by the engine when it launches the step: where each sampled token goes in its sequence's outputs,
    # and the step's (sequence, tokens) chunks
    slots: list[int] = field(default_factory=list)
    batch: list[tuple[Sequence, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rows = {id(s): i for i, s in enumerate(self.seqs)}

    def result(self) -> list[int]:
        """The sampled tokens (waits for the device the first time, on CUDA)."""
        if self.tokens is None:
            if self.event is not None:
                self.event.synchronize()
            self.tokens = (self.host if self.host is not None else self.tokens_dev).tolist()
        return self.tokens


class ModelRunner:
    """KV lives either in fixed per-layer tensors or, with ``pool`` (compress=True), in the compressed pool."""

    def __init__(self, model: CausalLM, num_pages: int, page_size: int, kv_dtype: torch.dtype, backend: str,
                 pool: ZipPagedKV | None = None, cuda_graphs: bool = False, compress_spread_steps: int = 1,
                 full_cuda_graphs: bool | None = None):
        a = model.args
        self.compress_spread_steps = compress_spread_steps  # see CacheConfig.compress_spread_steps
        self.model = model
        self.device = next(model.parameters()).device
        self.page_size = page_size
        self.num_pages = num_pages
        self.pool = pool
        self.page_arrays = PageArrays()  # block tables as arrays, extended step to step
        # decode-only steps replay the model between attention calls as CUDA graphs (cuda_graphs.py)
        self.graphs = DecodeGraphs(model, self.device) if cuda_graphs else None
        # and a restoration's short layer calls (its suffix) replay each layer's halves around attention
        self.layer_graphs = LayerGraphs(model, self.device) if cuda_graphs else None
        if pool is not None:
            self.kv_caches: list[torch.Tensor] = []
            self.attention = make_pool_backend(backend, pool, a.num_heads, a.num_kv_heads, a.head_dim, page_size)
            self.full_graphs = self.attention.whole_step_graphs if full_cuda_graphs is None else full_cuda_graphs
            return
        # One tensor per layer in FlashInfer's NHD layout: [num_pages, 2 (K, V), page_size, kv_heads, head_dim].
        self.kv_caches = [
            torch.zeros(num_pages, 2, page_size, a.num_kv_heads, a.head_dim, dtype=kv_dtype, device=self.device)
            for _ in range(a.num_layers)
        ]
        self.attention = make_backend(backend, self.kv_caches, a.num_heads, a.num_kv_heads, a.head_dim, page_size)
        # whole-step graphs where the backend can be captured (EngineConfig.full_cuda_graphs; None: its default)
        self.full_graphs = self.attention.whole_step_graphs if full_cuda_graphs is None else full_cuda_graphs

    @staticmethod
    def page_bytes(model_args, page_size: int, kv_dtype: torch.dtype) -> int:
        """Bytes one page costs across all layers (K and V)."""
        itemsize = torch.empty((), dtype=kv_dtype).element_size()
        return model_args.num_layers * 2 * page_size * model_args.num_kv_heads * model_args.head_dim * itemsize

    def layout(self, batch: list[tuple[Sequence, int]]) -> tuple[BatchLayout, list[int], list[int]]:
        """Flat token ids and positions for the scheduled chunks, and where each lands in the cache. An id may be
        ``PENDING``: a token the previous step sampled on the device (see :meth:`launch`)."""
        p = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq, n in batch:
            start = seq.num_computed_tokens
            ids.extend(seq.tokens(start, start + n))
            for pos in range(start, start + n):
                positions.append(pos)
                slots.append(seq.pages[pos // p] * p + pos % p)
        layout = BatchLayout(
            q_lens=[n for _, n in batch],
            kv_lens=[seq.num_computed_tokens + n for seq, n in batch],
            block_tables=[seq.pages for seq, _ in batch],
            slot_mapping=to_device(torch.tensor(slots, dtype=torch.long), self.device),
            page_size=p,
            page_arrays=self.page_arrays([seq.pages for seq, _ in batch]),
        )
        return layout, ids, positions

    def _input_ids(self, batch: list[tuple[Sequence, int]], ids: list[int], prev: StepHandle | None) -> torch.Tensor:
        """The step's ids on the device; a ``PENDING`` one (only ever a sequence's last token) is taken from
        ``prev``'s device tokens."""
        fill_at, fill_from = [], []
        at = 0
        for seq, n in batch:
            at += n
            if ids[at - 1] == PENDING:
                row = None if prev is None else prev.rows.get(id(seq))
                if row is None:
                    raise RuntimeError(f"request {seq.request_id}: its last token is still pending but the step "
                                       "that samples it is not the previous one")
                fill_at.append(at - 1)
                fill_from.append(row)
        out = to_device(torch.tensor(ids, dtype=torch.long), self.device)
        if fill_at:
            src = prev.tokens_dev.index_select(0, to_device(torch.tensor(fill_from, dtype=torch.long), self.device))
            out.index_copy_(0, to_device(torch.tensor(fill_at, dtype=torch.long), self.device), src)
        return out

    @torch.inference_mode()
    def launch(self, batch: list[tuple[Sequence, int]], generators: list[torch.Generator | None],
               prev: StepHandle | None = None) -> StepHandle:
        """Enqueue one step and return its handle, without waiting for the device when every sampling sequence is
        greedy (on CUDA): the engine then prepares the next step while this one runs. ``prev``: the step before,
        whose device tokens fill this step's ``PENDING`` ids. Sequences' progress is the caller's to advance."""
        # named ranges: a profile shows where a step's host time goes
        with record_function("kvtide.layout"):
            layout, ids, positions = self.layout(batch)
            sampling = [i for i, (seq, n) in enumerate(batch) if seq.num_computed_tokens + n == seq.num_tokens]
            starts = layout.q_starts
            ids_dev = self._input_ids(batch, ids, prev)
            pos_dev = to_device(torch.tensor(positions, dtype=torch.long), self.device)
        graphed = self.graphs is not None and layout.is_decode_only
        with record_function("kvtide.attention_plan"):
            key = self.attention.plan_graph(layout) if graphed and self.full_graphs else self.attention.plan(layout)
        with record_function("kvtide.model"):
            if graphed:  # logits of all rows, then the sampled ones
                if key is not None:
                    logits = self.graphs.run_full(key, ids_dev, pos_dev, self.attention)
                else:
                    logits = self.graphs.get(len(ids)).run(ids_dev, pos_dev, self.attention)
                if len(sampling) != len(batch):  # a one-token prompt chunk short of its prompt's end samples nothing
                    logits = logits[to_device(torch.tensor(sampling, dtype=torch.long), self.device)]
            else:
                rows = to_device(torch.tensor([starts[i] + batch[i][1] - 1 for i in sampling], dtype=torch.long),
                                 self.device)
                logits = self.model(ids_dev, pos_dev, self.attention, logit_rows=rows)
        if self.pool is not None:  # enqueued after this step's attention reads
            p = self.page_size
            with record_function("kvtide.compress"):
                # earlier steps' filled pages: host placement while the device runs this step's forward, a share
                # of a page step's pages each step (at least 8 a step, so what one page step fills is placed
                # within compress_spread_steps steps; a prefill step below places everything)
                share = max(8, -(-len(batch) // self.compress_spread_steps))
                self.pool.compress_finish(max_pages=share if layout.is_decode_only else None)
                self.pool.compress_begin([pid for seq, n in batch for pid in
                                           seq.pages[seq.num_computed_tokens // p:(seq.num_computed_tokens + n) // p]])
                if not layout.is_decode_only:  # prefill chunks fill many pages: no staged copy held for a step
                    self.pool.compress_finish()
        seqs = [batch[i][0] for i in sampling]
        params = [s.params for s in seqs]
        if not seqs:
            return StepHandle([], torch.zeros(0, dtype=torch.long, device=self.device), tokens=[])
        if all(p.greedy for p in params):
            tok, checked = greedy_tokens(logits)  # checked: BAD_TOKEN where a row's logits are not finite
            if tok.device.type != "cuda":
                return StepHandle(seqs, tok, tokens=checked.tolist())
            host = torch.empty(tok.shape, dtype=tok.dtype, pin_memory=True)
            host.copy_(checked, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            return StepHandle(seqs, tok, host, event)
        # temperature / top-k / top-p: on the host, with each request's own generator (waits for the device)
        toks = sample(logits, params, [generators[i] for i in sampling])
        ids = [max(t, 0) for t in toks]  # a BAD_TOKEN row's next input: any valid id (its request is ended)
        return StepHandle(seqs, to_device(torch.tensor(ids, dtype=torch.long), self.device), tokens=toks)

    def execute(self, batch: list[tuple[Sequence, int]], generators: list[torch.Generator | None]) -> list[int]:
        """Run one step and wait for it. Returns one sampled token per sequence whose chunk reaches its last token,
        in order."""
        return self.launch(batch, generators).result()
