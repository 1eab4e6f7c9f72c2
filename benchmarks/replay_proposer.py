"""A benchmark-only drafter: it proposes the target's own greedy continuation, recorded beforehand, with the draft
after the first `acceptance - 1` of each block made wrong, so every verify step commits `acceptance` tokens (the
accepted drafts and the target's own token) until a block would pass the end. Random targets make random drafters
accept nothing; with this one a speculative run of a random target measures what a drafter of that acceptance
length would give, through the whole engine (taps, draft calls, verify blocks, commits, rollbacks)."""

import torch

from shared.proposals import DraftItem, DraftResult


class ReplayProposer:
    def __init__(self, continuations: dict[str, list[int]], acceptance: int, block_size: int, num_target_layers: int,
                 vocab_size: int, target_layer_ids: tuple[int, ...] = (0,)):
        """continuations: request id -> its prompt and the target's plain greedy output; acceptance: tokens each
        verify step should commit (1 .. block_size)."""
        if not 1 <= acceptance <= block_size:
            raise ValueError(f"acceptance {acceptance} must be within 1 .. block size {block_size}")
        self.continuations, self.acceptance, self.vocab_size = continuations, acceptance, vocab_size
        self.block_size, self.num_target_layers, self.target_layer_ids = block_size, num_target_layers, target_layer_ids
        self.received: dict[str, int] = {}

    def propose(self, items: list[DraftItem]) -> list[DraftResult]:
        results = []
        for item in items:
            anchor = item.context_start + len(item.context_features)  # the anchor token's position
            self.received[item.request_id] = anchor
            sequence = self.continuations[item.request_id]
            truth = [sequence[p] if p < len(sequence) else 0 for p in range(anchor + 1, anchor + 1 + item.num_draft)]
            right = self.acceptance - 1  # drafts each step should accept
            if right < len(truth):
                truth[right] = (truth[right] + 1) % self.vocab_size
            results.append(DraftResult(tokens=torch.tensor(truth)))
        return results

    def release(self, request_id: str) -> None:
        self.received.pop(request_id, None)
