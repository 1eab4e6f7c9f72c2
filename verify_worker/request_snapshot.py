"""A request's bookkeeping saved before an engine step, so that a step that raises can be undone for it.

Everything a step changes on a request only grows (outputs, feature chunks, log-probabilities) or is a
scalar, so a snapshot is a handful of lengths and values, cheap enough to take every step. The KV cache needs
nothing: it is written by absolute position, and positions past the restored cache length are never attended
and are simply written again. The drafter's copy of the context is not restored: the request resends it
from position 0 with its next draft call (the drafter's own random stream goes on: its draws stay fresh).
"""

from dataclasses import dataclass

import torch

from verify_worker.request import RequestState, RequestStats, Status


@dataclass
class RequestSnapshot:
    state: RequestState
    status: Status
    slot: int
    cache_len: int
    outputs: int
    finish_reason: str | None
    chunks: list  # the feature chunk list itself (a freed request gets a new, empty one)
    num_chunks: int
    logprobs: int
    prompt_logprobs: int
    stats: tuple  # RequestStats.saved()
    generator_state: torch.Tensor | None  # the verifier's random stream (sampled requests only): draws of an
    # undone step are drawn again, so plain decoding of a seeded request is the same whatever failed beside it
    grammar_tokens: int = 0  # tokens its grammar state had taken
    pages: tuple | None = None  # a paged cache's (pages, chains) of its slot (engine/page_tables.py)
    rebuild: tuple | None = None  # the tokens a preempted request was rebuilding

    @classmethod
    def take(cls, state: RequestState, pages: tuple | None = None) -> "RequestSnapshot":
        stats = state.stats.saved()
        generator = None if state.request.sampling.greedy else state.generator.get_state()
        return cls(state, state.status, state.slot, state.cache_len, len(state.output_ids), state.finish_reason,
                   state.feature_chunks, len(state.feature_chunks), len(state.logprobs), len(state.prompt_logprobs),
                   stats, generator, len(state.grammar.recorded) if state.grammar else 0, pages, state.rebuild)

    def restore(self) -> None:
        """Put the request's own fields back (the engine puts it back into its queues and its slot)."""
        state = self.state
        state.status, state.slot, state.cache_len, state.finish_reason = (self.status, self.slot, self.cache_len,
                                                                          self.finish_reason)
        state.rebuild = self.rebuild
        del state.output_ids[self.outputs:]
        del self.chunks[self.num_chunks:]
        state.feature_chunks = self.chunks
        del state.logprobs[self.logprobs:]
        del state.prompt_logprobs[self.prompt_logprobs:]
        state.stats = RequestStats.restored(self.stats)
        if self.generator_state is not None:
            state.generator.set_state(self.generator_state)
        if state.grammar is not None:
            state.grammar.undo(len(state.grammar.recorded) - self.grammar_tokens)
        state.resend_features()  # the drafter may hold part of the undone step: send it everything again
