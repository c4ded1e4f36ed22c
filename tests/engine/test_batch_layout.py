"""BatchLayout.page_table == the plain construction from block tables (all rows, a subset, ragged lengths)."""

from __future__ import annotations

import random

import pytest
import torch

from kvtide.engine.attention import BatchLayout


def plain(layout: BatchLayout, rows: list[int]) -> tuple[list[int], list[int], list[int]]:
    p = layout.page_size
    used = [-(-layout.kv_lens[i] // p) for i in rows]
    indices = [pid for i, n in zip(rows, used) for pid in layout.block_tables[i][:n]]
    indptr = [0]
    for n in used:
        indptr.append(indptr[-1] + n)
    return indptr, indices, [layout.kv_lens[i] - (n - 1) * p for i, n in zip(rows, used)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_page_table_matches_the_plain_construction(page_size: int) -> None:
    rng = random.Random(page_size)
    kv = [rng.randint(1, 300) for _ in range(9)] + [page_size, 2 * page_size]  # exact page multiples too
    tables = [rng.sample(range(10_000), -(-n // page_size) + rng.randint(0, 3)) for n in kv]  # spare pages at the end
    layout = BatchLayout([1] * len(kv), kv, tables, torch.zeros(len(kv), dtype=torch.long), page_size)
    for rows in (None, [0, 3, 7], [10], []):
        got = layout.page_table(rows)
        want = plain(layout, list(range(len(kv))) if rows is None else rows)
        assert [t.dtype for t in got] == [torch.int32] * 3
        assert [t.tolist() for t in got] == list(want)


def test_page_arrays_follow_growing_and_replaced_tables_across_steps() -> None:
    """Cached int32 tables give the same page table as the lists, step after step: tables grow, a sequence's list
    is replaced (preemption gives it a new one), sequences leave and join."""
    from kvtide.engine.attention import PageArrays

    rng = random.Random(7)
    arrays = PageArrays()
    tables = [rng.sample(range(10_000), 3) for _ in range(5)]
    for step in range(40):
        if step % 7 == 3:
            tables[rng.randrange(len(tables))] = rng.sample(range(10_000), rng.randint(1, 4))  # a new list
        if step % 11 == 5:
            tables.pop(0)
            tables.append(rng.sample(range(10_000), 2))
        for t in tables:
            if rng.random() < 0.3:
                t.append(rng.randrange(10_000))
        kv = [len(t) * 16 - rng.randint(0, 15) for t in tables]
        cached = BatchLayout([1] * len(kv), kv, tables, torch.zeros(len(kv), dtype=torch.long), 16, arrays(tables))
        for got, want in zip(cached.page_table(), plain(cached, list(range(len(kv))))):
            assert got.tolist() == want
