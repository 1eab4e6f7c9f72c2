"""Grammar-constrained requests in a decode step: their drafts made to obey the grammar before the forward (a row
whose grammar forces its next tokens is proposed them instead of the drafter's, whatever the policy chose, unless a
drafter that masks grammars drafts it ("drafted" mode): forced tokens are always accepted; a block is cut at its
first refused draft), and the target's logits of every block position
masked to what the grammar allows after the drafts before it, so that greedy choice and rejection sampling see the
grammar's distribution: a refused draft has probability 0 and the token after the accepted prefix is always legal.
Exact: a forced position's masked distribution is a point mass, and a forced draft's proposal is a point mass on it
(q = p there)."""

import torch

from shared.grammar_matcher import allowed_tokens
from verify_worker.request import RequestState
from verify_worker.scheduler import num_drafts

# masks on the target only; drafts cut too; forced tokens too (a row the grammar forces is not drafted); "masked":
# as "forced", a drafter that masks grammars drafting under them; "drafted": such a drafter drafts forced rows too
# (forced tokens for the rows it does not draft)
GRAMMAR_DRAFTS = ("target", "cut", "forced", "masked", "drafted")
UNDER_GRAMMAR = ("masked", "drafted")  # the modes whose drafter drafts under the grammar


def forced_drafts(states: list[RequestState], block_size: int, mode: str,
                  rows: list[int] | None = None) -> dict[int, list[int]]:
    """In "forced", "masked" and "drafted" modes, each constrained row's tokens its grammar forces from the
    committed state (up to the drafts the row may take in a block of block_size), by row, among `rows` (None: all);
    rows with none are left out. Such a row's block is the forced tokens."""
    if mode not in ("forced", "masked", "drafted"):
        return {}
    found = {}
    for row in range(len(states)) if rows is None else rows:
        state = states[row]
        budget = num_drafts(state, block_size, True) if state.grammar is not None else 0
        tokens = state.grammar.forced()[:budget] if budget > 0 else []
        if tokens:
            found[row] = tokens
    return found


def grammar_drafts(states: list[RequestState], drafts: torch.Tensor, counts: list[int], forced: dict[int, list[int]],
                   mode: str) -> tuple[torch.Tensor, list[int]]:
    """drafts [b, n] and counts made to obey each constrained row's grammar: a row's forced tokens (forced_drafts)
    are its drafts, and in the other modes a block is cut at its first refused draft ("target" changes
    nothing: the masks alone reject refused drafts). A forced row's proposal stays None, a point mass on the draft."""
    counts = list(counts)
    width = max([drafts.shape[1], *(len(tokens) for tokens in forced.values())])
    if width > drafts.shape[1]:
        drafts = torch.cat([drafts, drafts.new_zeros(drafts.shape[0], width - drafts.shape[1])], dim=1)
    for row, tokens in forced.items():
        drafts[row, : len(tokens)] = torch.tensor(tokens, dtype=drafts.dtype)
        counts[row] = len(tokens)
    if mode != "target":
        for row, state in enumerate(states):
            if state.grammar is not None and counts[row]:
                counts[row] = state.grammar.legal_prefix(drafts[row, : counts[row]].tolist())
    return drafts[:, : max(counts, default=0)], counts


def mask_grammars(states: list[RequestState], drafts: torch.Tensor, counts: list[int],
                  logits: torch.Tensor) -> torch.Tensor:
    """logits [b, n+1, vocab] with every constrained row's positions masked (-inf) to what its grammar allows:
    position 0 after the committed tokens, position i after the first i drafts while they are legal (positions
    after a refused draft are never reached and stay as they are). In place, unless a masked request asked for
    log-probabilities (reported unmasked, as vLLM does): then on a copy."""
    rows = [r for r, s in enumerate(states) if s.grammar is not None]
    if not rows:
        return logits
    if any(states[r].request.logprobs is not None for r in rows):
        logits = logits.clone()
    positions, vocab = logits.shape[1], logits.shape[-1]
    words = max(states[r].grammar.words for r in rows)
    bitmask = torch.full((len(rows) * positions, words), -1, dtype=torch.int32)  # -1: every token (unreached)
    for i, r in enumerate(rows):
        states[r].grammar.block_masks(drafts[r, : counts[r]].tolist(), bitmask, i * positions)
    allowed = allowed_tokens(bitmask.to(logits.device), vocab).view(len(rows), positions, vocab)  # on the device
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits
