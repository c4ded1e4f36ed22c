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
