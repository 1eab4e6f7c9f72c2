"""The page pool of a paged KV cache (shared/kv_cache.py) and the prefixes its pages hold: which pages each slot's
positions use, pages given out as a request's positions grow and returned when it ends, and automatic prefix
caching by page. Bookkeeping, besides the cache's page table rows, fresh pages zeroed and a partial hit's rows
copied.

A full page of committed tokens is indexed by its tokens and the page before it (a chain: the key of page k is
(the chain id of page k - 1, its tokens), compared exactly, so a hit is never a hash collision); a request that
ends also indexes its last page, partly filled, under the same kind of key. A page has holders (the requests whose
table names it); one with none that the index keeps is evictable, least recently used first, and a page with no
holder and no index entry is free. A new request takes the longest chain of full pages its tokens begin with,
holding them (a page a holder writes is never shared: a request writes only past its committed positions and only
full committed pages are held by others), then the rows of the indexed page after them that its tokens begin with
the most of (full or partial), copied into a page of its own; it prefills the rest.
"""

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from verify_worker.engine.prefix_cache import KEEP_AT_LEAST, common_prefix

ROOT = 0  # the chain id before a request's first page
PAGE_SIZE = 64  # positions a page holds by default: the attention kernels' key block (shared.attention.KEY_CHUNK)


@dataclass
class PageEntry:
    chain: int  # this page's chain id (the parent of the page after it)
    parent: int  # the chain id of the page before it (ROOT for a first page)
    tokens: tuple[int, ...]  # its positions' tokens: a page's worth, or fewer for a request's last page
    page: int
    features: torch.Tensor | None  # [len(tokens), width] the drafter's rows of its positions (None: no drafter)

    @property
    def key(self) -> tuple:
        return self.parent, self.tokens


@dataclass
class SlotPages:
    """One request's pages, in position order, and how many of them (from the first) the index has seen."""

    pages: list[int] = field(default_factory=list)
    chains: list[int] = field(default_factory=list)  # chain ids of its first len(chains) pages (indexed or found)


@dataclass(frozen=True)
class PageHit:
    pages: list[int]  # full pages, held
    chains: list[int]
    features: list[torch.Tensor]  # the drafter's rows of every reused position, page by page (empty: no drafter)
    partial: PageEntry | None = None  # the page whose first `rows` rows are copied after them
    rows: int = 0


class PageTables:
    """The pool's pages: given out, held, indexed, evicted. `cache` is the PositionalKVCache whose page table this
    writes; caching: whether pages are indexed for later prompts (prefix caching)."""

    def __init__(self, cache, caching: bool = True):
        self.cache, self.caching = cache, caching
        self.page_size = cache.page_size
        self.free: list[int] = list(range(cache.num_pages - 1, -1, -1))  # a stack: the lowest page on top
        self.given = bytearray(cache.num_pages)  # 1: given out before (else it holds whatever memory held)
        self.holders = [0] * cache.num_pages
        self.evictable: OrderedDict[int, None] = OrderedDict()  # held by nobody, indexed; least recent first
        self.by_key: dict[tuple, PageEntry] = {}
        self.by_page: dict[int, PageEntry] = {}
        # parent chain id -> (tokens, page) of the pages indexed after it, sorted: the one whose tokens a prompt
        # begins with the most of is a neighbour of the prompt's place among them
        self.children: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        self.cached_tokens = 0  # tokens the indexed pages hold
        self.next_chain = ROOT + 1
        self.slots: dict[int, SlotPages] = {}

    # ------------------------------------------------------------------ counts
    @property
    def available(self) -> int:
        """Pages a request could be given now: free ones and evictable ones."""
        return len(self.free) + len(self.evictable)

    @property
    def used(self) -> int:
        """Pages some request holds."""
        return self.cache.num_pages - self.available

    @property
    def cached_pages(self) -> int:
        return len(self.by_page)

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page_size)

    # ------------------------------------------------------------------ a slot's pages
    def lookup(self, tokens: tuple[int, ...]) -> PageHit | None:
        """The indexed pages the tokens begin with, up to their last token (whose logits its request needs from
        its own prefill), or None."""
        if not self.caching:
            return None
        size, limit = self.page_size, len(tokens) - 1
        pages, chains, features = [], [], []
        parent = ROOT
        while (len(pages) + 1) * size <= limit:
            k = len(pages)
            entry = self.by_key.get((parent, tokens[k * size:(k + 1) * size]))
            if entry is None:
                break
            pages.append(entry.page)
            chains.append(entry.chain)
            features.append(entry.features)
            parent = entry.chain
        rest = tokens[len(pages) * size:limit]
        partial, rows = None, 0
        siblings = self.children.get(parent, [])
        at = bisect.bisect_left(siblings, (rest,))
        for held, page in siblings[max(0, at - 1):at + 1]:  # the page after them its tokens begin with most of
            n = common_prefix(held, rest)
            if n > rows:
                partial, rows = self.by_page[page], n
        if not pages and partial is None:
            return None
        if partial is not None:
            features.append(None if partial.features is None else partial.features[:rows])
        return PageHit(pages, chains, [] if None in features else features, partial, rows)

    def assign(self, slot: int, hit: PageHit | None) -> int:
        """The slot starts with a hit's full pages (held) and its partial rows (copied into a page of its own, where
        the pool has one), or nothing. Returns the positions it reuses."""
        own = SlotPages()
        reused = 0
        if hit is not None:
            for page in hit.pages:
                self._hold(page)
            own.pages, own.chains = list(hit.pages), list(hit.chains)
            reused = len(hit.pages) * self.page_size
            if hit.partial is not None:
                taken = self._take(1)
                if taken is not None:  # (a page just evicted still holds its rows: copied before any write)
                    self.cache.copy_page(hit.partial.page, taken[0], hit.rows)
                    own.pages += taken
                    reused += hit.rows
        self.slots[slot] = own
        self.cache.set_pages(slot, own.pages)
        return reused

    def grow(self, slot: int, positions: int) -> bool:
        """The slot's pages cover its first `positions` positions (at most the cache's capacity); False, with
        nothing taken, where the pool has too few pages."""
        own = self.slots[slot]
        wanted = self.pages_for(min(positions, self.cache.capacity)) - len(own.pages)
        if wanted <= 0:
            return True
        taken = self._take(wanted)
        if taken is None:
            return False
        own.pages += taken
        self.cache.set_pages(slot, own.pages)
        return True

    def release(self, slot: int) -> None:
        """The slot's pages returned, its last first (so that a chain's tail is evicted before its head)."""
        own = self.slots.pop(slot, None)
        for page in reversed(own.pages if own is not None else []):
            self._drop(page)

    def retake(self, slot: int, pages: list[int], chains: list[int]) -> None:
        """A step that raised is undone for a request that ended in it: the slot holds its pages again (released in
        that step, never given out since) with the chains it had, and index entries made of its later pages since
        are dropped (their positions will be written again)."""
        for page in pages:
            if self.holders[page] == 0 and page not in self.evictable:
                self.free.remove(page)
            self._hold(page)
        for page in pages[len(chains):]:
            entry = self.by_page.get(page)
            if entry is not None:
                self._unindex(entry)
        self.slots[slot] = SlotPages(list(pages), list(chains))
        self.cache.set_pages(slot, pages)

    def unindexed(self, slot: int) -> int:
        """The first of the slot's pages the index has not seen."""
        return len(self.slots[slot].chains)

    def snapshot(self, slot: int) -> tuple[list[int], list[int]]:
        own = self.slots[slot]
        return list(own.pages), list(own.chains)

    def index(self, slot: int, tokens: tuple[int, ...], features: list[torch.Tensor] | None,
              last: bool = False) -> None:
        """The slot's positions 0..len(tokens)-1 hold these committed tokens (features: the drafter's rows of at
        least those positions, in chunks, or None): its full pages not yet seen are indexed (a page whose tokens
        another page holds already stays unindexed; its chain is the other's). last: the request ends, so its
        last page, partly filled, is indexed too (nobody writes it any more), if it holds KEEP_AT_LEAST tokens in
        all (a readiness probe's few tokens every 2 s are not kept)."""
        if not self.caching:
            return
        own, size = self.slots[slot], self.page_size
        for k in range(len(own.chains), min(len(tokens) // size, len(own.pages))):
            entry = self._index_page(own, k, tokens[k * size:(k + 1) * size], features)
            own.chains.append(entry.chain)
        k = len(tokens) // size
        if last and len(tokens) >= KEEP_AT_LEAST and len(own.chains) == k < len(own.pages) and len(tokens) > k * size \
                and self.holders[own.pages[k]] == 1 and own.pages[k] not in self.by_page:
            self._index_page(own, k, tokens[k * size:], features)

    def _index_page(self, own: SlotPages, k: int, tokens: tuple[int, ...], features) -> PageEntry:
        """Page k of a slot, holding these tokens, into the index (or the entry that holds them already)."""
        parent = own.chains[k - 1] if k else ROOT
        entry = self.by_key.get((parent, tokens))
        if entry is None:
            start = k * self.page_size
            rows = None if features is None else chunk_rows(features, start, start + len(tokens))
            entry = PageEntry(self.next_chain, parent, tokens, own.pages[k], rows)
            self.next_chain += 1
            self.by_key[entry.key] = entry
            self.by_page[entry.page] = entry
            bisect.insort(self.children.setdefault(parent, []), (tokens, entry.page))
            self.cached_tokens += len(tokens)
        return entry

    def _unindex(self, entry: PageEntry) -> None:
        del self.by_key[entry.key]
        del self.by_page[entry.page]
        siblings = self.children[entry.parent]
        siblings.pop(bisect.bisect_left(siblings, (entry.tokens, entry.page)))
        if not siblings:
            del self.children[entry.parent]
        self.cached_tokens -= len(entry.tokens)
        if entry.page in self.evictable:  # held by nobody: free now
            del self.evictable[entry.page]
            self.free.append(entry.page)

    # ------------------------------------------------------------------ the pool
    def _take(self, count: int) -> list[int] | None:
        if count > self.available:
            return None
        taken = []
        while len(taken) < count:
            if self.free:
                page = self.free.pop()
            else:  # the least recently used cached page, out of the index
                page = next(iter(self.evictable))
                self._unindex(self.by_page[page])
                self.free.pop()  # (_unindex freed it)
            self.holders[page] = 1
            taken.append(page)
        fresh = [page for page in taken if not self.given[page]]
        if fresh:
            self.cache.clear_pages(fresh)
            for page in fresh:
                self.given[page] = 1
        return taken

    def _hold(self, page: int) -> None:
        if self.holders[page] == 0:
            self.evictable.pop(page, None)
        self.holders[page] += 1

    def _drop(self, page: int) -> None:
        self.holders[page] -= 1
        if self.holders[page] == 0:
            if page in self.by_page:
                self.evictable[page] = None
            else:
                self.free.append(page)


def chunk_rows(chunks: list[torch.Tensor], start: int, end: int) -> torch.Tensor:
    """Rows start..end-1 of the chunks joined (a copy; only the chunks that hold them are read)."""
    parts, at = [], 0
    for chunk in chunks:
        low, high = max(start, at), min(end, at + len(chunk))
        if low < high:
            parts.append(chunk[low - at:high - at])
        at += len(chunk)
        if at >= end:
            break
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()
