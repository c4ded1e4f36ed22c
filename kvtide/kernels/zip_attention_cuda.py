"""CUDA paged DECODE attention over ZipFusion pages in the "mma" value order (the ZipFusion paper's kernel design).

Why CUDA next to the Triton kernel (:mod:`kvtide.kernels.zip_attention`): Triton gives no way to rebuild values
straight into tensor-core (MMA) operand fragments, so its kernel moves every rebuilt value through shared memory.
Here each lane loads exactly the bytes of its own fragment values (:mod:`kvtide.cache.zip_order`, "mma") and
rebuilds them in registers (~1.5 integer ops per value); no decompressed value leaves a register.

Kernel (``cuda/zip_decode.cu``): one warp per (sequence, KV head, split), one page of 16 tokens per step,
S^T = K Q^T and O^T += V^T P^T on ``mma.m16n8k16``, online softmax in base 2. A split sequence's partials merge in
one CTA (:attr:`LaunchOptions.cta_merge`), through the ``zip_merge`` launch, or, for balanced runs of all units'
pages (:attr:`LaunchOptions.balanced`), through ``zip_merge_balanced``. Raw blocks are read as they are, so the
same kernel over an all-raw pool (:func:`raw_pool`) is the format-free control. Design: docs/design/kernel.md.

Compiled by NVRTC (:mod:`kvtide.kernels.cuda_jit`) in :func:`build` (the engine's backend calls it when made), else
at first use; :func:`plan` once per batch, :func:`run` per layer. Torch reference:
:mod:`kvtide.kernels.zip_attention_ref` with ``zip_order.to_natural``.
"""

from __future__ import annotations

import functools
import math
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
SPLIT_START_PAGES = 4  # a split's fixed cost (Q and metadata loads, first page's latency, merge) in pages
STAGES = {0: "K and V in registers", 1: "V staged in shared memory (cp.async)"}

# Launch defaults per head_dim: the stage, and per stage the launch shapes (warps per CTA, CTAs per SM the register
# budget is cut for) the wave model chooses from. Staging V at head_dim 128 brings the kernel to 128 registers, so
# 16 warps fit an SM next to the register kernel's 12.
_DEFAULTS = {128: dict(launches={0: [(4, 3)], 1: [(4, 3), (4, 4)]}, stage=1),
             64: dict(launches={0: [(4, 4)], 1: [(4, 4)]}, stage=0)}
SHAPE_MARGIN = 0.85  # a later launch shape is taken only when the wave model rates it at most this x the first
SPLITS_HINT_MARGIN = 1.10  # plan(splits_hint=): kept while the wave model rates it at most this x its own choice
# Balanced runs (LaunchOptions.balanced=None): taken where even splits would merge through global memory anyway (no
# CTA merge), the wave model rates the runs at most BALANCED_MARGIN x the even splits, and each warp's run holds at
# least BALANCED_MIN_PAGES pages; where even splits merge in a CTA, or runs are short, even splits are faster.
AUTO_BALANCED = True
BALANCED_MARGIN = 0.92
BALANCED_MIN_PAGES = 64


@dataclass(frozen=True)
class LaunchOptions:
    """How :func:`plan` lays out one decode batch; the defaults are what the engine runs.

    ``num_splits``: splits per (sequence, KV head); None: the wave model (:func:`pick_splits`), or with ``waves``
    set, enough splits for B * Hkv * splits warps to fill that many waves (at least 8 pages per split).
    ``warps`` / ``min_blocks``: the launch shape (warps per CTA, CTAs per SM of the register budget); None: the
    stage's first shape, or a later one the wave model rates :data:`SHAPE_MARGIN` x its time or less.
    ``cta_merge``: where a sequence splits into 2 to :func:`max_cta_splits` parts and CTAs of that many warps need
    no more waves, launch those and merge on chip. ``stage``: where the next page's groups wait (:data:`STAGES`;
    None: the head_dim's default). ``balanced``: cut all units' pages, laid end to end, into equal runs, one per
    warp (:func:`balanced_pieces`); None: the rule beside :data:`AUTO_BALANCED`. ``balanced_warps``: the grid's
    warps for balanced runs (None or 0: one wave of the launch shape)."""

    num_splits: int | None = None
    warps: int | None = None
    min_blocks: int | None = None
    waves: float | None = None
    cta_merge: bool = True
    stage: int | None = None
    balanced: bool | None = None
    balanced_warps: int | None = None


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
             page_size, block_size=block_size, options=LaunchOptions(num_splits=1), device="cpu")
    except ValueError as e:
        return str(e)
    return None


@functools.cache
def kernels(device: int, head_dim: int, version: int, warps: int, min_blocks: int, cta_merge: bool = False,
            stage: int = 0, balanced: bool = False) -> dict[str, cuda_jit.Kernel]:
    """zip_decode, zip_merge and zip_merge_balanced built for one launch shape on ``device`` (cached)."""
    return build_source(SOURCE.read_text(), device, defines(head_dim, version, warps, min_blocks, cta_merge, stage,
                                                             balanced))


def defines(head_dim: int, version: int, warps: int, min_blocks: int, cta_merge: bool = False, stage: int = 0,
            balanced: bool = False) -> dict[str, int]:
    """The compile-time constants of one launch shape (cuda/zip_decode.cu's -D list)."""
    if balanced and cta_merge:
        raise ValueError("balanced runs merge through global memory: they cannot be merged in a CTA")
    return dict(HEAD_DIM=head_dim, VERSION=version, NWARPS=warps, MIN_BLOCKS=min_blocks, CTA_MERGE=int(cta_merge),
                STAGE=stage, BALANCED=int(balanced))


def smem_bytes(head_dim: int, warps: int, stage: int) -> int:
    """Dynamic shared memory of a CTA (cuda/zip_decode.cu WARP_SMEM): per warp at stage 1 a slot of one group
    (16 x head_dim bf16) for V and Q's B fragments (16 x head_dim bytes); none at stage 0."""
    return 0 if stage == 0 else warps * (32 * head_dim + 16 * head_dim)


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
    step (a first-use JIT build inside a step stalls that step for seconds)."""
    from concurrent.futures import ThreadPoolExecutor

    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    launches = default_launches(head_dim)
    with ThreadPoolExecutor(max_workers=min(8, len(launches))) as ex:
        stage = default_stage(head_dim)
        for f in [ex.submit(kernels, index, head_dim, version, w, mb, cm, stage, bal) for w, mb, cm, bal in launches]:
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

    def page_ids(self, nnz: int) -> torch.Tensor:
        """The page-id buffer, at least ``nnz`` long."""
        if self.indices.numel() < nnz:
            self.indices = torch.zeros(1 << max(10, math.ceil(math.log2(nnz * 1.25))), dtype=torch.int32,
                                       device=self.device)
            self.generation += 1
        return self.indices

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
    stage: int = 0  # where the next page's groups wait: 0 registers, 1 V in shared memory (STAGE)
    cta_merge: bool = False  # one CTA per (sequence, KV head), its warps the splits, merged in shared memory
    # balanced runs (BALANCED): grid_warps warps, each pages_per_split pages of all units laid end to end;
    # num_splits is then the partial slots per unit (the most pieces a unit can be cut into)
    balanced: bool = False
    grid_warps: int = 0
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
            p.stage, p.cta_merge, p.balanced, p.grid_warps, float(p.sm_scale), id(p.buffers), p.buffers.generation)


def plan(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, num_qo_heads: int,
         num_kv_heads: int, head_dim: int, page_size: int = 16, *, block_size: int = 512, version: int = 1,
         sm_scale: float | None = None, device: torch.device | str | None = None,
         options: LaunchOptions | None = None, buffers: PlanBuffers | None = None,
         splits_hint: int | None = None) -> CudaDecodePlan:
    """Plan one decode batch (FlashInfer-style page table); host work happens here, not per layer.

    ``options``: the launch layout (:class:`LaunchOptions`; None: its defaults). ``buffers``: write the device
    arrays into these fixed buffers (same batch size) instead of new tensors, for replay in a captured graph
    (:func:`graph_key`). ``splits_hint``: a split count to keep (a captured graph's) where the wave model rates it
    within :data:`SPLITS_HINT_MARGIN` of its own choice; small batches' best count moves with every few pages of
    context, and each move would cost a graph capture. Pages per split and per balanced run are read from device
    memory, so a graph stays valid as contexts grow."""
    o = LaunchOptions() if options is None else options
    num_splits, warps, min_blocks, waves, stage = o.num_splits, o.warps, o.min_blocks, o.waves, o.stage
    cta_merge, balanced, balanced_warps = o.cta_merge, o.balanced, o.balanced_warps
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
    if not 1 <= warps <= 32 or min_blocks < 1 or (waves is not None and waves <= 0):
        raise ValueError(f"bad launch shape: warps {warps}, min_blocks {min_blocks}, waves {waves}")
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
        sm_scale=head_dim ** -0.5 if sm_scale is None else sm_scale, cta_merge=merge_in_cta,
        stage=stage, buffers=buffers, balanced=bool(balanced), grid_warps=grid_warps if balanced else 0)
    if num_splits > 1 and not merge_in_cta:
        if buffers is not None:
            p.opart, p.lse = buffers.parts(num_qo_heads, num_splits, head_dim)
        else:
            p.opart = torch.empty(batch, num_qo_heads, num_splits, head_dim, dtype=torch.float32, device=dev)
            p.lse = torch.empty(batch, num_qo_heads, num_splits, dtype=torch.float32, device=dev)
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
    launch(p, kernels(dev, p.head_dim, p.version, p.warps, p.min_blocks, p.cta_merge, p.stage, p.balanced), q, pool,
           group_start, group_desc, out)
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
        p.group, p.batch, clock if clock is not None else p.kv_lens], smem=smem_bytes(p.head_dim, p.warps, p.stage))
    if p.balanced:
        k["zip_merge_balanced"].launch((p.batch, p.num_qo_heads, 1), p.head_dim, [
            p.opart, p.lse, out, p.indptr, p.split_pages, p.num_splits, p.num_qo_heads, p.group])
    elif split:
        k["zip_merge"].launch((p.batch, p.num_qo_heads, 1), p.head_dim, [
            p.opart, p.lse, out, p.kv_lens, p.split_pages, p.num_splits, p.num_qo_heads])


def raw_pool(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Control input: stored-order groups [P, Hkv, 2, 16 * D] bf16 laid out uncompressed (every block raw), as
    (pool, group_start, group_desc); the same kernel over it measures the kernel without the format."""
    p, hkv, _, n = groups.shape
    pool = groups.contiguous().view(torch.uint8).reshape(-1)
    starts = torch.arange(p * hkv * 2, device=groups.device, dtype=torch.int64).view(p, hkv, 2) * (2 * n)
    desc = torch.full((p, hkv, 2, n // 512), 0xFF, dtype=torch.uint8, device=groups.device)
    return pool, starts, desc


__all__ = ["CudaDecodePlan", "LaunchOptions", "PlanBuffers", "graph_key", "plan", "run", "check_tables", "raw_pool", "unsupported",
           "shape_unsupported", "store_unsupported"]
