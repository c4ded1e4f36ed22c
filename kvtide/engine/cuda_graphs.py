"""CUDA graphs for decode steps (``EngineConfig.cuda_graphs``): whole steps where the attention backend can be
captured (:class:`FullDecodeGraph`, ``EngineConfig.full_cuda_graphs``: the backend plans into fixed buffers through
``AttentionBackend.plan_graph``), else piecewise (:class:`DecodeGraph`): the model between attention calls replays as
captured graphs and attention runs eagerly between them. Why each: docs/design/engine.md.

Piecewise capture runs the model once with a stand-in attention (:class:`_Segments`) that ends the running capture
at each attention call and returns a fixed buffer the next segment reads as the attention output. All segments of
one batch size share one memory pool and replay in capture order, as torch requires of graphs sharing a pool.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from contextlib import contextmanager

import torch

from ..kernels.cuda_jit import CudaJitError, pdl_nudge

# Before each whole-step replay, launch one trivial kernel eagerly as a programmatic dependent launch
# (cuda_jit.pdl_nudge; sm_90 and newer, where that attribute exists). Why: whole-step graphs idle longer before each
# small kernel than steps that launch a PDL kernel eagerly, and one such launch clears that state for the graphs
# replayed after it, a few percent of a step (docs/design/engine.md). KVTIDE_PDL_NUDGE=0 turns it off.
PDL_NUDGE = os.environ.get("KVTIDE_PDL_NUDGE", "1") == "1"


class _ZeroAttention:
    """Warm-up stand-in (cuBLAS handles and allocator state must exist before capture)."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(q)


class _Segments:
    """Stand-in attention during capture: cuts the capture at every attention call."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.outs: list[torch.Tensor] = []
        self.graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")  # other threads may run

    def end(self) -> None:
        self.graph.capture_end()
        self.graphs.append(self.graph)
        self.graph = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer != len(self.qkv):
            raise RuntimeError(f"attention calls out of order during capture (layer {layer} after {len(self.qkv)})")
        self.end()
        self.qkv.append((q, k, v))
        out = torch.empty_like(q)  # outside any capture: a plain buffer the next segment reads
        self.outs.append(out)
        self.begin()
        return out


class _StepInputs:
    """A captured decode step's fixed inputs (ids, positions, the rows whose logits it returns) and the side-stream
    warm-up every capture starts with. Every tensor a graph reads must outlive it: a local freed during capture
    would be reused under the graph's feet."""

    def __init__(self, batch: int, device: torch.device, ids: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None):
        self.batch = batch
        self.ids = torch.zeros(batch, dtype=torch.long, device=device) if ids is None else ids.clone()
        self.positions = torch.zeros(batch, dtype=torch.long, device=device) if positions is None else positions.clone()
        self.rows = torch.arange(batch, device=device)

    @contextmanager
    def _capturing(self, model: torch.nn.Module, device: torch.device, warmup: int):
        """On a side stream (captures may not run on the default one): ``warmup`` forwards with a stand-in attention
        (cuBLAS handles, allocator state), then the caller's capture; the current stream waits for it after."""
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                model(self.ids, self.positions, _ZeroAttention(), logit_rows=self.rows)
            yield
        torch.cuda.current_stream(device).wait_stream(side)

    def _load(self, ids: torch.Tensor, positions: torch.Tensor) -> None:
        self.ids.copy_(ids, non_blocking=True)
        self.positions.copy_(positions, non_blocking=True)


class DecodeGraph(_StepInputs):
    """One batch size's captured decode step."""

    def __init__(self, model: torch.nn.Module, batch: int, device: torch.device, warmup: int = 2):
        super().__init__(batch, device)
        rows = self.rows
        with self._capturing(model, device, warmup):
            seg = _Segments(torch.cuda.graph_pool_handle())
            seg.begin()
            try:
                self.logits = model(self.ids, self.positions, seg, logit_rows=rows)
            finally:
                if seg.graph is not None:
                    seg.end()
        self.graphs, self.qkv, self.outs = seg.graphs, seg.qkv, seg.outs
        if len(self.graphs) != len(self.qkv) + 1:
            raise RuntimeError("capture did not split into one segment per attention call plus one")

    def run(self, ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """Logits [batch, vocab] (float32) of one decode step; valid until the next run of this graph."""
        self._load(ids, positions)
        for layer, (q, k, v) in enumerate(self.qkv):
            self.graphs[layer].replay()
            self.outs[layer].copy_(attention(layer, q, k, v))
        self.graphs[-1].replay()
        return self.logits


def _nudge_device(device: torch.device) -> int | None:
    """The device index to nudge before replays (PDL_NUDGE), its kernel built now if the nudge is on (NVRTC, not
    inside a timed step); None below sm_90 or where the nudge cannot be built (replays then run without it)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index) < (9, 0):
        return None
    if PDL_NUDGE:
        try:
            pdl_nudge(index)
        except CudaJitError as e:
            import warnings

            warnings.warn(f"whole-step CUDA graphs run without the PDL nudge: {e}", RuntimeWarning, stacklevel=3)
            return None
    return index


class FullDecodeGraph(_StepInputs):
    """One decode step captured whole, the attention backend's kernels included, for one batch size and the plan
    key it was captured with. Captured during a real step: the backend has planned that step into its fixed
    buffers, the step's ids are in place, and one eager forward with the real attention (JIT builds, lazy state)
    runs before the capture; it writes the step's K/V, which the replay that follows writes again, identically."""

    def __init__(self, model: torch.nn.Module, batch: int, device: torch.device, attention, ids: torch.Tensor,
                 positions: torch.Tensor, warmup: int = 2):
        super().__init__(batch, device, ids, positions)
        self._nudge_device = _nudge_device(device)
        with self._capturing(model, device, warmup):
            model(self.ids, self.positions, attention, logit_rows=self.rows)
            self.graph = torch.cuda.CUDAGraph()
            self.graph.capture_begin(pool=torch.cuda.graph_pool_handle(), capture_error_mode="thread_local")
            try:
                self.logits = model(self.ids, self.positions, attention, logit_rows=self.rows)
            finally:
                self.graph.capture_end()

    def run(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [batch, vocab] of one decode step planned with this graph's key; valid until the next run."""
        self._load(ids, positions)
        if PDL_NUDGE and self._nudge_device is not None:
            pdl_nudge(self._nudge_device)
        self.graph.replay()
        return self.logits


class DecodeGraphs:
    """Captured decode steps by batch size (piecewise) or by the attention plan's key (whole steps), captured on
    first use; the least recently used go beyond ``max_sizes`` of each kind."""

    def __init__(self, model: torch.nn.Module, device: torch.device, max_sizes: int = 8):
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the engine runs on {device}")
        self.model = model
        self.device = device
        self.max_sizes = max_sizes
        self.cache: OrderedDict[int, DecodeGraph] = OrderedDict()
        self.full: OrderedDict[tuple, FullDecodeGraph] = OrderedDict()
        self.captures = 0
        self.full_captures = 0

    def run_full(self, key: tuple, ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """One whole decode step, the attention planned with ``plan_graph`` (``key``); captured on first use."""
        g = self.full.get(key)
        if g is None:
            g = FullDecodeGraph(self.model, ids.numel(), self.device, attention, ids, positions)
            self.full_captures += 1
            self.full[key] = g
            while len(self.full) > self.max_sizes:
                self.full.popitem(last=False)
        self.full.move_to_end(key)
        return g.run(ids, positions)

    def get(self, batch: int) -> DecodeGraph:
        g = self.cache.get(batch)
        if g is None:
            g = DecodeGraph(self.model, batch, self.device)
            self.captures += 1
            self.cache[batch] = g
            while len(self.cache) > self.max_sizes:
                self.cache.popitem(last=False)
        self.cache.move_to_end(batch)
        return g


class _Piece:
    """One half of a layer (before or after its attention call): a captured CUDA graph, or on the CPU (where there
    are no graphs) the same function run eagerly, so the buffer and padding logic around it is testable there."""

    def __init__(self, fn, pool, capture: bool) -> None:
        self.fn = fn
        self.graph = None
        if capture:
            # capture_begin/end, not ``torch.cuda.graph``: that one synchronises the device and collects garbage
            # per graph, and here a layer has two. The caller holds a side stream current.
            self.graph = torch.cuda.CUDAGraph()
            self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")  # other threads may run
            try:
                fn()
            finally:
                self.graph.capture_end()

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()


class LayerGraph:
    """One row bucket's layers, each as two replays (before and after its attention call) over fixed buffers.

    Why: a restoration's suffix (the few new tokens after a restored prefix) runs layer by layer, each layer as soon
    as its loads are in, and at 16-128 rows a layer is ~40 small kernels whose Python and launch cost (more of it
    beside the I/O thread, with which it shares the GIL) is the layer's time.
    Rows beyond the caller's ``t`` are padding: every op outside attention works row by row, and attention sees the
    first ``t`` rows only, so padding never reaches a real row. Buffers: ``h`` (the residual stream, read and
    written in place), ``positions``; per layer q/k/v (outputs of the first half) and the attention output (input
    of the second)."""

    def __init__(self, model: torch.nn.Module, rows: int, device: torch.device, capture: bool = True, warmup: int = 2):
        a = model.args
        dtype = model.model.embed_tokens.weight.dtype
        with torch.inference_mode(False):  # plain tensors: updated in place by callers in and out of inference mode
            self.h = torch.zeros(rows, a.hidden_size, dtype=dtype, device=device)
            self.positions = torch.zeros(rows, dtype=torch.long, device=device)
            self.outs = [torch.zeros(rows, a.num_heads, a.head_dim, dtype=dtype, device=device)
                         for _ in range(a.num_layers)]
        self.qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = [None] * a.num_layers  # type: ignore[list-item]
        self.calls = 0  # layers run
        layers = model.model.layers

        def before(i: int):
            def fn() -> None:
                cos, sin = model.rope(self.positions, dtype)
                self.qkv[i] = layers[i].before_attention(self.h, cos, sin)
            return fn

        def after(i: int):
            def fn() -> None:
                self.h.copy_(layers[i].after_attention(self.h, self.outs[i]))
            return fn

        fns = [f for i in range(a.num_layers) for f in (before(i), after(i))]
        if not capture:
            self.pieces = [_Piece(f, None, False) for f in fns]
            return
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):  # cuBLAS handles and allocator state must exist before capture
                fns[0]()
                fns[1]()
            self.h.zero_()
            # One pool for all pieces, replayed in any order (a staircase's layers, then the suffix's from layer 0):
            # what a piece leaves behind is either kept referenced (each layer's q/k/v) or copied into ``h``, so the
            # pool memory a later capture reused held only an earlier piece's own temporaries.
            pool = torch.cuda.graph_pool_handle()
            self.pieces = [_Piece(f, pool, True) for f in fns]
        torch.cuda.current_stream(device).wait_stream(side)

    def layer(self, i: int, t: int, attention) -> torch.Tensor:
        """Run layer ``i`` over the first ``t`` rows of ``h``; returns ``h[:t]`` (a view, valid until the next call)."""
        self.calls += 1
        self.pieces[2 * i]()
        q, k, v = self.qkv[i]
        out = attention(i, q[:t], k[:t], v[:t])
        self.outs[i][:t].copy_(out.reshape(t, *q.shape[1:]))
        self.pieces[2 * i + 1]()
        return self.h[:t]


class LayerGraphs:
    """``LayerGraph`` per row bucket (powers of two from 16 to ``max_rows``), captured on first use or by
    ``prepare``. Used by the restore port for layer calls of at most ``max_rows`` rows."""

    def __init__(self, model: torch.nn.Module, device: torch.device, max_rows: int = 128, capture: bool = True):
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the engine runs on {device}")
        if max_rows < 16 or max_rows & (max_rows - 1):
            raise ValueError(f"max_rows must be a power of two >= 16, got {max_rows}")
        self.model = model
        self.device = device
        self.max_rows = max_rows
        self.capture = capture
        self.cache: dict[int, LayerGraph] = {}
        self.captures = 0

    def bucket(self, rows: int) -> int:
        return max(16, 1 << (rows - 1).bit_length())

    def get(self, rows: int) -> LayerGraph:
        if not 0 < rows <= self.max_rows:
            raise ValueError(f"layer graphs take 1..{self.max_rows} rows, got {rows}")
        b = self.bucket(rows)
        g = self.cache.get(b)
        if g is None:
            g = self.cache[b] = LayerGraph(self.model, b, self.device, capture=self.capture)
            self.captures += 1
        return g

    def prepare(self, rows: list[int] | None = None) -> None:
        """Capture the buckets of these row counts (default: every bucket) now, not inside a timed restoration."""
        for n in rows if rows is not None else [16 << i for i in range((self.max_rows // 16).bit_length())]:
            if 0 < n <= self.max_rows:
                self.get(n)
