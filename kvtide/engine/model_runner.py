"""Owns the model and the paged KV tensors; turns one scheduled step into a forward pass and sampled tokens."""
from __future__ import annotations

import torch
from torch.profiler import record_function

from ..cache.zip_pages import ZipPagedKV
from ..models.llama import CausalLM
from .attention import BatchLayout, PageArrays, make_backend
from .cuda_graphs import DecodeGraphs, LayerGraphs
from .zip_backend import make_zip_backend
from .sampler import sample
from .sequence import Sequence


class ModelRunner:
    """KV lives either in fixed per-layer tensors or, with `store` (compress=True), in the compressed pool."""

    def __init__(self, model: CausalLM, num_pages: int, page_size: int, kv_dtype: torch.dtype, backend: str,
                 store: ZipPagedKV | None = None, cuda_graphs: bool = False):
        a = model.args
        self.model = model
        self.device = next(model.parameters()).device
        self.page_size = page_size
        self.num_pages = num_pages
        self.store = store
        self.page_arrays = PageArrays()  # block tables as arrays, extended step to step
        # decode-only steps replay the model between attention calls as CUDA graphs (kvtide/engine/cuda_graphs.py)
        self.graphs = DecodeGraphs(model, self.device) if cuda_graphs else None
        # and a restoration's short layer calls (its suffix) replay each layer's halves around attention
        self.layer_graphs = LayerGraphs(model, self.device) if cuda_graphs else None
        if store is not None:
            self.kv_caches: list[torch.Tensor] = []
            self.attention = make_zip_backend(backend, store, a.num_heads, a.num_kv_heads, a.head_dim, page_size)
            return
        # One tensor per layer in FlashInfer's NHD layout: [num_pages, 2 (K, V), page_size, kv_heads, head_dim].
        self.kv_caches = [
            torch.zeros(num_pages, 2, page_size, a.num_kv_heads, a.head_dim, dtype=kv_dtype, device=self.device)
            for _ in range(a.num_layers)
        ]
        self.attention = make_backend(backend, self.kv_caches, a.num_heads, a.num_kv_heads, a.head_dim, page_size)

    @staticmethod
    def page_bytes(model_args, page_size: int, kv_dtype: torch.dtype) -> int:
        """Bytes one page costs across all layers (K and V)."""
        itemsize = torch.empty((), dtype=kv_dtype).element_size()
        return model_args.num_layers * 2 * page_size * model_args.num_kv_heads * model_args.head_dim * itemsize

    def layout(self, batch: list[tuple[Sequence, int]]) -> tuple[BatchLayout, list[int], list[int]]:
        """Flat token ids and positions for the scheduled chunks, and where each lands in the cache."""
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
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            page_size=p,
            page_arrays=self.page_arrays([seq.pages for seq, _ in batch]),
        )
        return layout, ids, positions

    @torch.inference_mode()
    def execute(self, batch: list[tuple[Sequence, int]], generators: list[torch.Generator | None]) -> list[int]:
        """Run one step. Returns one sampled token per sequence whose chunk reaches its last token, in order."""
        # named ranges: a profile (bench/zip_engine.py --profile-steps) shows where a step's host time goes
        with record_function("kvtide.layout"):
            layout, ids, positions = self.layout(batch)
            sampling = [i for i, (seq, n) in enumerate(batch) if seq.num_computed_tokens + n == seq.num_tokens]
            starts = layout.q_starts
            rows = torch.tensor([starts[i] + batch[i][1] - 1 for i in sampling], dtype=torch.long, device=self.device)
        with record_function("kvtide.attention_plan"):
            self.attention.plan(layout)
        with record_function("kvtide.model"):
            if self.graphs is not None and layout.is_decode_only:  # logits of all rows, then the sampled ones
                logits = self.graphs.get(len(ids)).run(torch.tensor(ids), torch.tensor(positions), self.attention)
                if len(sampling) != len(batch):  # a one-token prompt chunk short of its prompt's end samples nothing
                    logits = logits[rows]
            else:
                logits = self.model(
                    torch.tensor(ids, dtype=torch.long, device=self.device),
                    torch.tensor(positions, dtype=torch.long, device=self.device),
                    self.attention,
                    logit_rows=rows,
                )
        if self.store is not None:  # enqueued after this step's attention reads
            p = self.page_size
            with record_function("kvtide.compress"):
                # the previous step's filled pages: host placement while the device runs this step's forward
                self.store.compress_finish()
                self.store.compress_begin([pid for seq, n in batch for pid in
                                           seq.pages[seq.num_computed_tokens // p:(seq.num_computed_tokens + n) // p]])
                if not layout.is_decode_only:  # prefill chunks fill many pages: no staged copy held for a step
                    self.store.compress_finish()
        if not sampling:
            return []
        return sample(logits, [batch[i][0].params for i in sampling], [generators[i] for i in sampling])
