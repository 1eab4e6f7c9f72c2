"""Decode steps at a few fixed shapes, so that a CUDA graph captured once per shape can replay every step.

A decode step of b rows of s new tokens attending over up to L positions runs as a step of B rows (the next power
of two) of T tokens (1 for a plain step, the block size for a verify step) over K keys (the next power of two, at
least 256, at most the cache's capacity). The padding is inert for the real rows:
- padded rows write into a scratch slot no request holds, at positions 0..T-1;
- a real row's padded tokens sit after its real ones (positions continue), so no real query sees them, and their
  cache entries lie past what the row commits (a positional cache never attends those);
- keys beyond a row's own positions are masked;
- the step's lengths give each real row its real tokens and each padded row none, so a recurrent state (KDA)
  takes in the real tokens alone and the scratch slot's stays as it was.
So a real row is computed as in the unpadded step, up to how the device's kernels round rows of a larger product:
on CPU the target's kernels are row-invariant and the bits are the same (tests/test_step_buckets.py); on a GPU
only with --batch-invariant (cuda_ext's row kernels; docs/gpu.md).

Only for families whose `graphable_steps` is true (padding never touches a committed state, and a step changes the
state by device operations alone: the positional caches, and GLM-5.3-Flash's KDA states with their pending count
and kept inputs on the device) and for decode steps; a prefill chunk runs unpadded.
"""

import logging
import time

import torch

from verify_worker.cuda_graph_step import CudaGraphStep, StepShape
from verify_worker.families.interface import StepBatch, TargetFamily, TargetOutput, TargetState

MIN_KEY_BUCKET = 256


def row_bucket(rows: int) -> int:
    """Rows 1, 2, 3-4, 5-8, ... run as 1, 2, 4, 8, ..."""
    return 1 << max(0, rows - 1).bit_length()


def key_bucket(length: int, capacity: int) -> int:
    """The key length a step of `length` positions runs with: a power of two, at least MIN_KEY_BUCKET, at most
    the cache's capacity."""
    return min(max(MIN_KEY_BUCKET, 1 << max(0, length - 1).bit_length()), capacity)


class StepBuckets:
    """Runs the engine's decode forwards at bucketed shapes, eagerly or (graphs=True, on CUDA) by replaying one
    CUDA graph per shape, captured by warm_up at start-up or else on its first use. A capture runs its step for
    real (warm-up calls, then a replay), so it is made from placeholder rows in the scratch slot that take in no
    token; a real step is then replayed, never captured (a recurrent state would take its tokens in more than
    once). scratch_slot: a state slot no request holds (padded rows write there); block_size: the tokens a verify
    step is padded to."""

    def __init__(self, target: TargetFamily, state: TargetState, scratch_slot: int, block_size: int,
                 taps: tuple[int, ...], graphs: bool = False):
        if not getattr(target, "graphable_steps", False):
            raise ValueError(f"{type(target).__name__} does not take padded steps (padding could reach its committed "
                             "state, or its step reads the host)")
        if graphs and target.embed_weight.device.type != "cuda":
            raise ValueError("CUDA graphs need the target on a CUDA device")
        self.target, self.state, self.scratch_slot = target, state, scratch_slot
        self.block_size, self.taps, self.graphs = block_size, taps, graphs
        self.captured: dict[StepShape, CudaGraphStep] = {}
        self.log = logging.getLogger("dflash.step_buckets")
        self.pool = torch.cuda.graph_pool_handle() if graphs else None  # one memory pool for every shape's graph

    def shape(self, rows: int, tokens: int, key_length: int) -> StepShape:
        return StepShape(row_bucket(rows), 1 if tokens == 1 else self.block_size,
                         key_bucket(key_length, self.state.capacity))

    def step(self, ids: torch.Tensor, positions: torch.Tensor, slots: list[int], key_length: int,
             lengths: list[int] | None = None) -> TargetOutput:
        """ids, positions [b, s] (on the host or the device), slots: the rows' state slots; key_length: the host's
        max(positions) + 1; lengths: each row's real tokens (None: all s; a recurrent state takes in these alone).
        Returns the real rows' TargetOutput ([b, s, ...]; views of a graph's buffers, valid until the next
        step)."""
        rows, tokens = ids.shape
        shape = self.shape(rows, tokens, key_length)
        if tokens > shape.tokens:
            raise ValueError(f"a step of {tokens} tokens a row is longer than the block size {self.block_size}")
        device = self.target.embed_weight.device
        padded_ids = torch.zeros(shape.batch, shape.tokens, dtype=torch.long)  # [B, T]
        padded_ids[:rows, :tokens] = ids.cpu()
        padded_positions = torch.arange(shape.tokens).repeat(shape.batch, 1)  # [B, T]: padded rows at 0..T-1
        padded_positions[:rows] = positions[:, :1].cpu() + torch.arange(shape.tokens)  # real rows continue
        padded_slots = torch.tensor(slots + [self.scratch_slot] * (shape.batch - rows))  # [B]
        padded_lengths = torch.zeros(shape.batch, dtype=torch.long)  # [B]: padded rows take in no token
        padded_lengths[:rows] = tokens if lengths is None else torch.tensor(lengths)
        padded_ids, padded_positions = padded_ids.to(device), padded_positions.to(device)
        padded_slots, padded_lengths = padded_slots.to(device), padded_lengths.to(device)
        out = None
        if self.graphs:
            graph = self.captured.get(shape) or self._capture(shape)
            if graph is not None:  # (None: the capture failed, this step and the later ones run eagerly)
                out = graph.run(padded_ids, padded_positions, padded_slots, padded_lengths).step
        if out is None:
            batch = StepBatch(padded_ids, padded_positions, padded_slots, padded_lengths, key_length=shape.key_length)
            out = self.target.step(batch, self.state, self.taps)
        taps = None if out.taps is None else out.taps[:rows, :tokens]  # [b, s, taps * hidden]
        return TargetOutput(hidden=out.hidden[:rows, :tokens], taps=taps)

    def all_shapes(self, max_rows: int) -> list[StepShape]:
        """Every shape a decode step of at most max_rows rows can take: row buckets x {1, the block size} tokens x
        key buckets up to the cache's capacity."""
        capacity = self.state.capacity
        rows = [1 << i for i in range(row_bucket(max_rows).bit_length())]  # 1, 2, 4, ... row_bucket(max_rows)
        keys = sorted({key_bucket(1 << i, capacity) for i in range(capacity.bit_length() + 1)})
        tokens = sorted({1, self.block_size})
        return [StepShape(b, t, k) for b in rows for t in tokens for k in keys]

    def warm_up(self, max_rows: int, progress=None) -> int:
        """Run (eagerly) or capture (graphs) every shape of all_shapes(max_rows) now, from placeholder rows in the
        scratch slot. progress(message) hears how far it got. Returns the shapes done (captures stop at the first
        failure, which leaves eager steps)."""
        shapes, started, done = self.all_shapes(max_rows), time.perf_counter(), 0
        for index, shape in enumerate(shapes):
            if self.graphs and shape not in self.captured:
                if self._capture(shape, quiet=True) is None:
                    break
            elif not self.graphs:
                self.target.step(self._placeholders(shape), self.state, self.taps)
            done = index + 1
            if progress is not None and (done == len(shapes) or done % max(1, len(shapes) // 10) == 0):
                progress(f"{'captured CUDA graphs' if self.graphs else 'warmed up'} for {done}/{len(shapes)} decode "
                         f"step shapes ({time.perf_counter() - started:.1f} s)")
        return done

    def _placeholders(self, shape: StepShape) -> StepBatch:
        """A step of the shape whose every row is in the scratch slot and takes in no token (lengths 0): what it
        writes is the scratch slot's alone, at positions 0..T-1."""
        device = self.target.embed_weight.device
        ids = torch.zeros(shape.batch, shape.tokens, dtype=torch.long, device=device)  # [B, T]
        positions = torch.arange(shape.tokens, device=device).repeat(shape.batch, 1)  # [B, T]
        slots = torch.full((shape.batch,), self.scratch_slot, dtype=torch.long, device=device)  # [B]
        lengths = torch.zeros(shape.batch, dtype=torch.long, device=device)  # [B]
        return StepBatch(ids, positions, slots, lengths, key_length=shape.key_length)

    def _capture(self, shape: StepShape, quiet: bool = False) -> CudaGraphStep | None:
        """Capture the shape's graph from placeholder rows; where the capture fails, say so once and run every later
        step eagerly (None)."""
        started = time.perf_counter()
        batch = self._placeholders(shape)
        try:
            graph = CudaGraphStep(self.target, self.state, shape, batch.input_ids, batch.positions, batch.slots,
                                  self.taps, logits=False, pool=self.pool, lengths=batch.lengths)
        except Exception as error:  # noqa: BLE001 - any failure to capture leaves the eager step, which is exact
            self.log.warning("capturing a CUDA graph for %s failed (%s: %s): decode steps run eagerly from now on",
                             shape, type(error).__name__, error)
            self.graphs = False
            return None
        self.captured[shape] = graph
        self.log.log(logging.DEBUG if quiet else logging.INFO, "captured a CUDA graph for %s in %.2f s (%d shapes "
                     "now)", shape, time.perf_counter() - started, len(self.captured))
        return graph
