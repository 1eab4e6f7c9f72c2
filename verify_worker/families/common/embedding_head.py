"""The embedding and lm_head of a target whose modules are `model.embed_tokens` and `lm_head` (None when tied)."""

import torch


class EmbeddingHead:
    """Mixed into a family's nn.Module: what the drafter side (LocalProposer, the draft worker) reads."""

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_weight if self.lm_head is None else self.lm_head.weight
