"""Triton kernels that store new tokens' K/V into a paged cache: ONE launch per layer instead of the references'
index / add / stack / index_put chain (each a kernel launch on a GPU; per layer per step, that chain adds up).

* :func:`write_paged`: the dense NHD cache [num_pages, 2, page_size, kv_heads, head_dim] (FlashInfer's layout);
  reference :func:`kvtide.kernels.paged_attention_ref.write_kv`.
* :func:`write_pool`: raw groups of a compressed byte pool, one group per (page, kv_head, K|V) at a byte offset from
  a table, values permuted by an optional stored-position table; reference ``ZipPagedKV.write``'s torch path.

One program per (token, kv_head): it loads the head_dim row of k and of v, converts it to the cache's 16-bit type
the way torch's ``.to(dtype)`` does on the same device (bit for bit, NaN included: see :func:`_bits`) and stores
it. The wrappers check shapes and dtypes on the host only: a launch never syncs with the device (it runs once
per layer per step, possibly inside a CUDA graph). Slots are not checked (that would read them back): each must
be a valid page * page_size + offset. Kernels are built on first use, so setting ``TRITON_INTERPRET=1`` any time
before the first call runs them in the interpreter (CPU tensors).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from .interpret import triton_interpret

CACHE_DTYPES = (torch.bfloat16, torch.float16)
CUDA_BF16_NAN = 0x7FFF  # cvt.rn.bf16.f32 (torch's float -> bfloat16 on sm80+) gives the canonical NaN


def _bits(x, OUT_BF16: tl.constexpr, NAN_BITS: tl.constexpr):
    """int16 bits of ``x`` (any float type) converted to bf16 (OUT_BF16) or fp16 exactly as torch's ``.to``.

    Explicit integer rounding for bf16 rather than ``x.to(tl.bfloat16)``: the interpreter's cast truncates, so the
    CPU tests would check something other than what the GPU runs. Round-to-nearest-even on the bits is the conversion's
    definition for every non-NaN value; NaN becomes the device's torch NaN (``NAN_BITS``). fp16 goes through the
    native cast (numpy's on the interpreter, ``cvt.rn`` on the GPU: both what torch does there, once a signalling
    NaN is quieted). float64 goes through float32 first, as torch does (its 16-bit types convert from float only)."""
    if OUT_BF16 and x.dtype == tl.bfloat16:
        return x.to(tl.int16, bitcast=True)
    if (not OUT_BF16) and x.dtype == tl.float16:
        return x.to(tl.int16, bitcast=True)
    if x.dtype == tl.bfloat16:  # exact widening: the bits shifted into a float32's top half
        x = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    x = x.to(tl.float32)
    if OUT_BF16:
        u = x.to(tl.uint32, bitcast=True)
        mag = u & 0x7FFFFFFF  # round the magnitude (no uint32 overflow), then put the sign back
        r = ((mag + 0x7FFF + ((mag >> 16) & 1)) >> 16) | ((u >> 16) & 0x8000)
        r = tl.where(mag > 0x7F800000, NAN_BITS, r)
        return r.to(tl.uint16).to(tl.int16, bitcast=True)
    u = x.to(tl.uint32, bitcast=True)  # quiet a signalling NaN first, as torch does (numpy's cast would not)
    x = tl.where((u & 0x7FFFFFFF) > 0x7F800000, u | 0x400000, u).to(tl.float32, bitcast=True)
    return x.to(tl.float16).to(tl.int16, bitcast=True)


def _paged_kernel(cache_ptr, k_ptr, v_ptr, slot_ptr, skt, skh, skd, svt, svh, svd,
                  HEADS: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  OUT_BF16: tl.constexpr, NAN_BITS: tl.constexpr):
    """Token t = program 0, head h = program 1: cache (int16 view) rows [page, 0|1, off, h, :] = k|v[t, h, :]."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    slot = tl.load(slot_ptr + t)
    page, off = slot // PAGE, slot % PAGE
    k_row = (page * (2 * PAGE) + off) * HEADS + h  # row of [*, head_dim]; V's is PAGE * HEADS rows further
    kb = _bits(tl.load(k_ptr + t * skt + h * skh + d * skd, mask=m), OUT_BF16, NAN_BITS)
    vb = _bits(tl.load(v_ptr + t * svt + h * svh + d * svd, mask=m), OUT_BF16, NAN_BITS)
    tl.store(cache_ptr + k_row * D + d, kb, mask=m)
    tl.store(cache_ptr + (k_row + PAGE * HEADS) * D + d, vb, mask=m)


def _pool_kernel(pool_ptr, start_ptr, pos_ptr, k_ptr, v_ptr, slot_ptr, skt, skh, skd, svt, svh, svd,
                 HEADS: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 IDENTITY: tl.constexpr, NAN_BITS: tl.constexpr):
    """Token t, head h: pool16[start[page, h, 0|1] / 2 + pos[0|1, off * D + d]] = bf16 bits of k|v[t, h, d]."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    slot = tl.load(slot_ptr + t)
    page, off = slot // PAGE, slot % PAGE
    g = (page * HEADS + h) * 2
    k_base = tl.load(start_ptr + g) // 2
    v_base = tl.load(start_ptr + g + 1) // 2
    nat = off * D + d  # natural value index within the group
    if IDENTITY:
        k_pos = nat
        v_pos = nat
    else:
        k_pos = tl.load(pos_ptr + nat, mask=m)
        v_pos = tl.load(pos_ptr + PAGE * D + nat, mask=m)
    kb = _bits(tl.load(k_ptr + t * skt + h * skh + d * skd, mask=m), True, NAN_BITS)
    vb = _bits(tl.load(v_ptr + t * svt + h * svh + d * svd, mask=m), True, NAN_BITS)
    tl.store(pool_ptr + k_base + k_pos, kb, mask=m)
    tl.store(pool_ptr + v_base + v_pos, vb, mask=m)


_PY_BITS = _bits


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    """JIT on first use, once the TRITON_INTERPRET setting is final (triton reads it at decoration); the helper the
    kernels call is a module global, so it is replaced by its jitted self first."""
    global _bits
    _bits = triton.jit(_PY_BITS)
    return SimpleNamespace(paged=triton.jit(_paged_kernel), pool=triton.jit(_pool_kernel))


def _get_kernels(device: torch.device) -> SimpleNamespace:
    interpret = triton_interpret()
    if device.type != "cuda" and not interpret:
        raise RuntimeError("Triton KV-write kernels need CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
    return _kernels(interpret)


@functools.cache
def _nan_bits(device_type: str, src: torch.dtype) -> int:
    """The bf16 bits torch's ``.to(torch.bfloat16)`` gives a NaN of dtype ``src`` on this kind of device. CUDA: the
    canonical NaN of ``cvt.rn.bf16.f32``, every source going through float (no probe there: it would sync, maybe
    inside a graph capture). CPU: asked once per source dtype, since torch's CPU paths differ (float32 and float64
    give 0xFFFF through the vectorized conversion, float16 gives 0x7FC0 through the scalar one)."""
    if device_type == "cuda" or src == torch.bfloat16:  # bf16 -> bf16 is a copy, NAN_BITS unused
        return CUDA_BF16_NAN
    return int(torch.full((64,), float("nan"), dtype=src).to(torch.bfloat16).view(torch.int16)[0]) & 0xFFFF


def _check_kv(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, device: torch.device) -> None:
    if k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"k and v must be [T, kv_heads, head_dim], got shapes {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v differ in shape: {tuple(k.shape)} vs {tuple(v.shape)}")
    if not k.dtype.is_floating_point or k.dtype != v.dtype:
        raise ValueError(f"k and v must share one floating-point dtype, got {k.dtype} and {v.dtype}")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    if slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"slot_mapping must be [T] with T = {k.shape[0]} tokens, got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.stride(0) != 1 and slot_mapping.numel() > 1:
        raise ValueError("slot_mapping must be contiguous")
    for name, t in (("k", k), ("v", v), ("slot_mapping", slot_mapping)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the cache on {device}")


def _launch(kernel, dest_args: tuple, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
            **constexprs) -> None:
    t, heads, d = k.shape
    if t == 0:
        return
    block_d = triton.next_power_of_2(d)
    kernel[(t, heads)](*dest_args, k, v, slot_mapping, *k.stride(), *v.stride(), HEADS=heads, D=d, BLOCK_D=block_d,
                       NAN_BITS=_nan_bits(k.device.type, k.dtype), num_warps=max(1, min(4, block_d // 128)), **constexprs)


def write_paged(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new tokens' K/V ([T, kv_heads, head_dim], any float dtype) into the dense NHD cache ``kv_cache``
    [num_pages, 2, page_size, kv_heads, head_dim] (bf16 or fp16); slot_mapping[t] = page * page_size + offset.
    Same effect as :func:`kvtide.kernels.paged_attention_ref.write_kv`, in one launch."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [num_pages, 2, page_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    if kv_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache must be bfloat16 or float16, got {kv_cache.dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    _check_kv(k, v, slot_mapping, kv_cache.device)
    if tuple(k.shape[1:]) != tuple(kv_cache.shape[3:]):
        raise ValueError(f"k/v heads x head_dim {tuple(k.shape[1:])} differ from the cache's {tuple(kv_cache.shape[3:])}")
    _launch(_get_kernels(kv_cache.device).paged, (kv_cache.view(torch.int16),), k, v, slot_mapping,
            PAGE=kv_cache.shape[2], OUT_BF16=kv_cache.dtype == torch.bfloat16)


def write_pool(pool16: torch.Tensor, group_start: torch.Tensor, stored_pos: torch.Tensor | None, k: torch.Tensor,
               v: torch.Tensor, slot_mapping: torch.Tensor, page_size: int) -> None:
    """Store new tokens' K/V ([T, kv_heads, head_dim], any float dtype) as bf16 into raw groups of a byte pool.

    ``pool16``: the pool's int16 view (1-D). ``group_start``: one layer's int64 [num_page_ids, kv_heads, 2] byte
    offsets of the groups (K at 0, V at 1; even). ``stored_pos``: int64 [2, page_size * head_dim], the stored
    position of natural value token * head_dim + dim in a K (row 0) or V (row 1) group, or None for the identity.
    Same bytes as ``ZipPagedKV.write``'s torch path (:mod:`kvtide.cache.zip_pages`), in one launch."""
    if pool16.dim() != 1 or pool16.dtype != torch.int16:
        raise ValueError(f"pool16 must be the pool's 1-D int16 view, got {pool16.dtype} of shape {tuple(pool16.shape)}")
    if pool16.stride(0) != 1:
        raise ValueError("pool16 must be contiguous")
    _check_kv(k, v, slot_mapping, pool16.device)
    t, heads, d = k.shape
    if group_start.dtype != torch.int64 or group_start.dim() != 3 or tuple(group_start.shape[1:]) != (heads, 2):
        raise ValueError(f"group_start must be int64 [num_page_ids, {heads}, 2] (one layer's table), got "
                         f"{group_start.dtype} of shape {tuple(group_start.shape)}")
    if not group_start.is_contiguous():
        raise ValueError("group_start must be contiguous")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if stored_pos is not None:
        if stored_pos.dtype != torch.int64 or tuple(stored_pos.shape) != (2, page_size * d):
            raise ValueError(f"stored_pos must be int64 [2, page_size * head_dim] = [2, {page_size * d}], got "
                             f"{stored_pos.dtype} of shape {tuple(stored_pos.shape)}")
        if not stored_pos.is_contiguous():
            raise ValueError("stored_pos must be contiguous")
    for name, x in (("group_start", group_start), ("stored_pos", stored_pos)):
        if x is not None and x.device != pool16.device:
            raise ValueError(f"{name} is on {x.device}, the pool on {pool16.device}")
    pos = group_start if stored_pos is None else stored_pos  # any pointer when unused
    _launch(_get_kernels(pool16.device).pool, (pool16, group_start, pos), k, v, slot_mapping,
            PAGE=page_size, IDENTITY=stored_pos is None)
