"""Host-side reading of a FlashInfer-style page table (indptr, last page length), shared by the decode kernels'
plans: one check of the table, one derivation of the lengths."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceLengths:
    indptr: torch.Tensor  # int64 [B + 1], CPU
    pages: torch.Tensor  # int64 [B], CPU: pages per sequence
    kv_lens: torch.Tensor  # int64 [B], CPU: tokens per sequence

    @property
    def batch(self) -> int:
        return int(self.pages.numel())

    @property
    def max_pages(self) -> int:
        return int(self.pages.max())


def sequence_lengths(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> SequenceLengths:
    """Pages and tokens of every sequence; refuses a table with an empty sequence or a bad last page length."""
    indptr = kv_indptr.to("cpu", torch.int64)
    last = kv_last_page_len.to("cpu", torch.int64)
    pages = indptr[1:] - indptr[:-1]
    if bool((pages < 1).any()) or bool((last < 1).any()) or bool((last > page_size).any()):
        raise ValueError("every sequence needs at least one page and 1 <= last_page_len <= page_size")
    return SequenceLengths(indptr, pages, (pages - 1) * page_size + last)
