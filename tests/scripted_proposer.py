"""A stand-in drafter for greedy-identity tests: the reference continuation with random corruptions."""

import random

import torch

from shared.proposals import DraftItem, DraftResult


class ScriptedProposer:
    """A stand-in drafter that knows the reference greedy continuation and proposes it with random
    corruptions, so verification sees long accepted prefixes, partial rejections and full acceptance.
    It also checks the engine's context bookkeeping: features arrive contiguous and the anchor matches."""

    def __init__(self, sequences: dict[str, list[int]], block_size: int, num_layers: int, error_rate=0.2):
        self.sequences, self.block_size, self.error_rate = sequences, block_size, error_rate
        self.target_layer_ids, self.num_target_layers = (1, 2), num_layers
        self.received: dict[str, int] = {}
        self.rng = random.Random(0)

    def propose(self, items: list[DraftItem]) -> list[DraftResult]:
        results = []
        for item in items:
            assert item.context_start == self.received.get(item.request_id, 0)
            self.received[item.request_id] = item.context_start + len(item.context_features)
            anchor_position = self.received[item.request_id]
            seq = self.sequences[item.request_id]
            assert anchor_position < len(seq) and 1 <= item.num_draft < self.block_size
            tokens = []
            for j in range(1, item.num_draft + 1):
                truth = seq[anchor_position + j] if anchor_position + j < len(seq) else 0
                tokens.append((truth + 1) % 128 if self.rng.random() < self.error_rate else truth)
            results.append(DraftResult(tokens=torch.tensor(tokens)))
        return results

    def release(self, request_id: str) -> None:
        self.received.pop(request_id, None)
