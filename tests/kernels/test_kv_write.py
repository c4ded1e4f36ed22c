"""Triton KV writes == their torch references, bit for bit (interpreter on CPU): the dense NHD cache against
``paged_attention_ref.write_kv``, the compressed pool against ``ZipPagedKV.write``'s torch path. Whole caches and
pools are compared, so bytes a write must not touch are checked too; values include NaN, infinities, -0.0,
denormals and round-to-nearest-even ties."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first kernel launch (kernels are built lazily)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kvtide.cache import zip_order  # noqa: E402
from kvtide.cache.zip_pages import ZipGeometry, ZipPagedKV  # noqa: E402
from kvtide.engine.pool_kernels import triton_pool_kernels  # noqa: E402
from kvtide.kernels import kv_write  # noqa: E402
from kvtide.kernels.paged_attention_ref import write_kv  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter's float32 -> float16 cast (numpy's) warns on overflow to inf, which is what the values ask for.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

# float32 bit patterns the conversion must get right: NaNs (signs, a payload), infinities, zeros, denormals,
# bf16 ties (even below / odd below), just off ties, the largest floats (bf16: round up to inf), fp16's edges.
SPECIAL_BITS = [
    0x7FC00000, 0xFFC00000, 0x7FC12345, 0x7F800000, 0xFF800000, 0x80000000, 0x00000000,
    0x00000001, 0x80000001, 0x007FFFFF, 0x00408000, 0x80418000, 0x00010000,
    0x3F808000, 0x3F818000, 0xBF808000, 0x3F808001, 0x3F807FFF, 0x7F7FFFFF, 0xFF7F8000, 0x7F7F7FFF,
    0x477FE000, 0x477FF000, 0x477FEFFF, 0x33800000, 0x33000000, 0x387FE000,
]
SPECIAL = torch.tensor(SPECIAL_BITS, dtype=torch.int64).to(torch.int32).view(torch.float32)
BF16_NAN_PAYLOADS = torch.tensor([0x7FC1, 0xFF81 - 0x10000, 0x7F81], dtype=torch.int16)  # kept by a bf16 copy


def stress(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values over a wide exponent range, with the special values scattered in (as float32, then cast)."""
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-30, 30, shape, generator=gen).float())
    flat = x.view(-1)
    n = min(flat.numel(), len(SPECIAL))
    flat[torch.randperm(flat.numel(), generator=gen)[:n]] = SPECIAL[:n]
    x = x.to(dtype)
    if dtype == torch.float64:  # float64 -> 16 bits rounds twice in torch (through float32): 1.0, not 1 + 2^-7
        x.view(-1)[-2:] = torch.tensor([1 + 2**-8 + 2**-30, -(2**-130 + 2**-160)], dtype=torch.float64)
    if dtype == torch.bfloat16 and x.numel() > 16:
        x.view(-1).view(torch.int16)[-3:] = BF16_NAN_PAYLOADS
    return x.to(DEV)


def slots_for(t: int, page_size: int, num_pages: int, gen: torch.Generator) -> torch.Tensor:
    """T distinct slots on a few scattered pages: several tokens per page, pages out of order."""
    pages = torch.randperm(num_pages, generator=gen)[: -(-t // page_size) + 1]
    cand = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    return cand[torch.randperm(cand.numel(), generator=gen)[:t]].to(DEV)


# (head_dim, kv_heads, T, page_size): every head_dim x kv_heads x T value appears, not their whole product
SHAPES = [(64, 1, 1, 16), (64, 2, 5, 16), (64, 8, 37, 16), (128, 1, 37, 16), (128, 2, 1, 16), (128, 8, 5, 16)]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,h,t,ps", SHAPES)
def test_write_paged_matches_write_kv(d, h, t, ps, cache_dtype, kv_dtype):
    gen = torch.Generator().manual_seed(d + h + t)
    num_pages = 6
    cache = torch.randn(num_pages, 2, ps, h, d, generator=gen).to(cache_dtype).to(DEV)
    ref = cache.clone()
    k, v = stress((t, h, d), kv_dtype, gen), stress((t, h, d), kv_dtype, gen)
    slots = slots_for(t, ps, num_pages, gen)
    write_kv(ref, k, v, slots)
    kv_write.write_paged(cache, k, v, slots)
    assert torch.equal(cache.view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float64])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_write_paged_other_input_dtypes_odd_shape_and_strided_inputs(cache_dtype, kv_dtype):
    """float16/float64 inputs, a head_dim that is no power of two, a page of 8, k and v views of a fused qkv."""
    gen = torch.Generator().manual_seed(5)
    d, h, t, ps, num_pages = 96, 2, 11, 8, 5
    cache = torch.randn(num_pages, 2, ps, h, d, generator=gen).to(cache_dtype).to(DEV)
    ref = cache.clone()
    qkv = stress((t, 4 * h * d), kv_dtype, gen)
    k, v = qkv[:, 2 * h * d: 3 * h * d].view(t, h, d), qkv[:, 3 * h * d:].view(t, h, d)
    assert not k.is_contiguous()
    slots = slots_for(t, ps, num_pages, gen)
    write_kv(ref, k, v, slots)
    kv_write.write_paged(cache, k, v, slots)
    assert torch.equal(cache.view(torch.int16), ref.view(torch.int16))
    kv_write.write_paged(cache, k[:0], v[:0], slots[:0])  # no tokens: nothing launched, nothing changed
    assert torch.equal(cache.view(torch.int16), ref.view(torch.int16))


def _store(d: int, h: int, order: str) -> ZipPagedKV:
    """A two-layer CPU-sized store whose pool holds random bytes: a write must change exactly its values."""
    geo = ZipGeometry(num_layers=2, num_kv_heads=h, head_dim=d, page_size=16, value_order=order)
    store = ZipPagedKV(geo, budget_bytes=12 * geo.raw_page_bytes, device=DEV, kernels=triton_pool_kernels())
    assert store.fused_write == (DEV == "cuda")
    store.alloc_pages([5, 0, 3, 7, 2])  # out of order: the groups' starts do not follow the page ids
    gen = torch.Generator().manual_seed(11)
    store.pool.copy_(torch.randint(0, 256, store.pool.shape, dtype=torch.uint8, generator=gen))
    return store


def _pool_after(store: ZipPagedKV, start: torch.Tensor, fused: bool, layer: int, k, v, slots, rows=None):
    store.pool.copy_(start)
    store.fused_write = fused
    store.write(layer, k, v, slots, rows)
    return store.pool.clone()


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", ["token", "mma"])
@pytest.mark.parametrize("d,h,t", [s[:3] for s in SHAPES])
def test_write_pool_matches_store_torch_path(d, h, t, order, kv_dtype):
    store = _store(d, h, order)
    gen = torch.Generator().manual_seed(d * h + t)
    k, v = stress((t, h, d), kv_dtype, gen), stress((t, h, d), kv_dtype, gen)
    cand = (torch.tensor([3, 7, 0])[:, None] * 16 + torch.arange(16)).reshape(-1)  # scattered, allocated pages
    slots = cand[torch.randperm(cand.numel(), generator=gen)[:t]].to(DEV)
    start = store.pool.clone()
    ref = _pool_after(store, start, False, 1, k, v, slots)
    got = _pool_after(store, start, True, 1, k, v, slots, store.write_rows(slots))  # rows: ignored when fused
    assert not torch.equal(ref, start)
    assert torch.equal(got, ref)


def test_write_pool_direct_call_identity_none_and_strided_inputs():
    """stored_pos None == the identity table; float16 / float64 inputs; head_dim 96; k, v views of a fused qkv."""
    d, h, t = 96, 2, 9
    store = _store(d, h, "token")
    gen = torch.Generator().manual_seed(2)
    slots = torch.tensor([0, 1, 2, 3 * 16 + 15, 3 * 16, 7 * 16 + 4, 7 * 16 + 5, 2 * 16 + 8, 5 * 16 + 1], device=DEV)
    start = store.pool.clone()
    ident = zip_order.natural_to_stored("token", 16, d, DEV)
    for dtype in (torch.float16, torch.float64):
        qkv = stress((t, 3 * h * d), dtype, gen)
        k, v = qkv[:, h * d: 2 * h * d].view(t, h, d), qkv[:, 2 * h * d:].view(t, h, d)
        ref = _pool_after(store, start, False, 0, k, v, slots)
        for pos in (None, ident):
            store.pool.copy_(start)
            kv_write.write_pool(store.pool.view(torch.int16), store.group_start[0], pos, k, v, slots, 16)
            assert torch.equal(store.pool, ref)


@pytest.mark.skipif(DEV != "cuda", reason="host syncs are a CUDA matter")
def test_writes_make_no_host_sync_on_cuda():
    store = _store(128, 8, "mma")
    cache = torch.zeros(6, 2, 16, 8, 128, dtype=torch.bfloat16, device=DEV)
    gen = torch.Generator().manual_seed(0)
    k, v = stress((5, 8, 128), torch.bfloat16, gen), stress((5, 8, 128), torch.bfloat16, gen)
    slots = torch.tensor([0, 17, 35, 50, 51], device=DEV)
    kv_write.write_paged(cache, k, v, slots)  # compile outside the checked region
    store.write(0, k, v, slots)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kv_write.write_paged(cache, k, v, slots)
        store.write(1, k, v, slots)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def _paged_args(**kw):
    h, d, t = 2, 64, 3
    args = dict(kv_cache=torch.zeros(4, 2, 16, h, d, dtype=torch.bfloat16), k=torch.zeros(t, h, d),
                v=torch.zeros(t, h, d), slot_mapping=torch.arange(t))
    args.update(kw)
    return args


def _pool_args(**kw):
    h, d, t = 2, 64, 3
    args = dict(pool16=torch.zeros(4096, dtype=torch.int16), group_start=torch.zeros(4, h, 2, dtype=torch.int64),
                stored_pos=None, k=torch.zeros(t, h, d), v=torch.zeros(t, h, d), slot_mapping=torch.arange(t),
                page_size=16)
    args.update(kw)
    return args


KV_BAD = [  # shared by both wrappers
    (dict(k=torch.zeros(3, 128)), "k and v must be"),
    (dict(v=torch.zeros(4, 2, 64)), "differ in shape"),
    (dict(k=torch.zeros(3, 2, 64, dtype=torch.int32), v=torch.zeros(3, 2, 64, dtype=torch.int32)), "floating-point"),
    (dict(v=torch.zeros(3, 2, 64, dtype=torch.bfloat16)), "floating-point"),
    (dict(slot_mapping=torch.arange(3, dtype=torch.int32)), "int64"),
    (dict(slot_mapping=torch.arange(4)), "T = 3"),
    (dict(slot_mapping=torch.arange(3)[:, None]), "T = 3"),
]


@pytest.mark.parametrize("bad,msg", KV_BAD + [
    (dict(kv_cache=torch.zeros(4, 2, 16, 128, dtype=torch.bfloat16)), "num_pages, 2"),
    (dict(kv_cache=torch.zeros(4, 3, 16, 2, 64, dtype=torch.bfloat16)), "num_pages, 2"),
    (dict(kv_cache=torch.zeros(4, 2, 16, 2, 64)), "bfloat16 or float16"),
    (dict(kv_cache=torch.zeros(4, 2, 16, 64, 2, dtype=torch.bfloat16).transpose(3, 4)), "contiguous"),
    (dict(kv_cache=torch.zeros(4, 2, 16, 4, 64, dtype=torch.bfloat16)), "heads x head_dim"),
    (dict(kv_cache=torch.zeros(4, 2, 16, 2, 128, dtype=torch.bfloat16)), "heads x head_dim"),
])
def test_write_paged_refuses_bad_input(bad, msg):
    with pytest.raises(ValueError, match=msg):
        kv_write.write_paged(**_paged_args(**bad))


@pytest.mark.parametrize("bad,msg", KV_BAD + [
    (dict(pool16=torch.zeros(4096, dtype=torch.uint8)), "int16 view"),
    (dict(pool16=torch.zeros(64, 64, dtype=torch.int16)), "int16 view"),
    (dict(pool16=torch.zeros(8192, dtype=torch.int16)[::2]), "contiguous"),
    (dict(group_start=torch.zeros(4, 2, 2, dtype=torch.int32)), "group_start must be int64"),
    (dict(group_start=torch.zeros(4, 8, 2, dtype=torch.int64)), r"\[num_page_ids, 2, 2\]"),
    (dict(group_start=torch.zeros(2, 4, 2, 2, dtype=torch.int64)), "one layer's table"),
    (dict(stored_pos=torch.zeros(2, 16 * 64, dtype=torch.int32)), "stored_pos must be int64"),
    (dict(stored_pos=torch.zeros(2, 8 * 64, dtype=torch.int64)), r"\[2, 1024\]"),
    (dict(page_size=0), "page_size must be a positive int"),
    (dict(page_size=16.0), "page_size must be a positive int"),
])
def test_write_pool_refuses_bad_input(bad, msg):
    with pytest.raises(ValueError, match=msg):
        kv_write.write_pool(**_pool_args(**bad))
