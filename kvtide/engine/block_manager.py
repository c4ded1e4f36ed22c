"""Paged KV bookkeeping: which page holds which tokens, reference counts, and the prefix cache.

Page ids are indices into the per-layer KV tensors. A full page gets a chained hash (parent hash + its tokens); a
freed page keeps its hash and contents until it is handed out again, so a later request with the same prefix can
take it back. Hits are verified against the page's stored tokens, so a hash collision cannot serve wrong KV.

With a `CompressedPagePool` (``kvtide.cache.zip_pages.ZipPagedKV``) page ids are only names: bytes come from the
pool, which says how many new raw pages fit. Then `free` holds only cached pages (their bytes still held, evicted
LRU-first when bytes run short), a released page without a hash gives its bytes back at once, and `unused` holds
the ids that own nothing.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from itertools import islice
from typing import Callable, Protocol

import numpy as np

from .sequence import Sequence

ROOT_HASH = b"kvtide-page-v1"


def page_hash(parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


class CompressedPagePool(Protocol):
    """Byte storage behind page ids: the compressed pool (kvtide.cache.zip_pages.ZipPagedKV), as this class uses it."""

    num_page_ids: int

    def free_pages(self, reserve: bool = True) -> int: ...
    def alloc_pages(self, pids: list[int]) -> None: ...
    def release_pages(self, pids: list[int]) -> None: ...


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 pool: CompressedPagePool | None = None):
        self.pool = pool
        if pool is not None:
            num_pages = pool.num_page_ids
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
        self.unused: deque[int] = deque()  # pool mode: ids holding no bytes
        if pool is not None:
            self.free, self.unused = OrderedDict(), deque(range(num_pages))
        self.seq_hashes: dict[str, list[bytes]] = {}  # chained hashes of each sequence's full pages
        self.uncacheable: set[str] = set()  # request ids whose pages never join the prefix cache (see commit)
        self.stats = {"prefix_queries": 0, "prefix_hit_tokens": 0, "prefix_query_tokens": 0, "evictions": 0}
        # Hooks for a KV store behind the device cache (kvtide.engine.restoration): a sequence about to release
        # its pages, and cached pages about to lose their contents (called while their bytes are still intact).
        self.on_release: Callable[[Sequence], None] | None = None
        self.on_evict: Callable[[list[int]], None] | None = None

    def _evicting(self, pids: list[int]) -> None:
        """Tell the store hook which cached pages are about to be forgotten (their KV can still be read)."""
        if self.on_evict is not None:
            cached = [p for p in pids if self.page_hashes[p] is not None]
            if cached:
                self.on_evict(cached)

    # ---- capacity -------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """New pages that fit now (pool mode: in free bytes, cached pages not counted)."""
        if self.pool is not None:
            return self.pool.free_pages()
        return len(self.free)

    def can_admit(self, hits: list[int], fresh: int, reserve: int) -> bool:
        """Whether prefix hits plus `fresh` new pages fit with `reserve` pages left for running sequences.

        Pool mode evicts cached pages (LRU first, never the hits) until the new pages fit at raw size.
        """
        if self.pool is None:
            revived = sum(1 for pid in hits if self.ref_count[pid] == 0)  # hits sitting in the free list
            return revived + fresh + reserve <= len(self.free)
        return self._make_room(fresh + reserve, reserve=True, keep=set(hits))

    def _make_room(self, pages: int, reserve: bool, keep: set[int] = frozenset()) -> bool:
        """Evict cached pages, least recently used first, until ``pages`` new pages fit. As many victims at a
        time as pages are missing (a compressed page frees at most about one raw page's room), so with a full pool
        the capacity is asked a few times per step instead of once per victim."""
        while (short := pages - self.pool.free_pages(reserve)) > 0:
            if not self.evict_lru(short, keep):
                return False
        return True

    def evict_lru(self, n: int, keep: set[int] | frozenset[int] = frozenset()) -> int:
        """Evict up to ``n`` cached pages, least recently used first, never those in ``keep``; returns how many.
        Pool mode: the compressed pool calls it (``ZipPagedKV.evictor``) when a page it compresses finds no slot
        of a group's size class, rather than compress that group in place, which would hold a raw-size slot for
        as long as the page lives."""
        victims = list(islice((pid for pid in self.free if pid not in keep), n))
        if not victims:
            return 0
        self._evicting(victims)
        for pid in victims:
            del self.free[pid]
            self._forget(pid)
        self.pool.release_pages(victims)
        self.unused.extend(victims)
        self.stats["evictions"] += len(victims)
        return len(victims)

    def evict_cached(self) -> int:
        """Drop every cached page no sequence holds (what memory pressure does); returns how many."""
        n = 0
        victims = [p for p in self.free if self.page_hashes[p] is not None]
        self._evicting(victims)
        for pid in victims:
            self._forget(pid)
            n += 1
            if self.pool is not None:  # pool mode: a free page holds bytes only while it is cached
                del self.free[pid]
                self.pool.release_pages([pid])
                self.unused.append(pid)
        self.stats["evictions"] += n
        return n

    def _forget(self, pid: int) -> None:
        old = self.page_hashes[pid]
        if old is not None:  # evict its cached contents
            if self.hash_to_page.get(old) == pid:
                del self.hash_to_page[old]
            self.page_hashes[pid] = None
            self.page_tokens[pid] = None

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New pages `seq` needs to hold `num_tokens` tokens in all."""
        return max(0, -(-num_tokens // self.page_size) - len(seq.pages))

    # ---- prefix cache ---------------------------------------------------------------------------
    def cached_page(self, h: bytes, tokens: tuple[int, ...]) -> int | None:
        """The page cached under chained hash ``h`` if it still holds ``tokens`` (verified), else None."""
        pid = self.hash_to_page.get(h)
        if pid is None or self.page_tokens[pid] != tokens:
            return None
        return pid

    def cached_pages(self, hashes: tuple[bytes, ...] | list[bytes], tokens: list[int]) -> list[int] | None:
        """The pages of a run of full pages (chained ``hashes``, their ``tokens`` in order) while every one of
        them is still cached; None once any is gone."""
        p = self.page_size
        pids = [self.cached_page(h, tuple(tokens[i * p:(i + 1) * p])) for i, h in enumerate(hashes)]
        return None if any(pid is None for pid in pids) else pids

    def hash_of(self, pid: int) -> bytes | None:
        """The chained hash of the tokens page ``pid`` holds (None: it holds no committed full page)."""
        return self.page_hashes[pid]

    def committed_hashes(self, seq: Sequence) -> list[bytes]:
        """Chained hashes of ``seq``'s full pages committed so far (its first pages first)."""
        return list(self.seq_hashes.get(seq.request_id, ()))

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
            pid = self.cached_page(parent, toks)
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
        if self.pool is not None:
            if need and not self._make_room(need, reserve=False):
                return False
            pids = [self.unused.popleft() for _ in range(need)]
            self.pool.alloc_pages(pids)
            for pid in pids:
                self.ref_count[pid] = 1
            seq.pages.extend(pids)
            return True
        if need > len(self.free):
            return False
        if self.on_evict is not None:
            self._evicting(list(islice(self.free, need)))  # LRU first: the pages popped below
        for _ in range(need):
            pid, _ = self.free.popitem(last=False)
            self._forget(pid)
            self.ref_count[pid] = 1
            seq.pages.append(pid)
        return True

    def allocate_all(self, items: list[tuple[Sequence, int]]) -> bool:
        """Grow every (seq, num_tokens) at once if all of it fits, else allocate nothing and return False (cached
        pages may have been evicted in the attempt, as the one-by-one path would have too).

        Decode sequences run in lockstep, so every 16th step each needs one page: one capacity check and one
        ``alloc_pages`` for all of them (pool mode) instead of one per sequence, each of which is host work of its
        own (slot allocation in every layer, a capacity search, a few device ops)."""
        needs = [self.pages_needed(seq, n) for seq, n in items]
        total = sum(needs)
        if not total:
            return True
        if self.pool is None:
            if total > len(self.free):
                return False
            for seq, n in items:
                self.allocate(seq, n)
            return True
        if not self._make_room(total, reserve=False):
            return False
        pids = [self.unused.popleft() for _ in range(total)]
        self.pool.alloc_pages(pids)
        it = iter(pids)
        for (seq, _), need in zip(items, needs):
            new = [next(it) for _ in range(need)]
            for pid in new:
                self.ref_count[pid] = 1
            seq.pages.extend(new)
        return True

    def commit(self, seq: Sequence) -> None:
        """Register pages that are now full and computed, so later requests can reuse them (not those of a request in
        ``uncacheable``: its KV is not what a prefill would write, e.g. restored from a lossy store entry)."""
        if not self.enable_prefix_caching or seq.request_id in self.uncacheable:
            return
        hashes = self.seq_hashes.setdefault(seq.request_id, [])
        full = seq.num_computed_tokens // self.page_size
        if len(hashes) >= full:
            return
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), full):
            toks = tuple(seq.tokens(i * self.page_size, (i + 1) * self.page_size))
            parent = page_hash(parent, toks)
            hashes.append(parent)
            pid = seq.pages[i]
            if self.page_hashes[pid] is None:
                self.page_hashes[pid] = parent
                self.page_tokens[pid] = toks
                self.hash_to_page.setdefault(parent, pid)

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s references; its pages stay cached (tail first out) until reused."""
        if self.on_release is not None:
            self.on_release(seq)
        dropped = []
        for pid in reversed(seq.pages):
            self.ref_count[pid] -= 1
            assert self.ref_count[pid] >= 0, "page reference count went negative"
            if self.ref_count[pid] == 0:
                if self.pool is not None and self.page_hashes[pid] is None:
                    dropped.append(pid)  # nothing to reuse it for: give its bytes back now
                else:
                    self.free[pid] = None
        if dropped:
            self.pool.release_pages(dropped)
            self.unused.extend(dropped)
        seq.pages = []
        self.seq_hashes.pop(seq.request_id, None)
        self.uncacheable.discard(seq.request_id)
