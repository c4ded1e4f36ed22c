"""The "mma" value order: a permutation that puts every value where the m16n8k16 fragment layout expects it."""
from __future__ import annotations

import pytest
import torch

from kvtide.cache import zip_order
from kvtide.cache.zip_pages import ZipGeometry, ZipPagedKV


@pytest.mark.parametrize("head_dim", [64, 128])
def test_orders_are_permutations_and_inverse(head_dim: int) -> None:
    n = 16 * head_dim
    for order in zip_order.ORDERS:
        s2n = zip_order.stored_to_natural(order, 16, head_dim)
        n2s = zip_order.natural_to_stored(order, 16, head_dim)
        for kv in range(2):
            assert torch.equal(s2n[kv].sort().values, torch.arange(n))
            assert torch.equal(s2n[kv][n2s[kv]], torch.arange(n))
    x = torch.randn(3, 2, n)
    assert torch.equal(zip_order.to_natural(zip_order.to_stored(x, "mma", 16, head_dim), "mma", 16, head_dim), x)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_mma_order_matches_the_ptx_fragment_tables(head_dim: int) -> None:
    """PTX ISA, mma.m16n8k16 .bf16 A fragment: lane = 4 groupID + threadID_in_group holds a_i at row
    groupID + 8 for i in {2,3,6,7}, column 2 threadID_in_group + (i % 2) + 8 for i >= 4. K's tile rows are tokens
    (S^T = K Q^T); V's tile rows are dims (O^T = V^T P^T). A lane's 16 values of block j: k-steps 2j, 2j + 1."""
    k = torch.arange(16 * head_dim).view(16, head_dim)  # value = natural index
    stored = zip_order.to_stored(torch.stack([k.reshape(-1), k.reshape(-1)]), "mma", 16, head_dim)
    for j in range(head_dim // 32):
        for lane in range(32):
            gid, tig = lane // 4, lane % 4
            for h in range(2):
                ks = 2 * j + h
                for i in range(8):
                    row = gid + (8 if i in (2, 3, 6, 7) else 0)
                    col = 2 * tig + (i % 2) + (8 if i >= 4 else 0)
                    at = j * 512 + lane * 16 + h * 8 + i
                    assert stored[0, at] == k[row, 16 * ks + col]  # K tile [token, dim]
                    assert stored[1, at] == k[col, 16 * ks + row]  # V^T tile [dim, token]


def test_mma_order_refuses_shapes_it_cannot_take() -> None:
    with pytest.raises(ValueError, match="page_size 16"):
        ZipGeometry(2, 2, 64, 8, value_order="mma")
    with pytest.raises(ValueError, match="block_size 512"):
        ZipGeometry(2, 2, 64, 16, block_size=256, value_order="mma")
    with pytest.raises(ValueError, match="unknown value order"):
        ZipGeometry(2, 2, 64, 16, value_order="nope")


@pytest.mark.parametrize("version", [1, 2])
def test_store_in_mma_order_round_trips_and_stores_the_permutation(version: int) -> None:
    geo = ZipGeometry(2, 2, 64, 16, format_version=version, value_order="mma")
    store = ZipPagedKV(geo, budget_bytes=24 * geo.raw_page_bytes)
    gen = torch.Generator().manual_seed(3)
    pids = [1, 4]
    store.alloc_pages(pids)
    slots = torch.tensor([p * 16 + o for p in pids for o in range(16)])
    kv = {}
    for layer in range(2):
        k = (torch.randn(32, 2, 64, generator=gen) * 3).bfloat16()
        v = torch.randn(32, 2, 64, generator=gen).bfloat16()
        k[:16, :, 7] = 0.0  # a zero channel: v2 escapes it
        for chunk in torch.arange(32).split(7):
            store.write(layer, k[chunk], v[chunk], slots[chunk])
        kv[layer] = (k, v)
    for compress in (False, True):
        if compress:
            store.compress(pids)
        for layer, (k, v) in kv.items():
            got = store.read_pages(layer, torch.tensor(pids))  # [n, 2, 16, H, D]
            assert torch.equal(got[:, 0].reshape(k.shape).view(torch.int16), k.view(torch.int16))
            assert torch.equal(got[:, 1].reshape(v.shape).view(torch.int16), v.view(torch.int16))
    # the pool holds the stored order: the raw bytes of a raw group are the permuted values
    store2 = ZipPagedKV(geo, budget_bytes=24 * geo.raw_page_bytes)
    store2.alloc_pages([0])
    k, v = kv[0][0][:16], kv[0][1][:16]
    store2.write(0, k, v, torch.arange(16))
    start = int(store2.group_start[0][0, 1, 0])  # page 0, head 1, K
    raw = store2.pool[start:start + 2 * 16 * 64].view(torch.bfloat16)
    nat = k[:, 1].reshape(-1)
    assert torch.equal(raw.view(torch.int16), nat[zip_order.stored_to_natural("mma", 16, 64)[0]].view(torch.int16))
