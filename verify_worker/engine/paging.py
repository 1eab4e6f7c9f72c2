"""Paging: where the target's KV cache is paged (engine/page_tables.py owns the pool), a request is admitted while
the pool has pages for its prompt, each step's writes get their pages before it runs, and where the pool runs out
the newest request is preempted: its pages returned (the full ones stay indexed for prefix caching), it waits at
the head of the queue, and when admitted again prefills its committed tokens (the prefix cache gives back what
was not evicted) and decodes on. Its outputs, feature rows, log-probabilities and drafter context are kept, so
its tokens are those it would have produced without the preemption."""

import heapq

from verify_worker.request import RequestState, Status
from verify_worker.scheduler import plan_prefill


class Paging:
    """The engine's paging (a part of SpeculativeEngine; self.pages: its PageTables, or None for a cache of a
    slot a request)."""

    def _fits_pages(self, state: RequestState) -> bool:
        """Whether the pool has pages for the request's prompt and a block beyond it (those it finds indexed taken
        into account), beside what the requests admitted before it still want: a prefilling one its prompt's
        pages and a block, a decoding one a page of growth."""
        if self.pages is None:
            return True
        tables = self.pages
        hit = None if state.request.prompt_logprobs else tables.lookup(state.prefill_ids)
        found = hit.pages if hit is not None else []
        wanted = tables.pages_for(len(state.prefill_ids) + self.block_size) - len(found)
        evictable_found = sum(page in tables.evictable for page in found)  # (taken off the evictable by the hit)
        promised = len(self.running) + sum(
            max(0, tables.pages_for(len(s.prefill_ids) + self.block_size) - len(tables.slots[s.slot].pages))
            for s in self.prefilling)
        return tables.available - evictable_found >= wanted + promised

    def _reserve_pages(self) -> None:
        """Pages for every position this step may write: each prompt chunk planned (and a block past it: a prompt
        that ends decodes in the same step) and each running request's block, oldest request first; where the pool
        runs out, the newest request holding pages is preempted until they fit."""
        chunks = plan_prefill(self.prefilling, self.max_prefill_tokens, self.prefill_align)
        needs = [(s, s.prefilled + n + self.block_size) for s, n in chunks]
        needs += [(s, s.cache_len + self.block_size) for s in self.running.values()]
        for state, positions in sorted(needs, key=lambda need: need[0].admitted):
            while state.slot >= 0 and not self.pages.grow(state.slot, positions):
                self._preempt(max([*self.running.values(), *self.prefilling], key=lambda s: s.admitted))

    def _cover_pages(self, slots: list[int], ends: list[int]) -> None:
        """Each slot's pages cover its positions below its end before a forward writes them (they were reserved
        for the step: a slot without them would write into the scratch page, so that is an error, never a
        silent one)."""
        if self.pages is None:
            return
        for slot, end in zip(slots, ends):
            if not self.pages.grow(slot, end):
                raise RuntimeError(f"slot {slot} has no KV pages for positions up to {end} (the step reserved "
                                   f"fewer than it writes)")

    def _preempt(self, state: RequestState) -> None:
        """Out of the batch and back to the head of the queue, its pages returned: a decoding request rebuilds
        its committed positions when admitted again; a prefilling one starts its prompt again."""
        self.log.info("KV pool out of pages: request %s preempted at %d positions (it waits, then prefills them "
                      "again)", state.request_id, state.cache_len)
        self.preemptions += 1
        self._index_pages(state, last=True)
        if state.status == Status.RUNNING:
            del self.running[state.request_id]
            state.rebuild = (state.request.prompt_ids + tuple(state.output_ids))[:state.cache_len]
        else:
            self.prefilling.remove(state)
            if state.rebuild is None:  # a prompt starts again: what its prefill gave so far goes
                state.feature_chunks, state.prompt_logprobs = [], []
                state.stats.cached_tokens = 0
        self.pages.release(state.slot)
        heapq.heappush(self.free_slots, state.slot)
        state.slot, state.cache_len, state.status = -1, 0, Status.WAITING
        self.waiting.insert(0, state)

    def _index_pages(self, state: RequestState, last: bool = False) -> None:
        """The request's full pages of committed tokens into the prefix index (with the drafter's rows of them);
        last: it leaves its pages, so its last page, partly filled, too."""
        tables = self.pages
        if not tables.caching or (not last and state.cache_len // tables.page_size <= tables.unindexed(state.slot)):
            return
        length = state.cache_len
        features = None
        if self.proposer is not None:
            features = state.feature_chunks
            length = min(length, sum(len(chunk) for chunk in features))
        tokens = (state.request.prompt_ids + tuple(state.output_ids))[:length] if state.rebuild is None \
            else state.rebuild[:length]
        tables.index(state.slot, tokens, features, last)

    def _index_step(self) -> None:
        """After a step: every request's newly full pages indexed."""
        for state in [*self.running.values(), *self.prefilling]:
            self._index_pages(state)
