"""The proposer interface: what the verifier sends the drafter each step and what it gets back.

Implemented in-process by draft_worker.local_proposer.LocalProposer; a later remote implementation speaks
the same types over ZeroMQ.
"""

from dataclasses import dataclass
from typing import Protocol

import torch

from shared.sampling_params import SamplingParams


@dataclass
class DraftItem:
    """One request's part of a draft call.

    context_features rows are the tapped target features of positions
    context_start .. context_start + n_new - 1 (committed since the previous call); the anchor token (last
    committed token) sits at the next position.
    """

    request_id: str
    context_start: int
    context_features: torch.Tensor  # [n_new, num_taps * hidden]
    anchor_token: int
    num_draft: int  # tokens wanted, 1 .. block_size - 1
    sampling: SamplingParams
    seed: int
    # a constrained request's grammar (llguidance's text), sent where the drafter must build its copy of the state
    # anew (the first call, or after the context was resent); its output tokens from grammar_start on (the ones
    # committed since the drafter's copy last took tokens), for a drafter that masks grammars (masks_grammars)
    grammar: str | None = None
    grammar_start: int = 0
    grammar_tokens: tuple[int, ...] = ()


@dataclass
class DraftResult:
    """Proposed tokens and, when they were sampled, exactly the distribution each was drawn from.

    q_probs None: deterministic proposal (verified as a point mass).
    q_ids None with q_probs [n, vocab]: dense q. q_ids [n, K] with q_probs [n, K]: sparse q on K candidates.
    """

    tokens: torch.Tensor | None  # [n] int64; None: the proposer lacks this request's context, resend it all
    q_probs: torch.Tensor | None = None
    q_ids: torch.Tensor | None = None


class ProposerUnavailable(Exception):
    """The proposer cannot answer now (dead, restarting, timed out): decode this step without drafts."""


class Proposer(Protocol):
    block_size: int  # tokens per verify block: the anchor plus up to block_size - 1 drafts
    target_layer_ids: tuple[int, ...]  # target layers whose outputs form the context features
    num_target_layers: int  # the target depth the drafter was built for

    def propose(self, items: list[DraftItem]) -> list[DraftResult]:
        """One result per item, in order. May raise ProposerUnavailable."""
        ...

    def release(self, request_id: str) -> None: ...
