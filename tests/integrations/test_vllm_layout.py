"""The connector's KV layouts against how vLLM 0.32's backends address a block (no vLLM needed).

The references below restate each backend's own indexing: the CPU backend writes K of token n, dimension d of
head h in block b at ``view(B, H, 2N*D)[b, h, d*N + n]`` (K plane transposed; measured from its
``cpu_attn_reshape_and_cache`` and checked against it again in the vLLM tests) and V at ``[b, h, N*D + n*D + d]``;
the CUDA backends read ``kv.transpose(1, 2).split(D, dim=-1)`` of a [B, H, N, 2D'] cache (``flash_attn.py``).
"""
from __future__ import annotations

import pytest
import torch

from kvtide.integrations.vllm.layout import CpuLayout, GpuLayout, Placement, get_layout, layout_for_backend, slots

B, H, N, D = 6, 3, 16, 8


def cpu_reference_write(cache: torch.Tensor, blocks, offsets, k: torch.Tensor, v: torch.Tensor) -> None:
    flat = cache.view(B, H, 2 * N * D)
    for t, (b, n) in enumerate(zip(blocks.tolist(), offsets.tolist())):
        for h in range(H):
            for d in range(D):
                flat[b, h, d * N + n] = k[t, h, d]
                flat[b, h, N * D + n * D + d] = v[t, h, d]


def gpu_reference_read(cache: torch.Tensor, blocks, offsets, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    key_cache, value_cache = cache.transpose(1, 2).split(cache.shape[-1] // 2, dim=-1)  # [B, N, H, D'] each
    return key_cache[blocks, offsets][..., :d], value_cache[blocks, offsets][..., :d]


def kv(t: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, t, H, D, generator=g).to(dtype)


def test_slots_follow_the_block_table():
    blocks, offsets = slots(14, 35, [5, 2, 4], 16)  # tokens 14..34: block 5 (14, 15), block 2 (all), block 4 (0..2)
    assert blocks.tolist() == [5, 5] + [2] * 16 + [4] * 3
    assert offsets.tolist() == [14, 15] + list(range(16)) + [0, 1, 2]
    assert slots(3, 3, [1], 16)[0].numel() == 0
    with pytest.raises(ValueError, match="need 3 blocks"):
        slots(0, 33, [0, 1], 16)
    with pytest.raises(ValueError):
        slots(5, 4, [0], 16)


@pytest.mark.parametrize("start,end", [(0, 2 * N), (5, 3 * N - 3), (N - 1, N + 1)])
def test_cpu_layout_reads_the_kernels_arrangement(start, end):
    cache = torch.zeros(B, H, N, 2 * D, dtype=torch.bfloat16)
    table = [4, 1, 3, 0]
    blocks, offsets = slots(start, end, table, N)
    x = kv(end - start)
    cpu_reference_write(cache, blocks, offsets, x[0], x[1])
    lay = CpuLayout()
    lay.check(cache, H, D, N)
    assert torch.equal(lay.gather(cache, blocks, offsets, D), x)
    # and the connector's writes are the kernel's: the same bytes as the reference writer's
    mine = torch.zeros_like(cache)
    lay.scatter(mine, blocks, offsets, x)
    assert torch.equal(mine, cache)


def test_cpu_layout_is_not_row_per_token():
    """Reading row n as token n's [K | V] (the CUDA rule) gets other values out of a CPU cache."""
    cache = torch.zeros(B, H, N, 2 * D, dtype=torch.bfloat16)
    blocks, offsets = slots(0, N, [2], N)
    x = kv(N, seed=1)
    cpu_reference_write(cache, blocks, offsets, x[0], x[1])
    assert not torch.equal(GpuLayout().gather(cache, blocks, offsets, D), x)


@pytest.mark.parametrize("padded", [D, D + 8])
@pytest.mark.parametrize("nhd", [False, True])
def test_gpu_layout_matches_the_cuda_backends(padded, nhd):
    if nhd:  # physical [B, N, H, C]: the logical [B, H, N, C] view has tokens outside heads
        cache = torch.zeros(B, N, H, 2 * padded, dtype=torch.float16).transpose(1, 2)
    else:
        cache = torch.zeros(B, H, N, 2 * padded, dtype=torch.float16)
    blocks, offsets = slots(3, 2 * N + 5, [5, 0, 2], N)
    x = kv(2 * N + 2, dtype=torch.float16)
    lay = GpuLayout()
    lay.check(cache, H, D, N)
    lay.scatter(cache, blocks, offsets, x)
    k, v = gpu_reference_read(cache, blocks, offsets, D)
    assert torch.equal(k, x[0]) and torch.equal(v, x[1])
    assert torch.equal(lay.gather(cache, blocks, offsets, D), x)
    if padded > D:  # the padding is left alone
        assert not cache[..., D:padded].any() and not cache[..., padded + D:].any()


def test_layouts_write_only_their_tokens():
    for lay in (CpuLayout(), GpuLayout()):
        cache = torch.full((B, H, N, 2 * D), 7.0, dtype=torch.bfloat16)
        before = cache.clone()
        blocks, offsets = slots(N + 2, N + 5, [0, 3], N)
        lay.scatter(cache, blocks, offsets, kv(3))
        changed = (cache != before).flatten(2).any(-1)  # [B, H]
        assert changed[3].all() and not changed[torch.arange(B) != 3].any()
        back = lay.gather(cache, *slots(N, 2 * N, [0, 3], N), D)
        assert (back[:, :2] == 7).all() and (back[:, 5:] == 7).all()


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="does not hold"):
        CpuLayout().check(torch.zeros(B, H + 1, N, 2 * D), H, D, N)
    with pytest.raises(ValueError, match="2 \\* head_dim"):
        CpuLayout().check(torch.zeros(B, H, N, 2 * D + 16), H, D, N)
    with pytest.raises(ValueError, match="contiguous"):
        CpuLayout().check(torch.zeros(B, N, H, 2 * D).transpose(1, 2), H, D, N)
    with pytest.raises(ValueError, match="blocks, kv_heads"):
        GpuLayout().check(torch.zeros(2, B, N, H, D), H, D, N)


def test_backend_names():
    assert layout_for_backend("CPU_ATTN") == "cpu"
    assert layout_for_backend("FLASH_ATTN") == "gpu" and layout_for_backend("FLASHINFER") == "gpu"
    with pytest.raises(ValueError, match="kv_layout"):
        layout_for_backend("FLASHMLA")
    assert isinstance(get_layout("cpu"), CpuLayout)
    with pytest.raises(ValueError, match="unknown KV layout"):
        get_layout("tpu")


@pytest.mark.parametrize("make", [lambda: torch.zeros(B, H, N, 2 * D, dtype=torch.bfloat16),
                                  lambda: torch.zeros(B, N, H, 2 * D + 16, dtype=torch.bfloat16).transpose(1, 2)],
                         ids=["contiguous", "nhd-padded"])
def test_placement_moves_whole_blocks_like_tokens(make):
    """Placement copies the whole blocks of a range one block at a time and the ends token by token: the same
    bytes as addressing every token, for any range."""
    table = [5, 1, 4, 0, 2]
    for lay in (CpuLayout(), GpuLayout()):
        base = make()
        if lay.name == "cpu" and not base.is_contiguous():
            continue
        for start, end in [(0, 3 * N), (5, 3 * N - 3), (N, 2 * N), (3, 9), (N - 1, N + 1), (0, 5 * N)]:
            x = kv(end - start, seed=start + end)
            by_token, by_place = base.clone(), base.clone()
            lay.scatter(by_token, *slots(start, end, table, N), x)
            Placement(start, end, table, N).scatter(lay, by_place, x)
            assert torch.equal(by_token, by_place), (lay.name, start, end)
            assert torch.equal(Placement(start, end, table, N).gather(lay, by_place, D), x)
    with pytest.raises(ValueError, match="need"):
        Placement(0, 6 * N, table, N)
