"""Paged KV bookkeeping: which page holds which tokens, reference counts, and the prefix cache.

Page ids are indices into the per-layer KV tensors. A full page gets a chained hash (parent hash + its tokens); a
freed page keeps its hash and contents until it is handed out again, so a later request with the same prefix can
take it back. Hits are verified against the page's stored tokens, so a hash collision cannot serve wrong KV.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from .sequence import Sequence

ROOT_HASH = b"kvtide-page-v1"


def page_hash(parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_pages
        self.page_hashes: list[bytes | None] = [None] * num_pages
        self.page_tokens: list[tuple[int, ...] | None] = [None] * num_pages
        self.hash_to_page: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_pages))  # LRU first
        self.seq_hashes: dict[str, list[bytes]] = {}  # chained hashes of each sequence's full pages
        self.stats = {"prefix_queries": 0, "prefix_hit_tokens": 0, "prefix_query_tokens": 0}

    # ---- capacity -------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self.free)

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New pages `seq` needs to hold `num_tokens` tokens in all."""
        return max(0, -(-num_tokens // self.page_size) - len(seq.pages))

    # ---- prefix cache ---------------------------------------------------------------------------
    def _lookup(self, h: bytes, tokens: tuple[int, ...]) -> int | None:
        pid = self.hash_to_page.get(h)
        if pid is None or self.page_tokens[pid] != tokens:
            return None
        return pid

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached pages for the longest prefix of `seq`, leaving at least one token to compute (for logits)."""
        if not self.enable_prefix_caching:
            return []
        ids = seq.token_ids
        usable = (len(ids) - 1) // self.page_size
        parent, hits = ROOT_HASH, []
        for i in range(usable):
            toks = tuple(ids[i * self.page_size:(i + 1) * self.page_size])
            parent = page_hash(parent, toks)
            pid = self._lookup(parent, toks)
            if pid is None:
                break
            hits.append(pid)
        return hits

    def admit(self, seq: Sequence, cached_pages: list[int]) -> None:
        """Take references on the prefix hits and record them as computed."""
        assert not seq.pages
        for pid in cached_pages:
            self._ref(pid)
        seq.pages = list(cached_pages)
        seq.num_computed_tokens = len(cached_pages) * self.page_size
        self.stats["prefix_queries"] += 1
        self.stats["prefix_query_tokens"] += seq.num_tokens
        self.stats["prefix_hit_tokens"] += seq.num_computed_tokens
        ids = seq.token_ids
        parent, hashes = ROOT_HASH, []
        for i in range(len(cached_pages)):
            parent = page_hash(parent, ids[i * self.page_size:(i + 1) * self.page_size])
            hashes.append(parent)
        self.seq_hashes[seq.request_id] = hashes

    def _ref(self, pid: int) -> None:
        if self.ref_count[pid] == 0:
            self.free.pop(pid)
        self.ref_count[pid] += 1

    # ---- allocation -----------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s page table to hold `num_tokens` tokens; False (and no change) if pages run out."""
        need = self.pages_needed(seq, num_tokens)
        if need > len(self.free):
            return False
        for _ in range(need):
            pid, _ = self.free.popitem(last=False)
            old = self.page_hashes[pid]
            if old is not None:  # evict its cached contents
                if self.hash_to_page.get(old) == pid:
                    del self.hash_to_page[old]
                self.page_hashes[pid] = None
                self.page_tokens[pid] = None
            self.ref_count[pid] = 1
            seq.pages.append(pid)
        return True

    def commit(self, seq: Sequence) -> None:
        """Register pages that are now full and computed, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        hashes = self.seq_hashes.setdefault(seq.request_id, [])
        full = seq.num_computed_tokens // self.page_size
        if len(hashes) >= full:
            return
        ids = seq.token_ids
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), full):
            toks = tuple(ids[i * self.page_size:(i + 1) * self.page_size])
            parent = page_hash(parent, toks)
            hashes.append(parent)
            pid = seq.pages[i]
            if self.page_hashes[pid] is None:
                self.page_hashes[pid] = parent
                self.page_tokens[pid] = toks
                self.hash_to_page.setdefault(parent, pid)

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s references; its pages stay cached (tail first out) until reused."""
        for pid in reversed(seq.pages):
            self.ref_count[pid] -= 1
            assert self.ref_count[pid] >= 0, "page reference count went negative"
            if self.ref_count[pid] == 0:
                self.free[pid] = None
        seq.pages = []
        self.seq_hashes.pop(seq.request_id, None)
