"""Leader/follower protocol of a tensor-parallel verify worker.

Rank 0 runs the engine against a TargetLeader, which has the family interface (verify_worker/families/
interface.py): before each target call it
broadcasts a small header (what to run, with which shapes) and the call's input tensors, so every follower
runs the same call on its shard and meets rank 0 in the same collectives. Everything else (scheduling,
acceptance, sampling, the sockets) exists on rank 0 only, so the ranks cannot disagree on a decision. Idle
rank 0 pings, so a dead or hung rank is noticed within the collective timeout instead of at the next request.
"""

import enum
import time

import torch

from shared.errors import DFlashError, WorkerFault
from verify_worker.families.interface import DEFAULT_BLOCK_TOKENS, StepBatch, TargetFamily, TargetOutput, TargetState

HEADER_LEN = 16


class Op(enum.IntEnum):
    FORWARD = 1  # [op, batch, seq, prefill, num_taps, taps...]
    LOGITS = 2  # [op, ndim, shape...]
    NEW_STATE = 3  # [op, num_slots, capacity, block_tokens]
    PING = 4
    STOP = 5
    COMMIT = 6  # [op, batch]
    RESET = 7  # [op, slot]


class ParallelFailure(WorkerFault):
    """A rank died, hung past the collective timeout, or the group broke: the verify worker must stop."""


def _header(*values: int) -> torch.Tensor:
    if len(values) > HEADER_LEN:
        raise DFlashError(f"a tensor-parallel command needs {len(values)} header fields (at most {HEADER_LEN})")
    header = torch.zeros(HEADER_LEN, dtype=torch.long)
    header[: len(values)] = torch.tensor(values, dtype=torch.long)
    return header


class TargetLeader:
    """Rank 0's handle on a tensor-parallel target: the calls of TargetFamily, each mirrored on every rank."""

    def __init__(self, target: TargetFamily, ping_every_s: float = 1.0):
        self.target, self.tp = target, target.tp
        self.config = target.config
        self.commits_state = target.commits_state
        self.prefill_align = getattr(target, "prefill_align", 1)
        self.device = target.embed_weight.device
        self.ping_every_s, self.last_command = ping_every_s, time.monotonic()

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.target.embed_weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.target.lm_head_weight

    def _announce(self, header: torch.Tensor, *tensors: torch.Tensor) -> None:
        try:
            self.tp.broadcast(header.to(self.device))
            for tensor in tensors:
                self.tp.broadcast(tensor.contiguous())
        except RuntimeError as exc:
            raise ParallelFailure(f"tensor-parallel group failed: {exc}") from None
        self.last_command = time.monotonic()

    def _run(self, call):
        """A call already announced to the followers: whatever it raises, the ranks may now be out of step
        (some inside the call's collectives), so no retry may follow: any exception stops the worker."""
        try:
            return call()
        except Exception as exc:  # noqa: BLE001
            raise ParallelFailure(f"tensor-parallel call failed ({type(exc).__name__}: {exc}): the ranks may be "
                                  "out of step") from None

    def new_state(self, num_slots: int, capacity: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> TargetState:
        self._announce(_header(Op.NEW_STATE, num_slots, capacity, block_tokens))
        return self.target.new_state(num_slots, capacity, block_tokens)

    def state_bytes_per_slot(self, capacity: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> int:
        return self.target.state_bytes_per_slot(capacity, block_tokens)

    def step(self, batch: StepBatch, state: TargetState, taps: tuple[int, ...] = ()) -> TargetOutput:
        rows, seq = batch.input_ids.shape
        lengths = batch.lengths if batch.lengths is not None else torch.full((rows,), seq)
        self._announce(_header(Op.FORWARD, rows, seq, int(batch.prefill), len(taps), *taps),
                       batch.input_ids.to(self.device, torch.long), batch.positions.to(self.device, torch.long),
                       batch.slots.to(self.device, torch.long), lengths.to(self.device, torch.long))
        return self._run(lambda: self.target.step(batch, state, taps))

    def commit(self, state: TargetState, slots: torch.Tensor, kept: torch.Tensor) -> None:
        if not self.commits_state:
            return  # nothing to mirror: the family's commit is a no-op
        self._announce(_header(Op.COMMIT, len(slots)), slots.to(self.device, torch.long),
                       kept.to(self.device, torch.long))
        self._run(lambda: self.target.commit(state, slots, kept))

    def reset(self, state: TargetState, slot: int) -> None:
        if not self.commits_state:
            return
        self._announce(_header(Op.RESET, slot))
        self._run(lambda: self.target.reset(state, slot))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._announce(_header(Op.LOGITS, hidden.dim(), *hidden.shape), hidden)
        return self._run(lambda: self.target.logits(hidden))

    def keep_alive(self) -> None:
        """Ping the followers when no command went out for a while (call it from the idle loop)."""
        if time.monotonic() - self.last_command >= self.ping_every_s:
            self._announce(_header(Op.PING))

    def stop(self) -> None:
        try:
            self._announce(_header(Op.STOP))
        except ParallelFailure:
            pass


def follow(target: TargetFamily) -> None:
    """A follower rank's loop: run each command rank 0 announces, until STOP. Raises ParallelFailure when
    rank 0 is gone or silent past the collective timeout."""
    tp, device, dtype = target.tp, target.embed_weight.device, target.embed_weight.dtype
    state = None
    header = torch.zeros(HEADER_LEN, dtype=torch.long, device=device)

    def receive(shape, tensor_dtype):
        tensor = torch.empty(shape, dtype=tensor_dtype, device=device)
        return tp.broadcast(tensor)

    try:
        while True:
            op, *fields = tp.broadcast(header).tolist()
            if op == Op.STOP:
                return
            if op == Op.NEW_STATE:
                state = target.new_state(fields[0], fields[1], fields[2])
            elif op == Op.FORWARD:
                rows, seq, prefill, num_taps = fields[:4]
                ids = receive((rows, seq), torch.long)
                positions = receive((rows, seq), torch.long)
                slots = receive((rows,), torch.long)
                lengths = receive((rows,), torch.long)
                target.step(StepBatch(ids, positions, slots, lengths, prefill=bool(prefill)), state,
                            tuple(fields[4: 4 + num_taps]))
            elif op == Op.COMMIT:
                slots = receive((fields[0],), torch.long)
                target.commit(state, slots, receive((fields[0],), torch.long))
            elif op == Op.RESET:
                target.reset(state, fields[0])
            elif op == Op.LOGITS:
                hidden = receive(tuple(fields[1: 1 + fields[0]]), dtype)
                target.logits(hidden)
            elif op != Op.PING:
                raise ParallelFailure(f"unknown tensor-parallel command {op}")
    except RuntimeError as exc:
        raise ParallelFailure(f"tensor-parallel group failed (rank {tp.rank}): {exc}") from None
