"""Admission: a request checked (shared/generation_request.check_request, as the gateway did), queued,
aborted; its cache slot (a kept or running prefix reused where one begins its prompt: prefix_cache.py, else the
lowest free slot) or, where the cache is paged, its slot and the indexed pages its prompt begins with
(page_tables.py)."""

import heapq

import torch

from shared.errors import RequestError
from shared.generation_request import GenerationRequest, ModelBounds, check_request
from shared.grammar_matcher import GrammarMatcher
from verify_worker.engine.prefix_cache import PrefixHit
from verify_worker.request import RequestState, Status


class Admission:
    """The engine's admission (a part of SpeculativeEngine: its queues and slots are the engine's fields)."""

    def add(self, request: GenerationRequest, grammar: GrammarMatcher | None = None) -> RequestState:
        """grammar: the request's grammar state built already (off the step: the verify server builds it in a
        thread); else built here from request.grammar."""
        self.validate(request)
        state = RequestState.create(request)
        if request.grammar is not None:
            state.grammar = grammar or self.build_grammar(request.grammar)
        self.waiting.append(state)
        return state

    def build_grammar(self, grammar: str) -> GrammarMatcher:
        """A fresh matcher of the grammar over this target's vocabulary (RequestError where it does not compile)."""
        if self.grammar_vocabulary is None:
            raise RequestError("this server has no tokenizer.json for its target: grammars cannot be served")
        try:
            return self.compiled_grammars.matcher(grammar)
        except ValueError as exc:
            raise RequestError(f"the grammar does not compile: {exc}") from None

    def validate(self, request: GenerationRequest) -> None:
        """The request's values against this target (RequestError naming the first this model cannot serve)."""
        check_request(request, ModelBounds(self.target.config.vocab_size, self.max_model_len))

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its cache slot and drafter context are freed at once."""
        state = self.running.pop(request_id, None)
        for queue in (self.waiting, self.prefilling):
            if state is None:
                state = next((s for s in queue if s.request_id == request_id), None)
                if state is not None:
                    queue.remove(state)
        if state is None:
            return False
        self._free(state, "abort")
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def kept_prefix_tokens(self) -> int:
        """Tokens kept for later prompts: the indexed pages' (a paged cache), or the free slots' prefixes."""
        if self.pages is not None:
            return self.pages.cached_tokens
        return self.prefix_cache.cached_tokens if self.prefix_cache is not None else 0

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling)

    def _admit(self, state: RequestState) -> None:
        """state takes a free slot and starts prefilling. Where a kept prefix, or a running request's committed
        prompt, begins its prompt (the longest), its prefill starts past it, the drafter's rows of it kept: in a
        slot holding nothing that the prefix is copied into (the family copies, one is free: a kept prefix stays
        kept), else in the kept slot itself (a running request's prefix is only copied). Otherwise it takes a slot
        holding no prefix, else the least recently used one's."""
        self.admissions += 1
        state.admitted = self.admissions
        if self.pages is not None:
            self._admit_paged(state)
            return
        cache, hit = self.prefix_cache, None
        copy = getattr(self.target, "copy_prefix", None)  # a tensor-parallel leader has none: the slot moves
        empty = None if cache is None or copy is None else cache.empty_slot(self.free_slots)
        if cache is not None and not state.request.prompt_logprobs:  # a scored prompt needs its every row
            self.prefix_query_tokens += len(state.request.prompt_ids)
            hit = cache.lookup(state.request.prompt_ids)
            if empty is not None:  # a running request's committed prompt may begin this one further
                hit = self._live_prefix(state.request.prompt_ids, hit)
        if hit is None:
            slot = self._take_slot() if cache is None else self._take_free(cache.evictable(self.free_slots))
            self.target.reset(self.state, slot)
        else:
            if empty is None:
                slot = self._take_free(hit.slot)
            else:
                slot = self._take_free(empty)
                self.target.reset(self.state, slot)
                copy(self.state, hit.slot, slot, hit.tokens)
                if hit.kept:
                    cache.touch(hit.slot)
            state.cache_len = state.stats.cached_tokens = hit.tokens
            if hit.features is not None:
                state.feature_chunks = [hit.features]
            self.prefix_hit_tokens += hit.tokens
        state.slot, state.status = slot, Status.PREFILLING
        self.prefilling.append(state)

    def _admit_paged(self, state: RequestState) -> None:
        """state takes the lowest free slot, with the indexed pages its tokens begin with (engine/page_tables.py):
        its prefill starts past them, the drafter's rows of them kept."""
        slot = self._take_slot()
        self.target.reset(self.state, slot)
        ids = state.prefill_ids
        hit = None if state.request.prompt_logprobs else self.pages.lookup(ids)
        tokens = self.pages.assign(slot, hit)
        if state.rebuild is None:
            self.prefix_query_tokens += len(ids) if self.pages.caching and not state.request.prompt_logprobs else 0
        if tokens:
            state.cache_len = tokens
            if state.rebuild is None:  # (a rebuild keeps its own feature rows)
                state.stats.cached_tokens = tokens
                self.prefix_hit_tokens += tokens
                if self.proposer is not None:
                    state.feature_chunks = list(hit.features)
        state.slot, state.status = slot, Status.PREFILLING
        self.prefilling.append(state)

    def _live_prefix(self, prompt: tuple[int, ...], hit: PrefixHit | None) -> PrefixHit | None:
        """hit, or a running (or prefilling) request's committed prompt positions where they begin prompt further:
        they are final (later writes go past them), so they may be copied between steps (two requests of one
        system prompt, the second arriving while the first runs)."""
        source, longest = None, hit.tokens if hit is not None else 0
        for other in [*self.running.values(), *self.prefilling]:
            length = self.prefix_cache.reusable(other.request.prompt_ids[:other.prefilled], prompt)
            if length > longest:
                source, longest = other, length
        if source is None:
            return hit
        features = torch.cat(source.feature_chunks)[:longest] if self.proposer is not None else None
        return PrefixHit(source.slot, longest, features, kept=False)

    def _take_free(self, slot: int) -> int:
        """A given free slot, out of the heap (its cached prefix, if any, forgotten)."""
        self.free_slots.remove(slot)
        heapq.heapify(self.free_slots)
        if self.prefix_cache is not None:
            self.prefix_cache.forget(slot)
        return slot

    def _take_slot(self) -> int:
        """The lowest free cache slot: running requests then hold few, low slots, so that a batch sorted by slot
        is often a consecutive run, whose cache rows attention reads as a view (other batches gather a copy of
        every layer's keys and values: 39 MB per step for 16 demo requests at 300 positions)."""
        return heapq.heappop(self.free_slots)  # free_slots is a heap: an engine may hold thousands of slots
