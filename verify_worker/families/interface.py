"""What the engine relies on from a target family, and nothing more.

The engine builds a StepBatch on the host, runs it with `step`, verifies, and then `commit`s how many of each
slot's new tokens it keeps. Between two commits a slot's steps continue one another: their tokens are pending, in
order, and commit keeps the first `kept` of them and drops the rest. A positional KV cache needs no commit
(entries past a slot's committed length are never attended); a recurrent state must end exactly where plain
decoding of the kept tokens would have left it, and need only roll back within `block_tokens` (new_state): for
such a family (`commits_state`) the engine never runs a slot's last prompt chunk and its first decode block
between the same two commits, and a prompt chunk is always kept whole. An engine step that raises is undone with
a commit of 0 for its slots. A tap is always [tokens, hidden]: the completed output of a decoder layer. Optional
besides the protocol below: `graphable_steps` (padded steps, CUDA graphs: verify_worker/step_buckets.py) and
`prefill_align` (prompt chunks start at its multiples: StepBatch.prefill).
"""

from dataclasses import dataclass
from typing import Protocol

import torch

DEFAULT_BLOCK_TOKENS = 16  # new_state's block_tokens where a caller names none: DFlash's usual block size


@dataclass(frozen=True)
class StepBatch:
    """New tokens of some requests, right-padded: padding sits at later positions than a row's real tokens."""

    input_ids: torch.Tensor  # [b, s] long
    positions: torch.Tensor  # [b, s] long: absolute positions in each request
    slots: torch.Tensor  # [b] long: each row's state slot
    lengths: torch.Tensor | None = None  # [b] long: each row's real tokens (None: all s); the rest is padding,
    #                                      which a recurrent state must not take in
    # what the host knows, so that a family need not read it back from the device (a sync per step on a GPU,
    # and none may happen while a CUDA graph is captured); None: the family works it out from the tensors
    key_length: int | None = None  # positions a row may attend to: at least max(positions) + 1
    slot_range: tuple[int, int] | None = None  # slots are start..end-1 in order (cache reads become views);
    #                                            with key_length given, None means: read the slots by index
    prefill: bool = False  # prompt chunks, kept whole by the commit: a recurrent state may take them in by a
    #                        chunked form, whose bits depend on where a chunk starts (the engine starts each at a
    #                        multiple of the family's optional `prefill_align`)


@dataclass
class TargetOutput:
    hidden: torch.Tensor  # [batch, seq, hidden] after the final norm
    taps: torch.Tensor | None  # [batch, seq, num_taps * hidden]: outputs of the tapped layers, before the norm


class TargetState(Protocol):
    """Per-slot state of a family (KV cache, latent cache, recurrent state...)."""

    capacity: int  # positions per slot

    def nbytes(self) -> int: ...


class TargetFamily(Protocol):
    """Optional besides: `share_kernel_threads(n)` (run the family's C++ CPU kernels on n threads) and `pool` (the
    shared.cpu_kernels WorkerPool they run on, or None), which the engine holds awake through a step."""

    config: object  # the family's config; the engine reads vocab_size, hidden_size, num_layers,
    #                 max_position_embeddings and eos_token_ids
    commits_state: bool  # whether commit/reset do anything (TP leaders announce them only then)

    @property
    def embed_weight(self) -> torch.Tensor: ...

    @property
    def lm_head_weight(self) -> torch.Tensor: ...

    def new_state(self, num_slots: int, capacity: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> TargetState:
        """num_slots slots of capacity positions; block_tokens: the most pending tokens a commit may roll back
        within (the verify block; a recurrent family keeps their inputs, a positional cache ignores it)."""

    def state_bytes_per_slot(self, capacity: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> int: ...

    def step(self, batch: StepBatch, state: TargetState, taps: tuple[int, ...] = ()) -> TargetOutput: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def commit(self, state: TargetState, slots: torch.Tensor, kept: torch.Tensor) -> None:
        """After verification: slots[i] keeps the first kept[i] of its pending tokens (0: drops them all)."""

    def reset(self, state: TargetState, slot: int) -> None:
        """The slot is handed to a new request."""

    # optional: copy_prefix(state, source, target, length): positions 0..length-1 of one slot into another (a
    # positional cache; the prefix cache then keeps the source's prefix for other requests, else it moves the slot)
