"""Drafts that obey a request's grammar: the drafter keeps its own copy of each constrained request's grammar state
(advanced by the committed tokens the verifier sends with each call) and chooses every drafted position under the
mask of the state its earlier drafts lead to, so it never proposes a token the grammar refuses; where the grammar
allows one token, that token is the draft. The state is restored after each call.

Exact whatever the drafter chooses: a greedy request's drafts are point masses, and a sampled request's q is the
distribution each token was drawn from (the drafter's own, masked and renormalised).
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from cuda_ext.dflash2_walk.op import walk
from shared.grammar_matcher import CompiledGrammars, GrammarMatcher, allowed_tokens
from shared.proposals import DraftItem, DraftResult
from shared.sampling import batch_sampling_probs, sample_from

# (position, its logits [V], the token before it, its grammar mask) -> (token or None where nothing is legal,
# q row or None, q ids or None)
Chooser = Callable[[int, torch.Tensor, int, "PositionMask"], tuple[int | None, torch.Tensor | None,
                                                                    torch.Tensor | None]]


class PositionMask:
    """What the grammar allows at one drafted position (the matcher's tentative state there): a token's legality
    without the whole mask, or the whole mask (as a tensor, or as a numpy array for the greedy choosers' few small
    operations), computed on first use."""

    def __init__(self, matcher: GrammarMatcher, words: torch.Tensor, vocab: int, device):
        self.matcher, self.words, self.vocab, self.device = matcher, words, vocab, device
        self._filled = False

    def legal(self, token: int) -> bool:
        return self.matcher.legal_prefix([token]) == 1

    def _fill(self) -> None:
        if not self._filled:
            self.matcher.fill(self.words, 0)
            self._filled = True

    def allowed(self) -> torch.Tensor:
        """[V] bool on the logits' device."""
        self._fill()
        return allowed_tokens(self.words.to(self.device), self.vocab)[0]

    def allowed_array(self) -> np.ndarray:
        """[V] bool."""
        self._fill()
        bits = np.unpackbits(self.words.numpy().view(np.uint8), bitorder="little").view(bool)  # bit j of word w: 32w+j
        return bits[: self.vocab] if len(bits) >= self.vocab else np.pad(bits, (0, self.vocab - len(bits)))

    def masked(self, logits: torch.Tensor) -> torch.Tensor | None:
        """logits [V] with what the grammar refuses at -inf; None where it allows nothing."""
        allowed = self.allowed()
        return logits.masked_fill(~allowed, float("-inf")) if bool(allowed.any()) else None



def top_legal(logits: np.ndarray, allowed: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k best of logits [V] that allowed [V] allows (fewer where fewer are), in no order."""
    legal = np.flatnonzero(allowed)
    if len(legal) <= k:
        return legal
    return legal[np.argpartition(logits[legal], -k)[-k:]]


@dataclass
class GrammarSync:
    """What a call did to a request's grammar copy: `matcher` to draft under (None: draft without a grammar), and
    `resync` where the copy and the verifier's disagree on the tokens taken (the request resends its context and
    its grammar from the start)."""

    matcher: GrammarMatcher | None
    resync: bool = False


class DraftGrammars:
    """The drafter's grammar state of each constrained request, by request id."""

    def __init__(self, vocabulary, log: logging.Logger | None = None):
        self.compiled = CompiledGrammars(vocabulary)  # over llguidance's LLTokenizer of the target's tokenizer
        self.matchers: dict[str, GrammarMatcher] = {}
        self.unusable: set[str] = set()  # requests whose grammar this drafter cannot follow: drafted without it
        self.log = log or logging.getLogger("dflash.draft")

    def sync(self, item: DraftItem) -> GrammarSync:
        """The request's state after the item's committed tokens: built anew from item.grammar where the item
        carries it (its first call, or a resent context), else the copy advanced from item.grammar_start."""
        rid = item.request_id
        if item.grammar is None and rid not in self.matchers or rid in self.unusable:
            return GrammarSync(None)
        if item.grammar is not None:
            try:
                self.matchers[rid] = self.compiled.matcher(item.grammar)
            except ValueError as exc:
                return self._give_up(rid, f"its grammar does not compile here: {exc}")
        matcher = self.matchers[rid]
        taken, tokens = len(matcher.recorded), list(item.grammar_tokens)
        if taken == item.grammar_start + len(tokens):  # already taken (a call retried request by request)
            return GrammarSync(matcher)
        if taken != item.grammar_start:
            del self.matchers[rid]
            return GrammarSync(None, resync=True)
        if matcher.take(tokens) < len(tokens):
            return self._give_up(rid, "its grammar refuses a committed token (another tokenizer?)")
        return GrammarSync(matcher)

    def _give_up(self, rid: str, why: str) -> GrammarSync:
        self.log.warning("request %s is drafted without its grammar: %s", rid, why)
        self.matchers.pop(rid, None)
        self.unusable.add(rid)
        return GrammarSync(None)

    def release(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        self.unusable.discard(request_id)


def masked_drafts(matcher: GrammarMatcher, logits: torch.Tensor, count: int, anchor: int,
                  choose: Chooser) -> DraftResult:
    """Up to `count` drafts from logits [n, V] (n >= count), position t chosen by `choose` under what the grammar
    allows after the drafts before it; it stops where the grammar allows nothing. q rows are stacked where the
    chooser gives them. The matcher's state is restored."""
    words = torch.empty(1, matcher.words, dtype=torch.int32)
    tokens, q_rows, q_ids, taken, previous = [], [], [], 0, anchor
    try:
        for t in range(count):
            token, q, ids = choose(t, logits[t], previous, PositionMask(matcher, words, logits.shape[-1],
                                                                        logits.device))
            if token is None or matcher.take([token]) < 1:
                break
            taken += 1
            tokens.append(token)
            q_rows.append(q)
            q_ids.append(ids)
            previous = token
    finally:
        matcher.undo(taken)
    result = DraftResult(tokens=torch.tensor(tokens, dtype=torch.long))
    if tokens and q_rows[0] is not None:
        result.q_probs, result.q_ids = stacked_q(q_rows, None if q_ids[0] is None else q_ids)
    return result


def stacked_q(rows: list[torch.Tensor], ids: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-position q rows (and their candidate ids, sparse) as [n, K] tensors; a sparse row with fewer candidates
    is padded with id 0 at probability 0 (the verifier's padding: it adds nothing)."""
    if ids is None:
        return torch.stack(rows), None
    width = max(len(row) for row in rows)
    q_probs = torch.zeros(len(rows), width, dtype=rows[0].dtype, device=rows[0].device)
    q_ids = torch.zeros(len(rows), width, dtype=torch.long, device=rows[0].device)
    for t, (row, row_ids) in enumerate(zip(rows, ids)):
        q_probs[t, : len(row)], q_ids[t, : len(row)] = row, row_ids
    return q_probs, q_ids


def walk_chooser(drafter, projected: torch.Tensor, logits: torch.Tensor, temperature: float,
                 uniforms: torch.Tensor | None, k: int) -> Chooser:
    """DFlash 2: the selector's walk, after the token chosen before, over each position's top k candidates.
    projected [n, r] (the selector's projection of the drafted rows), logits [n, V]. Greedy (uniforms None): the
    best-scored of the top k where the grammar allows it, else the best-scored of the top k tokens the grammar
    allows (numpy: a handful of small operations a position). Sampled (uniforms [n] float64): drawn by the walk
    over the top k tokens the grammar allows, q sparse over them."""
    selector = drafter.candidate_selector
    if uniforms is None:
        predecessor, successor = (c.detach().float().cpu().numpy() for c in (selector.predecessor_codebook,
                                                                            selector.successor_codebook))
        projected_rows, rows = projected.detach().float().cpu().numpy(), logits.detach().float().cpu().numpy()
        top = drafter.candidates(logits, k)[1].cpu().numpy()  # [n, K]: each position's top k, in one call

        def best(t: int, ids: np.ndarray, previous: int) -> int:
            scores = rows[t][ids] + successor[ids] @ (predecessor[previous] * projected_rows[t])  # [K]
            return int(ids[int(scores.argmax())])

        def choose_greedy(t: int, _logits, previous: int, position: PositionMask):
            token = best(t, top[t], previous)
            if position.legal(token):
                return token, None, None
            allowed = position.allowed_array()
            return (best(t, top_legal(rows[t], allowed, k), previous) if allowed.any() else None), None, None

        return choose_greedy

    temperatures = torch.tensor([temperature], device=projected.device)

    def choose_sampled(t: int, row: torch.Tensor, previous: int, position: PositionMask):
        masked = position.masked(row)
        if masked is None:
            return None, None, None
        unary, ids = masked.topk(min(k, int(torch.isfinite(masked).sum())))
        tokens, _, q = walk(unary[None, None], ids[None, None], torch.tensor([previous], device=ids.device),
                            projected[None, t:t + 1], selector.predecessor_codebook, selector.successor_codebook,
                            temperatures, uniforms[None, t:t + 1])
        return int(tokens[0, 0]), q[0, 0], ids

    return choose_sampled


def token_chooser(sampling, uniforms: torch.Tensor | None, sparse_top_k: int | None) -> Chooser:
    """DFlash: each position's own logits. Greedy (uniforms None): the argmax of the logits the grammar allows.
    Sampled (uniforms [n] float64): drawn from the request's processed distribution of the masked logits, q dense
    (sparse_top_k None) or its top sparse_top_k renormalised (q sparse)."""

    def choose(t: int, logits: torch.Tensor, previous: int, position: PositionMask):
        if uniforms is None:
            row = logits.detach().float().cpu().numpy()  # numpy: one argmax of a 150k row is 5x torch's here
            token = int(row.argmax())
            if position.legal(token):  # the masked argmax too
                return token, None, None
            allowed = position.allowed_array()
            if not allowed.any():
                return None, None, None
            legal = np.flatnonzero(allowed)
            return int(legal[row[legal].argmax()]), None, None
        masked = position.masked(logits)
        if masked is None:
            return None, None, None
        probs = batch_sampling_probs(masked[None], [sampling])[0]  # [V]: 0 where the grammar refuses
        ids = None
        if sparse_top_k is not None:
            probs, ids = probs.topk(min(sparse_top_k, probs.shape[-1]))
            probs = probs / probs.sum()
        choice = int(sample_from(probs[None], uniforms[t:t + 1].to(probs.device))[0])
        return (choice if ids is None else int(ids[choice])), probs, ids

    return choose
