"""A request's grammar state as exact speculation needs it (llguidance, docs/decisions/0027).

The state is advanced only by committed tokens. For a verify block it gives the mask of every position: the first
from the committed state, each next one after the drafts before it, stopping at the first draft the grammar
refuses; the state is then where it was. Bitmasks are llguidance's: int32 [rows, ceil(vocab / 32)], bit j of word w
allowing token 32 w + j.
"""

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import torch

from shared.grammar import new_matcher


def allowed_tokens(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """bitmask [rows, words] int32 -> [rows, width] bool (ids past the bitmask are refused)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().reshape(bitmask.shape[0], -1)  # [rows, 32 words]
    if allowed.shape[1] >= width:
        return allowed[:, :width]
    padding = torch.zeros(allowed.shape[0], width - allowed.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, padding], dim=1)


@dataclass
class GrammarMatcher:
    """One request's grammar state, advanced by its committed tokens only.

    llguidance's pitfalls, held here: a refused token leaves a matcher in an error state no rollback undoes, so
    tokens are checked before they are taken; once the grammar is complete (`is_stopped`) an end-of-sequence token
    is taken but not recorded, so rollbacks count only the recorded ones."""

    matcher: "llguidance.LLMatcher"
    eos_ids: frozenset[int]
    words: int  # int32 words of a bitmask row: ceil(the grammar vocabulary's size / 32)
    recorded: list[bool]  # one per token taken: whether the matcher recorded it

    @classmethod
    def build(cls, vocabulary, grammar: str) -> "GrammarMatcher":
        """Raises ValueError with the grammar's error."""
        return cls(new_matcher(vocabulary, grammar), frozenset(vocabulary.eos_tokens),
                   (vocabulary.vocab_size + 31) // 32, [])

    def legal_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens the grammar takes from here (once it has ended, only end-of-sequence tokens:
        a request that ignores its end goes on with them)."""
        if not tokens or self.matcher.is_error():
            return 0
        taken = 0
        if not self.matcher.is_stopped():
            legal = self.matcher.validate_tokens(tokens)
            ends = [index for index, token in enumerate(tokens[:legal]) if token in self.eos_ids]
            if not ends:
                return legal
            taken = ends[0] + 1
        while taken < len(tokens) and tokens[taken] in self.eos_ids:
            taken += 1
        return taken

    def take(self, tokens: list[int]) -> int:
        """Advance by the legal prefix of tokens; returns its length."""
        legal = self.legal_prefix(tokens)
        for token in tokens[:legal]:
            recorded = not (token in self.eos_ids and self.matcher.is_stopped())
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused token {token} it had allowed: {self.matcher.get_error()}")
            self.recorded.append(recorded)
        return legal

    def undo(self, count: int) -> None:
        """Take back the last `count` tokens taken."""
        if count <= 0:
            return
        recorded = sum(self.recorded[-count:])
        del self.recorded[-count:]
        if recorded and not self.matcher.rollback(recorded):
            raise RuntimeError(f"the grammar cannot roll back {recorded} tokens: {self.matcher.get_error()}")

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of a CPU int32 bitmask: the tokens allowed next (only end-of-sequence once complete)."""
        words = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def block_masks(self, drafts: list[int], bitmask: torch.Tensor, first_row: int) -> int:
        """Rows first_row.. of bitmask: the mask after each legal leading draft (row i after drafts[:i]); returns
        the legal drafts' count. Rows after the first refused draft are left as they are. The state is restored."""
        legal = self.legal_prefix(drafts)
        self.fill(bitmask, first_row)
        taken = 0
        try:
            for index, token in enumerate(drafts[:legal]):
                taken += self.take([token])
                self.fill(bitmask, first_row + index + 1)
        finally:
            self.undo(taken)
        return legal

    def forced(self) -> list[int]:
        """The tokens the grammar allows as the only continuation from here ([] where it allows a choice): once it
        has ended, its end-of-sequence token where it has one."""
        if self.matcher.is_stopped():
            return list(self.eos_ids) if len(self.eos_ids) == 1 else []
        return list(self.matcher.compute_ff_tokens())


class CompiledGrammars:
    """Fresh matchers of the grammars seen lately (an LRU of `size`, keyed by the text's hash), so that a request's
    matcher is a copy of a compiled one: a copy takes tens of microseconds where compiling takes milliseconds, and
    agents send the same schemas with every turn. Thread-safe."""

    def __init__(self, vocabulary, size: int = 256):
        self.vocabulary, self.size = vocabulary, size
        self.fresh: OrderedDict[bytes, "llguidance.LLMatcher"] = OrderedDict()
        self.lock = threading.Lock()

    def matcher(self, grammar: str) -> GrammarMatcher:
        """A matcher of the grammar at its start (ValueError with the grammar's error where it does not compile)."""
        key = hashlib.sha256(grammar.encode()).digest()
        with self.lock:
            fresh = self.fresh.get(key)
            if fresh is not None:
                self.fresh.move_to_end(key)
        if fresh is None:
            fresh = new_matcher(self.vocabulary, grammar)
            with self.lock:
                self.fresh[key] = fresh
                while len(self.fresh) > self.size:
                    self.fresh.popitem(last=False)
        with self.lock:  # a copy is not taken while another thread copies the same matcher
            copy = fresh.deep_copy()
        return GrammarMatcher(copy, frozenset(self.vocabulary.eos_tokens), (self.vocabulary.vocab_size + 31) // 32, [])
