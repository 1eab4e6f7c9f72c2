"""The speculative engine: prefill, draft, verify, commit and roll back for a batch of requests.

One engine serves both placements: dflash-generate drives it with an in-process proposer, the verify worker
(later) with a remote one. Without a proposer, or with num_speculative_tokens 0, a step is plain decoding:
the same code path with zero drafts.
"""

import torch

from shared.errors import ConfigError, RequestError
from shared.proposals import DraftItem, Proposer
from shared.sampling import batch_sampling_probs, sample_from
from verify_worker.request import GenerationRequest, GenerationResult, RequestState, Status, StepEvent
from verify_worker.target_model import TargetModel
from verify_worker.verification import dense_proposal, verify_greedy, verify_sampled


class SpeculativeEngine:
    def __init__(
        self,
        target: TargetModel,
        proposer: Proposer | None = None,
        max_requests: int = 16,
        max_model_len: int | None = None,
    ):
        cfg = target.config
        self.target = target
        self.proposer = proposer
        self.block_size = proposer.block_size if proposer else 1
        if proposer is not None:
            if proposer.num_target_layers != cfg.num_layers:
                raise ConfigError(
                    f"the drafter was built for a target of {proposer.num_target_layers} layers; "
                    f"this target has {cfg.num_layers}"
                )
            if self.block_size < 2:
                raise ConfigError(f"block size must be >= 2, got {self.block_size}")
        self.tap_layers = tuple(proposer.target_layer_ids) if proposer else ()
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.cache = target.new_cache(max_requests, self.max_model_len + max(self.block_size, 1))
        self.free_slots = list(range(max_requests - 1, -1, -1))
        self.waiting: list[RequestState] = []
        self.running: dict[str, RequestState] = {}  # request id -> state, in admission order
        self.device = target.embed_weight.device

    # ------------------------------------------------------------------ admission
    def add(self, request: GenerationRequest) -> RequestState:
        self._validate(request)
        state = RequestState.create(request)
        self.waiting.append(state)
        return state

    def _validate(self, request: GenerationRequest) -> None:
        vocab = self.target.config.vocab_size
        if not request.prompt_ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in request.prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]!r} is outside the vocabulary (size {vocab})")
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {request.max_tokens!r}")
        total = len(request.prompt_ids) + request.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({len(request.prompt_ids)} tokens) plus max_tokens ({request.max_tokens}) exceeds the "
                f"maximum model length {self.max_model_len}"
            )
        spec = request.num_speculative_tokens
        if spec is not None and (not isinstance(spec, int) or spec < 0):
            raise RequestError(f"num_speculative_tokens must be an integer >= 0, got {spec!r}")

    def abort(self, request_id: str) -> bool:
        state = self.running.pop(request_id, None)
        if state is None:
            state = next((s for s in self.waiting if s.request_id == request_id), None)
            if state is None:
                return False
            self.waiting.remove(state)
        self._free(state, "abort")
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ stepping
    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        events: dict[str, StepEvent] = {}
        admitted = []
        while self.waiting and self.free_slots:
            state = self.waiting.pop(0)
            state.slot, state.status = self.free_slots.pop(), Status.RUNNING
            admitted.append(state)
        if admitted:
            self._prefill(admitted, events)
        decoding = list(self.running.values())
        if decoding:
            self._decode(decoding, events)
        return list(events.values())

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        states = [self.add(r) for r in requests]
        while self.has_work():
            self.step()
        return [GenerationResult(s.request_id, s.output_ids, s.finish_reason, s.stats) for s in states]

    def _prefill(self, states: list[RequestState], events: dict) -> None:
        lengths = [len(s.request.prompt_ids) for s in states]
        width = max(lengths)
        ids = torch.zeros(len(states), width, dtype=torch.long)
        for row, state in enumerate(states):
            ids[row, : lengths[row]] = torch.tensor(state.request.prompt_ids)
        positions = torch.arange(width)[None].expand(len(states), -1)  # [b, width]; padding sits past the prompt
        slots = torch.tensor([s.slot for s in states])
        out = self.target(ids.to(self.device), positions.to(self.device), self.cache, slots.to(self.device), self.tap_layers)
        last = torch.tensor(lengths, device=self.device) - 1
        logits = self.target.logits(out.hidden[torch.arange(len(states), device=self.device), last])  # [b, vocab]
        first = self._sample(states, logits[:, None])[:, 0]
        for row, state in enumerate(states):
            state.cache_len = lengths[row]
            if self.proposer is not None:
                state.pending_features.append(out.taps[row, : lengths[row]])
            self.running[state.request_id] = state
            self._commit(state, [int(first[row])], events)

    def _decode(self, states: list[RequestState], events: dict) -> None:
        num_drafts = [self._num_drafts(s) for s in states]
        drafts, q_rows = self._draft(states, num_drafts)  # [b, n]
        b, n = drafts.shape
        block = torch.cat([torch.tensor([[s.last_token] for s in states]), drafts], dim=1)  # [b, n+1]
        starts = torch.tensor([s.cache_len for s in states])
        positions = starts[:, None] + torch.arange(n + 1)  # [b, n+1]
        slots = torch.tensor([s.slot for s in states])
        out = self.target(block.to(self.device), positions.to(self.device), self.cache, slots.to(self.device), self.tap_layers)
        logits = self.target.logits(out.hidden)  # [b, n+1, vocab]
        accepted, next_tokens = self._verify(states, drafts.to(self.device), torch.tensor(num_drafts, device=self.device), q_rows, logits)
        for row, state in enumerate(states):
            a = int(accepted[row])
            state.cache_len += a + 1  # anchor and accepted drafts are now committed context
            if self.proposer is not None:
                state.pending_features.append(out.taps[row, : a + 1])
            tokens = drafts[row, :a].tolist() + [int(next_tokens[row])]
            committed = self._commit(state, tokens, events)
            state.stats.record(num_drafts[row], min(a, committed), committed)

    def _num_drafts(self, state: RequestState) -> int:
        if self.proposer is None:
            return 0
        limit = self.block_size - 1
        if state.request.num_speculative_tokens is not None:
            limit = min(limit, state.request.num_speculative_tokens)
        return max(0, min(limit, state.remaining - 1))

    def _draft(self, states: list[RequestState], num_drafts: list[int]):
        """Ask the proposer for drafts. Returns drafts [b, n] (zero-padded) and per-row dense q or None."""
        n = max(num_drafts)
        drafts = torch.zeros(len(states), n, dtype=torch.long)
        q_rows: list[torch.Tensor | None] = [None] * len(states)
        if n == 0:
            return drafts, q_rows
        rows = [r for r, k in enumerate(num_drafts) if k > 0]
        items = []
        for r in rows:
            state = states[r]
            features = torch.cat(state.pending_features) if state.pending_features else self._no_features()
            items.append(DraftItem(
                request_id=state.request_id, context_start=state.drafter_context_len, context_features=features,
                anchor_token=state.last_token, num_draft=num_drafts[r], sampling=state.request.sampling, seed=state.seed,
            ))
            state.drafter_context_len += len(features)
            state.pending_features = []
        vocab = self.target.config.vocab_size
        for r, result in zip(rows, self.proposer.propose(items)):
            drafts[r, : num_drafts[r]] = result.tokens.cpu()
            if not states[r].request.sampling.greedy:
                q_rows[r] = dense_proposal(result.tokens.to(self.device), vocab, result.q_probs, result.q_ids)
        return drafts, q_rows

    def _no_features(self) -> torch.Tensor:
        width = len(self.tap_layers) * self.target.config.hidden_size
        return torch.zeros(0, width, dtype=self.target.embed_weight.dtype, device=self.device)

    def _verify(self, states, drafts, num_drafts, q_rows, logits):
        """Greedy rows by prefix match, sampled rows by rejection sampling; returns (accepted, next) [b]."""
        accepted, next_tokens = verify_greedy(drafts, num_drafts, logits)
        sampled = [r for r, s in enumerate(states) if not s.request.sampling.greedy]
        if not sampled:
            return accepted, next_tokens
        b_s, n, vocab = len(sampled), drafts.shape[1], logits.shape[-1]
        probs = batch_sampling_probs(logits[sampled], [states[r].request.sampling for r in sampled])  # [s, n+1, vocab]
        q = torch.zeros(b_s, n, vocab, device=self.device)
        accept_u = torch.ones(b_s, n, dtype=torch.float64)
        sample_u = torch.zeros(b_s, dtype=torch.float64)
        for i, r in enumerate(sampled):
            k = int(num_drafts[r])
            if k:
                q[i, :k] = q_rows[r]
            draws = states[r].uniforms(k + 1)  # k acceptance tests, then one draw
            accept_u[i, :k], sample_u[i] = draws[:k], draws[k]
        acc_s, next_s = verify_sampled(
            drafts[sampled], num_drafts[sampled], probs, q, accept_u.to(self.device), sample_u.to(self.device)
        )
        index = torch.tensor(sampled, device=self.device)
        return accepted.index_copy(0, index, acc_s), next_tokens.index_copy(0, index, next_s)

    def _sample(self, states: list[RequestState], logits: torch.Tensor) -> torch.Tensor:
        """One token per row from logits [b, 1, vocab]: argmax for greedy rows, a draw for sampled rows."""
        tokens = logits.argmax(-1)  # [b, 1]
        sampled = [r for r, s in enumerate(states) if not s.request.sampling.greedy]
        if sampled:
            probs = batch_sampling_probs(logits[sampled], [states[r].request.sampling for r in sampled])  # [s, 1, vocab]
            draws = torch.stack([states[r].uniforms(1) for r in sampled]).to(self.device)  # [s, 1]
            tokens[sampled] = sample_from(probs, draws)
        return tokens

    # ------------------------------------------------------------------ bookkeeping
    def _commit(self, state: RequestState, tokens: list[int], events: dict) -> int:
        """Append tokens up to a stop token or max_tokens; finish the request if it ended. Returns the count kept."""
        kept = []
        for token in tokens[: state.remaining]:
            kept.append(token)
            if token in state.request.stop_token_ids:
                state.finish_reason = "stop"
                break
        state.output_ids.extend(kept)
        if state.finish_reason is None and state.remaining == 0:
            state.finish_reason = "length"
        event = events.setdefault(state.request_id, StepEvent(state.request_id, [], None))
        event.new_token_ids.extend(kept)
        if state.finish_reason is not None:
            event.finish_reason = state.finish_reason
            del self.running[state.request_id]
            self._free(state, state.finish_reason)
        return len(kept)

    def _free(self, state: RequestState, reason: str) -> None:
        state.status = Status.FINISHED
        state.finish_reason = state.finish_reason or reason
        if state.slot >= 0:
            self.free_slots.append(state.slot)
            state.slot = -1
        if self.proposer is not None:
            self.proposer.release(state.request_id)
