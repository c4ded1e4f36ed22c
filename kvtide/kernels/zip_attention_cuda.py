"""CUDA paged DECODE attention over ZipFusion pages in the "mma" value order (the ZipFusion paper's kernel design).

Why CUDA next to the Triton kernel (:mod:`kvtide.kernels.zip_attention`): measured on the H200, the Triton kernel
runs ~1,300 instructions per page and warp, a third of them moving rebuilt values from the layout Triton picks
into the tensor cores' operand layout through shared memory; Triton gives no way to rebuild values straight into
MMA fragments. Here each lane loads exactly the bytes of its own fragment values (the group's "mma" value order,
:mod:`kvtide.cache.zip_order`) and rebuilds them in registers with ~1.5 integer ops per value (byte-parallel
high bytes + one byte permute per pair), so no decompressed value ever leaves a register.

Kernel (``cuda/zip_decode.cu``): one warp per (sequence, KV head, split), one page of 16 tokens per step:
S^T = K Q^T on ``mma.m16n8k16`` (tokens as M, the GQA group padded to N = 8), online softmax in base 2 with a
lazy rescale (the running max moves only when it grows by more than 2^8), P^T through ``movmatrix`` into the
B operand, O^T += V^T P^T. The next page's loads are issued as soon as this page's buffer is consumed; page
metadata comes 32 pages at a time (one page per lane, broadcast by shuffles). Where the next page waits is the
plan's ``stage`` (:data:`STAGES`): at head_dim 128 the default stages V in the warp's slot of shared memory by
cp.async (and keeps Q's fragments there), which takes the kernel from 158 to 128-146 registers, lets 16 warps share
an SM and measured 0.5-1.5% faster on the H200 at the larger shapes (``bench/zip_kernel_ab.py``); staging K too
(stage 2) was slower at 12 warps per SM and no faster at 16. A split sequence gets one CTA whose warps are its
splits (``plan(cta_merge=True)``, the default where it adds no wave): they merge their normalised
partial outputs and base-2 log-sum-exps in shared memory, 4-5 us less per call on the H200 than writing them out
for the ``zip_merge`` launch, which remains for more splits than a CTA holds. Even splits leave the last wave nearly
empty just past a wave boundary (67 x 8 KV heads on 132 SMs x 16 warps); ``plan(balanced=True)`` instead lays every
(sequence, KV head) page list end to end and gives each warp an equal run of it, crossing unit boundaries
(``zip_merge_balanced`` merges the pieces): 1.9% faster at that shape, slower where even splits merge in a CTA, so
:data:`AUTO_BALANCED` takes it only where even splits would not. Where partials still go through global memory,
``plan(tail_merge=True)`` has the last warp of each (sequence, KV head) merge them (a counter per unit) in place of
the merge launch (:data:`AUTO_TAIL_MERGE`: off, 0.4-1.3% slower on the H200). ``plan(pdl=True)`` launches the
kernels as programmatic dependent launches (:data:`AUTO_PDL`: off, no faster in the engine). Raw blocks (the page
being written, blocks the format left raw) are read as they are, in the same order, so the same kernel over an
all-raw pool is the format-free control.

Compiled by NVRTC (:mod:`kvtide.kernels.cuda_jit`) by :func:`build` (the engine's backend calls it when made), else
at first use; plan once per batch, run per layer. Torch reference: :mod:`kvtide.kernels.zip_attention_ref` with
``zip_order.to_natural``.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import cuda_jit
from .h2d import copy_into, to_device
from .page_table import sequence_lengths

SOURCE = Path(__file__).with_name("cuda") / "zip_decode.cu"
LOG2E = 1.4426950408889634
MAX_GROUP = 8  # the GQA group is the MMA's N side
MAX_POOL_BYTES = 1 << 36  # group starts travel as 32-bit counts of 16-byte units
LOAD_HINTS = {0: "none", 1: "L1::no_allocate", 2: "L1::no_allocate + L2::256B prefetch",
              3: "L1::no_allocate + L2 evict_first"}
SPLIT_START_PAGES = 4  # a split's fixed cost (Q and metadata loads, first page's latency, merge) in pages

# launch defaults per head_dim: the stage, and per stage the launch shapes (warps per CTA, CTAs per SM the register
# budget is cut for) the wave model chooses from. head_dim 128 at stage 1 (V staged, Q in shared memory) fits 128
# registers, so 16 warps per SM next to stage 0's 12 (158 registers). Measured on the H200
# (bench/results/zip_kernel_ab_stage_confirm_h200.json, 9 interleaved rounds): stage 1 0.5-1.5% faster than stage 0
# at 8192 x 64 / 96 and 2048 x 64 / 96; 16 warps per SM faster where they buy more splits in one wave (8192 x 32 /
# 64 / 96, 2048 x 32 / 64, each rated 22-25% faster by the wave model), 2% slower at 2048 x 96 (rated 12% faster:
# short splits, whose start-up the model underrates).
_DEFAULTS = {128: dict(launches={0: [(4, 3)], 1: [(4, 3), (4, 4)], 2: [(4, 3), (4, 4)]}, waves=None, stage=1),
             64: dict(launches={0: [(4, 4)], 1: [(4, 4)], 2: [(4, 4)]}, waves=None, stage=0)}
SHAPE_MARGIN = 0.85  # a later launch shape is taken only when the wave model rates it at most this x the first
SPLITS_HINT_MARGIN = 1.10  # plan(splits_hint=): kept while the wave model rates it at most this x its own choice
# Balanced runs (zip_decode.cu BALANCED), plan(balanced=None) with AUTO_BALANCED: taken where the even splits would
# merge through global memory anyway (no CTA merge), the wave model rates the runs at most BALANCED_MARGIN x the even
# splits, and each warp's run holds at least BALANCED_MIN_PAGES pages. Measured on the H200 (v2, 8320-token contexts,
# bench/results/zip_splits_balanced_h200.json, 3 interleaved rounds): faster where the rule takes them (53, 67, 68, 69
# sequences: 1.5 / 1.9 / 0.4 / 0.7%), slower against CTA-merged even splits (64, 66, 90, 96: 1.1-2.8%) and at
# 2048-token contexts (runs of 26-63 pages: 0-6%). In the engine (8B shape, 67 sequences of 8K, whole-step graphs,
# two interleaved rounds on one engine, bench/results/zip_engine_other_balanced_h200.json): 21.71 / 21.66 ms per step
# against 21.82 / 21.78 with even splits, 0.5% faster.
AUTO_BALANCED = True
# Tail merge (zip_decode.cu TAIL_MERGE), plan(tail_merge=None) with AUTO_TAIL_MERGE: where partials go through global
# memory (even splits a CTA cannot merge, balanced runs), the last warp to finish a (sequence, KV head) merges its
# pieces, so no zip_merge launch follows (0.19 ms of a 21.3 ms step at 67 x 8K on the H200, profile of
# bench/results/zip_engine_profile67_h200.json). Off: measured on the H200 (bench/zip_splits.py --balanced
# --tail-merge, real KV, 8320 tokens, 3 interleaved rounds, bench/results/zip_splits_tail_merge_h200.json) the merge
# launch is faster: even splits 431.4 vs 435.8 us at 67 sequences, balanced runs 422.0 vs 423.8; 0.4-1.3% at 53, 67
# and 68, level at 66 (the counters' atomics and the last warp's serial merge cost more than the launch saves).
AUTO_TAIL_MERGE = False
# Programmatic dependent launch (cuda_jit.Kernel.launch(pdl=True)), plan(pdl=None) with AUTO_PDL: the kernels are
# launched so that the GPU may schedule them while the kernel before them drains (each waits for its memory with
# griddepcontrol.wait first). Why it was tried: zip's engine steps idle ~0.4 us before small kernels where
# FlashInfer's piecewise steps idle ~0.1, and an eager launch with this attribute (FlashInfer's decode kernel, or a
# trivial one) takes the process out of that slow state (bench/graph_nodes.py --sequence). Off: in the engine's
# whole-step graph it changed nothing (67 sequences, alternated on one engine: 21.63 / 21.64 ms a step with it,
# 21.63 / 21.65 without; bench/results/zip_engine_other_pdl_h200.json). KVTIDE_ZIP_PDL=1 turns it on (the GPU tests
# pass that way: bench/results/gpu_tests_pdl_h200_log.txt).
AUTO_PDL = os.environ.get("KVTIDE_ZIP_PDL", "0") == "1"
BALANCED_MARGIN = 0.92
BALANCED_MIN_PAGES = 64
STAGES = {0: "K and V in registers", 1: "V staged in shared memory (cp.async)", 2: "K and V staged in shared memory"}


def default_stage(head_dim: int) -> int:
    """Where the next page's groups wait by default at this head_dim (:data:`STAGES`)."""
    return _DEFAULTS[head_dim]["stage"]


def split_cost(units: int, max_pages: int, resident_warps: int, splits: int) -> int:
    """The wave model's time of ``splits`` splits per (sequence, KV head), in pages: ``units * splits`` warps run
    ``resident_warps`` at a time, each walking ``max_pages / splits`` pages after a start-up worth about
    ``SPLIT_START_PAGES``."""
    return math.ceil(units * splits / resident_warps) * (math.ceil(max_pages / splits) + SPLIT_START_PAGES)


def pick_splits(units: int, max_pages: int, resident_warps: int) -> int:
    """Splits per (sequence, KV head) under the wave model (:func:`split_cost`); the fewest splits among the best."""
    best, best_cost = 1, math.inf
    for s in range(1, max(1, min(max_pages // 4, 128)) + 1):
        cost = split_cost(units, max_pages, resident_warps, s)
        if cost < best_cost * 0.98:
            best, best_cost = s, cost
    return best


def balanced_run(total_pages: int, resident_warps: int) -> tuple[int, int]:
    """(pages per warp, the wave model's time in pages) of balanced runs over ``total_pages`` (every unit's pages,
    laid end to end) on ``resident_warps`` warps: one wave of equal runs, each paying start-up for the at most two
    units it meets when runs are shorter than the units."""
    per = max(1, math.ceil(total_pages / resident_warps))
    return per, per + 2 * SPLIT_START_PAGES


def balanced_pieces(indptr: list[int], num_kv_heads: int, per_warp: int, grid_warps: int) -> list[tuple[int, ...]]:
    """The BALANCED kernel's walk on the host (zip_decode.cu ``zip_decode``): (warp, sequence, KV head, piece, first
    page, pages) of every piece, for tests and for reading the kernel. Units are (sequence, KV head) page lists laid
    end to end, sequence-major; warp w takes pages [w * per_warp, (w + 1) * per_warp) of that line."""
    total = num_kv_heads * indptr[-1]
    out = []
    for w in range(grid_warps):
        x, xe = w * per_warp, min((w + 1) * per_warp, total)
        b = 0
        while x < xe:
            while num_kv_heads * indptr[b + 1] <= x:
                b += 1
            base, length = num_kv_heads * indptr[b], indptr[b + 1] - indptr[b]
            h, p0 = divmod(x - base, length)
            n = min(length - p0, xe - x)
            out.append((w, b, h, w - (base + h * length) // per_warp, p0, n))
            x += n
    return out


def balanced_piece_count(indptr: list[int], num_kv_heads: int, per_warp: int, b: int, h: int) -> int:
    """Pieces of unit (b, h) under balanced runs: what ``zip_merge_balanced`` merges."""
    length = indptr[b + 1] - indptr[b]
    first = num_kv_heads * indptr[b] + h * length
    return (first + length - 1) // per_warp - first // per_warp + 1 if length else 0


def unsupported(device: torch.device | str | None = None) -> str | None:
    """Why the CUDA kernel cannot run here (None when it can)."""
    if not torch.cuda.is_available():
        return "the CUDA ZipFusion kernel needs a CUDA device"
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return f"the CUDA ZipFusion kernel needs CUDA tensors, got device {dev}"
    major, minor = torch.cuda.get_device_capability(dev)
    if major < 8:
        return f"the CUDA ZipFusion kernel needs sm_80 or newer (bf16 mma), this device is sm_{major}{minor}"
    try:
        cuda_jit.nvrtc()
    except cuda_jit.CudaJitError as e:
        return str(e)
    return None


def store_unsupported(device: torch.device | str, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                      page_size: int, block_size: int, pool_bytes: int) -> str | None:
    """Why the kernel cannot serve a pool of ``pool_bytes`` with this shape on ``device`` (None when it can)."""
    why = unsupported(device) or shape_unsupported(num_qo_heads, num_kv_heads, head_dim, page_size, block_size)
    if why is None and pool_bytes > MAX_POOL_BYTES:
        why = f"a pool of {pool_bytes >> 30} GiB is beyond the kernel's {MAX_POOL_BYTES >> 30} GiB reach"
    return why


def shape_unsupported(num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int = 16,
                      block_size: int = 512) -> str | None:
    """Why the kernel cannot take this attention shape (None when it can); host only, nothing compiled."""
    one = torch.tensor([0, 1], dtype=torch.int32)
    try:
        plan(one, one[:1], torch.tensor([page_size], dtype=torch.int32), num_qo_heads, num_kv_heads, head_dim,
             page_size, block_size=block_size, num_splits=1, device="cpu")
    except ValueError as e:
        return str(e)
    return None


@functools.cache
def kernels(device: int, head_dim: int, version: int, warps: int, min_blocks: int, load_hint: int = 0,
            cta_merge: bool = False, stage: int = 0, balanced: bool = False,
            tail_merge: bool = False) -> dict[str, cuda_jit.Kernel]:
    return build_source(SOURCE.read_text(), device, defines(head_dim, version, warps, min_blocks, load_hint,
                                                             cta_merge, stage, balanced, tail_merge))


def defines(head_dim: int, version: int, warps: int, min_blocks: int, load_hint: int = 0,
            cta_merge: bool = False, stage: int = 0, balanced: bool = False,
            tail_merge: bool = False) -> dict[str, int]:
    """The compile-time constants of one launch shape (cuda/zip_decode.cu's -D list)."""
    if balanced and cta_merge:
        raise ValueError("balanced runs merge through global memory: they cannot be merged in a CTA")
    if tail_merge and cta_merge:
        raise ValueError("the tail merge merges partials in global memory: it cannot be combined with a CTA merge")
    return dict(HEAD_DIM=head_dim, VERSION=version, NWARPS=warps, MIN_BLOCKS=min_blocks, LOAD_HINT=load_hint,
                CTA_MERGE=int(cta_merge), STAGE=stage, BALANCED=int(balanced), TAIL_MERGE=int(tail_merge))


def smem_bytes(head_dim: int, warps: int, stage: int) -> int:
    """Dynamic shared memory of a CTA (cuda/zip_decode.cu WARP_SMEM): per warp a slot of one group (16 x head_dim
    bf16) for V, one more for K at stage 2, and Q's B fragments (16 x head_dim bytes); none at stage 0."""
    return 0 if stage == 0 else warps * ((2 if stage >= 2 else 1) * 32 * head_dim + 16 * head_dim)


def build_source(source: str, device: int, defs: dict[str, int]) -> dict[str, cuda_jit.Kernel]:
    """Compile ``source`` (zip_decode.cu or a variant of it) with ``defs`` for ``device`` and load it."""
    major, minor = torch.cuda.get_device_capability(device)
    cubin, _log = cuda_jit.compile_cubin(source, "zip_decode", major * 10 + minor, defs)
    return cuda_jit.load(cubin, ["zip_decode", "zip_merge", "zip_merge_balanced"], device)


def default_launches(head_dim: int) -> list[tuple[int, int, bool, bool]]:
    """(warps, min_blocks, cta_merge, balanced) of every kernel :func:`plan`'s default launch shape can pick: the
    shape itself with even splits (and balanced runs, with :data:`AUTO_BALANCED` on), and one CTA-merge variant per
    split count it can merge in a CTA."""
    d = _DEFAULTS[head_dim]
    out = []
    for w, mb in d["launches"][d["stage"]]:
        out += [(w, mb, False, False)] + ([(w, mb, False, True)] if AUTO_BALANCED else [])
        out += [(s, cta_blocks(w, mb, s), True, False) for s in range(2, max_cta_splits(head_dim, d["stage"]) + 1)]
    return sorted(set(out))


def cta_blocks(warps: int, min_blocks: int, splits: int) -> int:
    """CTAs of ``splits`` warps per SM that keep the ``warps`` x ``min_blocks`` warps per SM a launch shape asks for
    (the CTA merge's register budget; :func:`plan` and :func:`default_launches` must agree on it)."""
    return max(1, warps * min_blocks // splits)


def build(device: torch.device | str | int, head_dim: int, version: int) -> None:
    """Compile and load every kernel :func:`plan`'s default launch shape may run (cached per process; in parallel
    threads, NVRTC releases the GIL), so that a serving engine pays for NVRTC when it starts, not inside a decode
    step (FlashInfer's first-use JIT build was measured stalling a first decode step for ~19 s on the H200)."""
    from concurrent.futures import ThreadPoolExecutor

    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    launches = default_launches(head_dim)
    with ThreadPoolExecutor(max_workers=min(8, len(launches))) as ex:
        stage = default_stage(head_dim)
        # with the tail merge on, a launch shape runs tail-merged where it splits, as it is where it does not
        forms = [(w, mb, cm, bal, tail) for w, mb, cm, bal in launches
                 for tail in ((False, True) if AUTO_TAIL_MERGE and not cm else (False,))]
        for f in [ex.submit(kernels, index, head_dim, version, w, mb, 0, cm, stage, bal, tail)
                  for w, mb, cm, bal, tail in forms]:
            f.result()


def max_cta_splits(head_dim: int, stage: int = 0) -> int:
    """Most splits one CTA merges, at most 16 warps: at stage 0 its warps' partials ([splits, 8 heads, head_dim + 1]
    fp32: outputs and log-sum-exps) fit 48 KB of static shared memory; staged, each warp's partial output reuses
    its V slot and the CTA's dynamic shared memory (:func:`smem_bytes`) must fit 227 KB."""
    if stage == 0:
        return min(16, (48 << 10) // (8 * (head_dim + 1) * 4))
    return min(16, (227 << 10) // smem_bytes(head_dim, 1, stage))


class PlanBuffers:
    """Fixed device buffers that one batch size's plans are written into (``plan(buffers=...)``), so that a CUDA
    graph captured over :func:`run` replays every later plan with the same :func:`graph_key`: the graph holds these
    addresses, and everything that changes from step to step (page table, lengths, pages per split) is read from
    them by the kernel. The page-id buffer grows geometrically; growing it moves it, which changes the key."""

    def __init__(self, batch: int, device: torch.device | str):
        self.batch = batch
        self.device = torch.device(device)
        self.indptr = torch.zeros(batch + 1, dtype=torch.int32, device=self.device)
        self.meta = torch.zeros(batch + 1, dtype=torch.int32, device=self.device)  # kv lens, then pages per split
        self.indices = torch.zeros(0, dtype=torch.int32, device=self.device)
        self.generation = 0  # bumped whenever a buffer a graph may hold is replaced
        self._parts: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._arrive: torch.Tensor | None = None

    def page_ids(self, nnz: int) -> torch.Tensor:
        """The page-id buffer, at least ``nnz`` long."""
        if self.indices.numel() < nnz:
            self.indices = torch.zeros(1 << max(10, math.ceil(math.log2(nnz * 1.25))), dtype=torch.int32,
                                       device=self.device)
            self.generation += 1
        return self.indices

    def arrivals(self, num_kv_heads: int) -> torch.Tensor:
        """The tail merge's counters, one per (sequence, KV head), zero between launches (each launch re-arms them)."""
        if self._arrive is None or self._arrive.numel() != self.batch * num_kv_heads:
            self._arrive = torch.zeros(self.batch * num_kv_heads, dtype=torch.int32, device=self.device)
        return self._arrive

    def parts(self, num_qo_heads: int, splits: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Split partials (outputs, base-2 log-sum-exps) for the zip_merge launch, one pair per shape."""
        key = (num_qo_heads, splits, head_dim)
        if key not in self._parts:
            self._parts[key] = (
                torch.empty(self.batch, num_qo_heads, splits, head_dim, dtype=torch.float32, device=self.device),
                torch.empty(self.batch, num_qo_heads, splits, dtype=torch.float32, device=self.device))
        return self._parts[key]


@dataclass
class CudaDecodePlan:
    """What every layer of one decode batch shares: page table, lengths, splits, launch shape, split buffers."""

    indptr: torch.Tensor  # int32 [B + 1]
    indices: torch.Tensor  # int32 [>= nnz pages]
    kv_lens: torch.Tensor  # int32 [B]
    split_pages: torch.Tensor  # int32 [1], pages_per_split on the device (the kernel reads it there)
    batch: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    version: int
    num_splits: int
    pages_per_split: int
    warps: int
    min_blocks: int
    sm_scale: float
    load_hint: int = 0  # cache hints on the KV loads (see cuda/zip_decode.cu LOAD_HINT)
    stage: int = 0  # where the next page's groups wait: 0 registers, 1 V in shared memory, 2 K and V (STAGE)
    cta_merge: bool = False  # one CTA per (sequence, KV head), its warps the splits, merged in shared memory
    # balanced runs (BALANCED): grid_warps warps, each pages_per_split pages of all units laid end to end;
    # num_splits is then the partial slots per unit (the most pieces a unit can be cut into)
    balanced: bool = False
    grid_warps: int = 0
    tail_merge: bool = False  # the last warp of each unit merges its partials (TAIL_MERGE): no zip_merge launch
    pdl: bool = False  # programmatic dependent launches (AUTO_PDL)
    arrive: torch.Tensor | None = field(default=None, repr=False)  # int32 [B * Hkv], the tail merge's counters
    opart: torch.Tensor | None = field(default=None, repr=False)  # fp32 [B, Hq, S, D]
    lse: torch.Tensor | None = field(default=None, repr=False)  # fp32 [B, Hq, S], base 2

    buffers: PlanBuffers | None = field(default=None, repr=False)  # where the device arrays live, if fixed

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads


def graph_key(p: CudaDecodePlan) -> tuple | None:
    """What a CUDA graph captured over :func:`run` with plan ``p`` bakes in (None: ``p`` has no fixed buffers, so it
    cannot be replayed): a later plan with the same key replays that graph. Pages per split is not part of it."""
    if p.buffers is None:
        return None
    return (p.batch, p.num_qo_heads, p.num_kv_heads, p.head_dim, p.version, p.num_splits, p.warps, p.min_blocks,
            p.load_hint, p.stage, p.cta_merge, p.balanced, p.grid_warps, p.tail_merge, p.pdl, float(p.sm_scale),
            id(p.buffers), p.buffers.generation)


def plan(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, num_qo_heads: int,
         num_kv_heads: int, head_dim: int, page_size: int = 16, *, block_size: int = 512, version: int = 1,
         sm_scale: float | None = None, num_splits: int | None = None, warps: int | None = None,
         min_blocks: int | None = None, waves: float | None = None, load_hint: int = 0,
         cta_merge: bool = True, stage: int | None = None, device: torch.device | str | None = None,
         buffers: PlanBuffers | None = None, splits_hint: int | None = None, balanced: bool | None = None,
         balanced_warps: int | None = None, tail_merge: bool | None = None,
         pdl: bool | None = None) -> CudaDecodePlan:
    """Plan one decode batch (FlashInfer-style page table); host work happens here, not per layer.

    ``num_splits=None``: with ``waves`` None (default) :func:`pick_splits`'s wave model over the resident warps
    (``min_blocks`` CTAs of ``warps`` warps per SM; with both None, the stage's first launch shape or a later one the
    model rates :data:`SHAPE_MARGIN` x its time or less); with ``waves`` set, enough splits for B * Hkv * splits warps to
    fill that many waves, at least 8 pages per split. ``cta_merge``: where a sequence is split into 2 to
    :func:`max_cta_splits` parts and CTAs of that many warps need no more waves than the requested shape, launch
    those instead and merge on chip (the plan's ``warps``/``min_blocks`` are then the CTA's). ``load_hint``: cache
    hints on the KV loads (:data:`LOAD_HINTS`; measured no faster on the H200, so 0). ``stage``: where the next
    page's groups wait (:data:`STAGES`; None: the head_dim's default). ``buffers``: write the device arrays into
    these fixed buffers (same batch size) instead of new tensors, for replay in a captured graph (:func:`graph_key`).
    ``splits_hint``: a split count to keep (a captured graph's) where the wave model rates it within
    :data:`SPLITS_HINT_MARGIN` of its own choice; small batches' best count moves with every few pages of context,
    and each move would cost a graph capture. ``balanced``: cut all units' pages, laid end to end, into equal runs,
    one per warp (:func:`balanced_pieces`), instead of even splits of each unit; None: by the rule beside
    :data:`AUTO_BALANCED` when that is on (the default), else even splits; ``balanced_warps``: the grid's warps
    (default one wave of the launch shape). Pages per run are read from device memory, so a graph stays valid as
    contexts grow. ``tail_merge``: where partials go through global memory, the last warp of each (sequence, KV
    head) merges them instead of a ``zip_merge`` launch (None: :data:`AUTO_TAIL_MERGE`, off). ``pdl``: launch the
    kernels as programmatic dependent launches (None: :data:`AUTO_PDL`)."""
    if num_qo_heads % num_kv_heads or not 1 <= num_qo_heads // num_kv_heads <= MAX_GROUP:
        raise ValueError(f"GQA group {num_qo_heads}/{num_kv_heads} unsupported by the CUDA kernel "
                         f"(need 1..{MAX_GROUP})")
    if head_dim not in _DEFAULTS:
        raise ValueError(f"the CUDA ZipFusion kernel takes head_dim {sorted(_DEFAULTS)}, got {head_dim}")
    if page_size != 16 or block_size != 512:
        raise ValueError(f"the CUDA ZipFusion kernel needs page_size 16 and block_size 512 (the 'mma' value order), "
                         f"got {page_size} and {block_size}")
    if version not in (1, 2):
        raise ValueError(f"unknown ZipFusion format version {version}")
    dflt = _DEFAULTS[head_dim]
    stage = dflt["stage"] if stage is None else stage
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {sorted(STAGES)}, got {stage}")
    launches = dflt["launches"][stage]
    if warps is not None or min_blocks is not None:
        launches = [(launches[0][0] if warps is None else warps, launches[0][1] if min_blocks is None else min_blocks)]
    warps, min_blocks = launches[0]
    waves = dflt["waves"] if waves is None else waves
    if not 1 <= warps <= 32 or min_blocks < 1 or (waves is not None and waves <= 0):
        raise ValueError(f"bad launch shape: warps {warps}, min_blocks {min_blocks}, waves {waves}")
    if load_hint not in LOAD_HINTS:
        raise ValueError(f"load_hint must be one of {sorted(LOAD_HINTS)}, got {load_hint}")
    dev = torch.device(device) if device is not None else kv_indices.device
    seqs = sequence_lengths(kv_indptr, kv_last_page_len, page_size)
    batch, max_pages = seqs.batch, seqs.max_pages
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
    hinted = None
    given_splits = num_splits
    if num_splits is None:
        if waves is None:  # the first launch shape, or a later one the wave model rates SHAPE_MARGIN faster
            units = batch * num_kv_heads
            num_splits = pick_splits(units, max_pages, sms * warps * min_blocks)
            best = split_cost(units, max_pages, sms * warps * min_blocks, num_splits)
            for w, mb in launches[1:]:
                s_ = pick_splits(units, max_pages, sms * w * mb)
                if split_cost(units, max_pages, sms * w * mb, s_) <= SHAPE_MARGIN * best:
                    num_splits, warps, min_blocks = s_, w, mb
                    best = split_cost(units, max_pages, sms * w * mb, s_)
        else:
            want = math.ceil(sms * warps * min_blocks * waves / max(1, batch * num_kv_heads))
            num_splits = max(1, min(want, math.ceil(max_pages / 8)))
        if splits_hint is not None and 1 <= splits_hint <= max_pages:
            units, resident = batch * num_kv_heads, sms * warps * min_blocks
            if split_cost(units, max_pages, resident, splits_hint) <= \
                    SPLITS_HINT_MARGIN * split_cost(units, max_pages, resident, num_splits):
                num_splits = hinted = splits_hint
    num_splits = max(1, min(num_splits, max_pages))
    pages_per_split = math.ceil(max_pages / num_splits)
    if num_splits != hinted:  # the fewest splits of that length; a hinted count is kept as is (its last may be empty)
        num_splits = math.ceil(max_pages / pages_per_split)
    merge_in_cta, split_shape = False, (warps, min_blocks)
    if cta_merge and not balanced and 2 <= num_splits <= max_cta_splits(head_dim, stage):
        # CTAs of num_splits warps, as many per SM as keep the requested warps per SM: used when that needs no
        # more waves than the requested shape (a CTA's splits then run side by side and merge on chip)
        per_sm = cta_blocks(warps, min_blocks, num_splits)
        units = batch * num_kv_heads
        if math.ceil(units / (sms * per_sm)) <= math.ceil(units * num_splits / (sms * warps * min_blocks)):
            merge_in_cta, warps, min_blocks = True, num_splits, per_sm
    total = int(seqs.indptr[-1]) * num_kv_heads  # balanced runs walk the page lists from indptr[0] == 0
    zero_based = int(seqs.indptr[0]) == 0
    if balanced and not zero_based:
        raise ValueError("balanced runs need a page table whose indptr starts at 0")
    if balanced is None:
        balanced = False
        if AUTO_BALANCED and waves is None and given_splits is None and zero_based and not merge_in_cta:
            even = split_cost(batch * num_kv_heads, max_pages, sms * warps * min_blocks, num_splits)
            for w, mb in launches:
                per, cost = balanced_run(total, sms * w * mb)
                if per >= BALANCED_MIN_PAGES and cost <= BALANCED_MARGIN * even:
                    balanced, warps, min_blocks, even = True, w, mb, cost
    if balanced:
        if merge_in_cta:  # a forced balanced plan: the launch shape, not the CTA merge's
            merge_in_cta, (warps, min_blocks) = False, split_shape
        grid_warps = balanced_warps or sms * warps * min_blocks
        if grid_warps < 1:
            raise ValueError(f"balanced_warps must be >= 1, got {balanced_warps}")
        pages_per_split = max(1, math.ceil(total / grid_warps))
        num_splits = math.ceil(max_pages / pages_per_split) + 1  # slots: the most pieces a unit can be cut into
    meta = torch.cat([seqs.kv_lens, torch.tensor([pages_per_split])]).to(torch.int32)  # one copy for both
    if buffers is None:
        indptr, indices, meta = (to_device(seqs.indptr, dev, torch.int32), to_device(kv_indices, dev, torch.int32),
                                 to_device(meta, dev))
    else:
        if buffers.batch != batch or buffers.device != dev:
            raise ValueError(f"plan buffers for batch {buffers.batch} on {buffers.device}, not {batch} on {dev}")
        nnz = kv_indices.numel()
        indices = buffers.page_ids(nnz)
        copy_into(indices[:nnz], kv_indices)
        indptr, meta = copy_into(buffers.indptr, seqs.indptr), copy_into(buffers.meta, meta)
    p = CudaDecodePlan(
        indptr=indptr, indices=indices, kv_lens=meta[:batch], split_pages=meta[batch:], batch=batch,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, version=version, num_splits=num_splits,
        pages_per_split=pages_per_split, warps=warps, min_blocks=min_blocks,
        sm_scale=head_dim ** -0.5 if sm_scale is None else sm_scale, load_hint=load_hint, cta_merge=merge_in_cta,
        stage=stage, buffers=buffers, balanced=bool(balanced), grid_warps=grid_warps if balanced else 0,
        pdl=AUTO_PDL if pdl is None else bool(pdl))
    if num_splits > 1 and not merge_in_cta:
        if buffers is not None:
            p.opart, p.lse = buffers.parts(num_qo_heads, num_splits, head_dim)
        else:
            p.opart = torch.empty(batch, num_qo_heads, num_splits, head_dim, dtype=torch.float32, device=dev)
            p.lse = torch.empty(batch, num_qo_heads, num_splits, dtype=torch.float32, device=dev)
        if AUTO_TAIL_MERGE if tail_merge is None else tail_merge:
            p.tail_merge = True
            p.arrive = (buffers.arrivals(num_kv_heads) if buffers is not None else
                        torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=dev))
    return p


def check_tables(p: CudaDecodePlan, pool: torch.Tensor, group_start: torch.Tensor, group_desc: torch.Tensor) -> None:
    """Refuse storage tables that do not match the plan (shapes, dtypes, alignment, reach)."""
    nb = p.head_dim // 32
    if pool.dtype != torch.uint8 or pool.dim() != 1 or pool.numel() % 16 or not pool.is_contiguous():
        raise ValueError("pool must be a contiguous 1-D uint8 tensor, its length a multiple of 16")
    if group_start.dtype != torch.int64 or group_start.shape[1:] != (p.num_kv_heads, 2):
        raise ValueError(f"group_start must be int64 [num_pages, {p.num_kv_heads}, 2]")
    if group_desc.dtype != torch.uint8 or group_desc.shape != (*group_start.shape, nb):
        raise ValueError(f"group_desc must be uint8 [num_pages, {p.num_kv_heads}, 2, {nb}]")
    if not (group_start.is_contiguous() and group_desc.is_contiguous()):
        raise ValueError("group tables must be contiguous")


def run(p: CudaDecodePlan, q: torch.Tensor, pool: torch.Tensor, group_start: torch.Tensor, group_desc: torch.Tensor,
        out: torch.Tensor | None = None, check: bool = False) -> torch.Tensor:
    """Decode attention of one layer over "mma"-ordered compressed pages; q [B, Hq, D] bf16 -> [B, Hq, D] bf16."""
    if q.shape != (p.batch, p.num_qo_heads, p.head_dim) or q.dtype != torch.bfloat16 or not q.is_contiguous():
        raise ValueError(f"q must be contiguous bf16 [{p.batch}, {p.num_qo_heads}, {p.head_dim}], got "
                         f"{q.dtype} {tuple(q.shape)}")
    if pool.numel() > MAX_POOL_BYTES:  # always checked: past it, starts would wrap and read the wrong bytes
        raise ValueError(f"the CUDA ZipFusion kernel addresses pools up to {MAX_POOL_BYTES >> 30} GiB "
                         f"(group starts as 32-bit counts of 16-byte units); this pool has {pool.numel() >> 30} GiB")
    if check:
        check_tables(p, pool, group_start, group_desc)
    out = torch.empty_like(q) if out is None else out
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    launch(p, kernels(dev, p.head_dim, p.version, p.warps, p.min_blocks, p.load_hint, p.cta_merge, p.stage,
                      p.balanced, p.tail_merge), q, pool, group_start, group_desc, out)
    return out


def launch(p: CudaDecodePlan, k: dict[str, cuda_jit.Kernel], q: torch.Tensor, pool: torch.Tensor,
           group_start: torch.Tensor, group_desc: torch.Tensor, out: torch.Tensor,
           clock: torch.Tensor | None = None) -> None:
    """Launch ``k`` (zip_decode and zip_merge built for ``p``'s launch shape; :func:`run` takes them from
    :func:`kernels`, an A/B bench from other sources or defines) with no checks. ``clock``: for a build with
    ``WARP_CLOCK=1`` (cuda/zip_decode.cu), int64 [grid warps, 4] that its warps write their clocks into."""
    split = (p.num_splits > 1 and not p.cta_merge) or p.balanced
    grid = (math.ceil((p.grid_warps if p.balanced else p.batch * p.num_kv_heads * p.num_splits) / p.warps), 1, 1)
    k["zip_decode"].launch(grid, 32 * p.warps, [
        q, out, p.opart if split else out, p.lse if split else out, p.indptr, p.indices, p.kv_lens, pool,
        group_start, group_desc, float(p.sm_scale * LOG2E), p.split_pages, p.num_splits, p.num_kv_heads,
        p.group, p.batch, clock if clock is not None else p.arrive if p.tail_merge else p.kv_lens],
        smem=smem_bytes(p.head_dim, p.warps, p.stage), pdl=p.pdl)
    if p.tail_merge:  # merged by each unit's last warp
        return
    if p.balanced:
        k["zip_merge_balanced"].launch((p.batch, p.num_qo_heads, 1), p.head_dim, [
            p.opart, p.lse, out, p.indptr, p.split_pages, p.num_splits, p.num_qo_heads, p.group], pdl=p.pdl)
    elif split:
        k["zip_merge"].launch((p.batch, p.num_qo_heads, 1), p.head_dim, [
            p.opart, p.lse, out, p.kv_lens, p.split_pages, p.num_splits, p.num_qo_heads], pdl=p.pdl)


def raw_pool(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Control input: stored-order groups [P, Hkv, 2, 16 * D] bf16 laid out uncompressed (every block raw), as
    (pool, group_start, group_desc); the same kernel over it measures the kernel without the format."""
    p, hkv, _, n = groups.shape
    pool = groups.contiguous().view(torch.uint8).reshape(-1)
    starts = torch.arange(p * hkv * 2, device=groups.device, dtype=torch.int64).view(p, hkv, 2) * (2 * n)
    desc = torch.full((p, hkv, 2, n // 512), 0xFF, dtype=torch.uint8, device=groups.device)
    return pool, starts, desc


__all__ = ["CudaDecodePlan", "PlanBuffers", "graph_key", "plan", "run", "check_tables", "raw_pool", "unsupported",
           "shape_unsupported", "store_unsupported"]
