"""Output: committed tokens up to a stop token or max_tokens, their log-probabilities and the prompt's, and a
finished request's slot and drafter context freed."""

import heapq
import time

import torch

from shared.proposals import ProposerUnavailable
from verify_worker.logprobs import TokenLogprob, token_logprobs
from verify_worker.request import RequestState, Status, StepEvent, StepReport


class Output:
    """The engine's commits (a part of SpeculativeEngine)."""

    def _score_prompt(self, state: RequestState, hidden: torch.Tensor, floats_at_once: int = 1 << 24) -> None:
        """Log-probabilities of the prompt tokens that this chunk's rows (hidden [n, H], from position
        state.prefilled) predict, in slices of [rows, vocab] float32 logits of at most 64 MB (110 rows of a
        152k vocabulary, 4096 of the demo's)."""
        rows_at_once = max(1, floats_at_once // self.target.config.vocab_size)
        start, prompt = state.prefilled, state.request.prompt_ids
        rows = min(len(hidden), len(prompt) - 1 - start)  # the last prompt row predicts the first output token
        for first in range(0, rows, rows_at_once):
            last = min(rows, first + rows_at_once)
            tokens = list(prompt[start + first + 1: start + last + 1])
            state.prompt_logprobs += token_logprobs(self.target.logits(hidden[first:last]), tokens,
                                                    state.request.logprobs)

    @staticmethod
    def _logprobs(state: RequestState, logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob] | None:
        """The tokens' log-probabilities from their target logits [len(tokens), vocab], if the request asked."""
        top = state.request.logprobs
        return None if top is None else token_logprobs(logits, tokens, top)

    def _commit_block(self, states, drafts, counts, out, logits, accepted, next_tokens, events: dict,
                      report: StepReport, kept: dict[int, int]) -> list[int]:
        """Each row keeps its accepted drafts and the next token (the rest of its block is rolled back by length,
        or by the family's commit); returns the tokens each row committed."""
        n = drafts.shape[1]
        report.decode_requests = len(states)
        report.drafted_at, report.accepted_at = [0] * n, [0] * n
        committed_in_step = []
        started = time.perf_counter()  # cache work: lengths (rollback), drafter context features, commits, frees
        for row, state in enumerate(states):
            a = accepted[row]
            state.cache_len += a + 1
            kept[state.slot] = kept.get(state.slot, 0) + a + 1  # after this step's prompt chunk, if any
            if self.proposer is not None:
                state.feature_chunks.append(out.taps[row, : a + 1].clone())
            tokens = drafts[row, :a].tolist() + [next_tokens[row]]
            committed = self._commit(state, tokens, events, self._logprobs(state, logits[row, : a + 1], tokens))
            committed_in_step.append(committed)
            state.stats.record(counts[row], min(a, committed), committed)
            report.draft_tokens += counts[row]
            report.accepted_tokens += min(a, committed)
            for i in range(counts[row]):
                report.drafted_at[i] += 1
                report.accepted_at[i] += i < min(a, committed)
        report.seconds["cache"] += time.perf_counter() - started
        return committed_in_step

    def _commit(self, state: RequestState, tokens: list[int], events: dict,
                logprobs: list[TokenLogprob] | None = None) -> int:
        """Append tokens up to a stop token or max_tokens (and their log-probabilities, when asked for); finish
        the request if it ended. Returns the count kept."""
        kept = []
        for token in tokens[: state.remaining]:
            kept.append(token)
            if token in state.request.stop_token_ids:
                state.finish_reason = "stop"
                break
        if state.grammar is not None and state.grammar.take(kept) < len(kept):
            raise RuntimeError(f"a committed token the grammar refuses (of {kept}): its masks and state disagree")
        state.output_ids.extend(kept)
        if state.finish_reason is None and state.remaining == 0:
            state.finish_reason = "length"
        event = events.setdefault(state.request_id, StepEvent(state.request_id, [], None))
        event.new_token_ids.extend(kept)
        event.stats = state.stats
        if logprobs is not None:
            state.logprobs.extend(logprobs[: len(kept)])
            event.logprobs = (event.logprobs or []) + logprobs[: len(kept)]
        if state.finish_reason is not None:
            event.finish_reason = state.finish_reason
            del self.running[state.request_id]
            self._free(state, state.finish_reason)
        return len(kept)

    def _keep_prefix(self, state: RequestState, reason: str) -> None:
        """A freed slot keeps the tokens its positions 0..cache_len-1 hold (the prompt and the output but its last
        token, whose KV no step wrote), with the drafter's rows of them; a failed request's slot keeps nothing."""
        if reason == "error" or state.cache_len == 0:
            self.prefix_cache.forget(state.slot)
            return
        tokens = (state.request.prompt_ids + tuple(state.output_ids))[:state.cache_len]
        features = None
        if self.proposer is not None:
            features = torch.cat(state.feature_chunks)[:len(tokens)] if state.feature_chunks else None
            if features is None or len(features) < len(tokens):
                self.prefix_cache.forget(state.slot)
                return
        self.prefix_cache.store(state.slot, tokens, features)

    def _free(self, state: RequestState, reason: str) -> None:
        state.status = Status.FINISHED
        state.finish_reason = state.finish_reason or reason
        if self.prefix_cache is not None and state.slot >= 0:
            self._keep_prefix(state, reason)
        if self.pages is not None and state.slot >= 0:  # its full pages stay indexed; a failed request's do not
            if reason != "error":
                self._index_pages(state, last=True)
            self.pages.release(state.slot)
        state.feature_chunks = []
        if state.slot >= 0:
            heapq.heappush(self.free_slots, state.slot)
            state.slot = -1
        if self.policy is not None:
            self.policy.forget(state.request_id)
        if self.proposer is not None:
            try:
                self.proposer.release(state.request_id)
            except ProposerUnavailable:
                pass  # a restarted drafter holds nothing for this request anyway
