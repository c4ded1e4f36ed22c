"""bench/tools/zip_warp_clock.py's host side: pieces of each warp's run, a launch's summary and the SM rank correlation."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # the bench imports the Triton kernels: interpreter mode before they are decorated
    os.environ["TRITON_INTERPRET"] = "1"

from bench.tools.zip_warp_clock import pieces_per_warp, rank_correlation, summarise  # noqa: E402
from kvtide.kernels import zip_attention_cuda as zc  # noqa: E402


def _plan(batch: int, pages: int, **kw) -> zc.CudaDecodePlan:
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    return zc.plan(indptr, torch.arange(batch * pages, dtype=torch.int32), torch.full((batch,), 16, dtype=torch.int32),
                   32, 8, 128, device="cpu", **kw)


def test_pieces_per_warp_follow_the_balanced_walk() -> None:
    """Balanced runs: each warp's count is the host mirror's; 67 x 8 units of 520 pages on 2112 warps of 132 pages
    cross a unit boundary in 519 runs. Even splits: one piece a warp."""
    p = _plan(67, 520)
    assert p.balanced
    indptr = list(range(0, 68 * 520, 520))
    got = pieces_per_warp(p, indptr)
    want = [0] * len(got)
    for w, *_ in zc.balanced_pieces(indptr, 8, p.pages_per_split, p.grid_warps):
        want[w] += 1
    assert got == want and got.count(2) == 519 and got.count(1) == 2112 - 519
    even = _plan(66, 520)
    assert not even.balanced and set(pieces_per_warp(even, list(range(0, 67 * 520, 520)))) == {1}


def test_summarise_and_rank_correlation() -> None:
    """A hand-made launch: warps on SM s end 100 + s us after the first start, two-piece warps 5 us later; the
    summary's span, ends by pieces and SM ends follow, and two launches with the same SM order correlate fully,
    reversed order -1."""
    n = 8
    pieces = [1, 2, 1, 2, 1, 1, 1, 1]
    rec = torch.zeros(n, 4, dtype=torch.int64)
    rec[:, 0] = 1_000_000
    rec[:, 2] = torch.arange(n) % 4
    rec[:, 1] = 1_000_000 + (100 + rec[:, 2]) * 1000 + torch.tensor(pieces) * 5000 - 5000
    s = summarise(rec, pieces)
    assert s["span_us"] == 108.0 and s["start_spread_us"] == 0.0
    assert s["by_pieces"][2]["warps"] == 2 and s["by_pieces"][2]["end_max_us"] == 108.0
    assert s["by_pieces"][1]["end_max_us"] == 103.0 and s["sm_end_us"]["sms"] == 4
    assert s["sm_last_end_us"] == {0: 100.0, 1: 106.0, 2: 102.0, 3: 108.0}
    a = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}
    assert rank_correlation(a, a) == 1.0 and rank_correlation(a, {k: -v for k, v in a.items()}) == -1.0
