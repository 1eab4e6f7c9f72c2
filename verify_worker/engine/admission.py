"""Admission: a request validated again (after the gateway), queued, aborted; the lowest free cache slot."""

import heapq

from shared.channel_gateway import MAX_TOP_LOGPROBS
from shared.errors import RequestError
from shared.grammar_matcher import GrammarMatcher
from shared.request_limits import is_int64
from shared.sampling_params import SamplingParams
from verify_worker.request import GenerationRequest, RequestState


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
        vocab = self.target.config.vocab_size
        if not request.prompt_ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in request.prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]!r} is outside the vocabulary (size {vocab})")
        if not isinstance(request.max_tokens, int) or isinstance(request.max_tokens, bool) or request.max_tokens < 0:
            raise RequestError(f"max_tokens must be an integer >= 0 (0: prefill only, e.g. to score the prompt), "
                               f"got {request.max_tokens!r}")
        total = len(request.prompt_ids) + request.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({len(request.prompt_ids)} tokens) plus max_tokens ({request.max_tokens}) exceeds the "
                f"maximum model length {self.max_model_len}"
            )
        spec = request.num_speculative_tokens
        if spec is not None and (not is_int64(spec) or spec < 0):
            raise RequestError(f"num_speculative_tokens must be an integer from 0 to 2**63 - 1, got {spec!r}")
        if not all(is_int64(t) for t in request.stop_token_ids):
            raise RequestError("stop token ids must be 64-bit integers")
        least = request.min_tokens
        if not is_int64(least) or not 0 <= least <= request.max_tokens:
            raise RequestError(f"min_tokens must be an integer from 0 to max_tokens ({request.max_tokens}), "
                               f"got {least!r}")
        end = request.thinking_end
        if end is not None and not (len(end) == 2 and all(is_int64(v) for v in end) and end[0] >= 0
                                    and 0 <= end[1] < vocab):
            raise RequestError(f"thinking_end must be (a budget >= 0, a token id below {vocab}), got {end!r}")
        if not isinstance(request.sampling, SamplingParams):
            raise RequestError("sampling must be SamplingParams")
        top = request.logprobs
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise RequestError(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top!r}")
        if request.prompt_logprobs and top is None:
            raise RequestError("prompt log-probabilities need logprobs (a count of alternatives, 0-20)")

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
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling)

    def _take_slot(self) -> int:
        """The lowest free cache slot: running requests then hold few, low slots, so that a batch sorted by slot
        is often a consecutive run, whose cache rows attention reads as a view (other batches gather a copy of
        every layer's keys and values: 39 MB per step for 16 demo requests at 300 positions)."""
        return heapq.heappop(self.free_slots)  # free_slots is a heap: an engine may hold thousands of slots
