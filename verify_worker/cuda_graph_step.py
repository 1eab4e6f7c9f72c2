"""A target step captured once in a CUDA graph and replayed: the forward and the lm_head for one shape bucket
(batch rows x new tokens x key length), without launching each of its kernels from Python again.

The step is the family's own `step` on a StepBatch that carries the host's facts (key_length, and slots read by
index), so nothing is read back from the device while it is captured. A replay computes what an eager call of the
same bucket computes, with the same kernels in the same order: the same bits (tests/test_cuda_graph_step.py,
on a GPU). Rows of a smaller batch are not padded here: the caller captures one bucket per shape it runs.

Not wired into the engine yet: benchmarks/gpu_target_step.py times it against the eager step.
"""

from dataclasses import dataclass

import torch

from verify_worker.families.interface import StepBatch, TargetFamily, TargetState


@dataclass(frozen=True)
class StepShape:
    batch: int  # rows
    tokens: int  # new tokens per row (1: a plain decode step; the block size: a verify step)
    key_length: int  # key positions each row may attend to (a bucket: at least every row's last position + 1)


class CudaGraphStep:
    """One captured step of `target` on `state` for `shape`. `run` copies the inputs into the captured buffers,
    replays, and returns the captured logits [batch, tokens, vocab] (overwritten by the next replay)."""

    def __init__(self, target: TargetFamily, state: TargetState, shape: StepShape, warmups: int = 2):
        if not torch.cuda.is_available():
            raise RuntimeError("a CUDA graph step needs a CUDA device")
        self.shape = shape
        device = target.embed_weight.device
        if device.type != "cuda":
            raise ValueError(f"the target is on {device}, not on a CUDA device")
        self.input_ids = torch.zeros(shape.batch, shape.tokens, dtype=torch.long, device=device)  # [b, s]
        self.positions = torch.arange(shape.tokens, device=device).repeat(shape.batch, 1)  # [b, s]
        self.slots = torch.arange(shape.batch, device=device)  # [b]
        batch = StepBatch(self.input_ids, self.positions, self.slots, key_length=shape.key_length)

        def step() -> torch.Tensor:
            return target.logits(target.step(batch, state).hidden)  # [b, s, vocab]

        side = torch.cuda.Stream()  # warm-up off the default stream, as capture asks (lazy inits, autotuning)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmups):
                step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = step()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [batch, tokens] and slots [batch] of the captured shape; every position must be
        below the shape's key_length (not checked here: that would read the device)."""
        expected = (self.shape.batch, self.shape.tokens)
        if tuple(input_ids.shape) != expected or tuple(positions.shape) != expected or len(slots) != expected[0]:
            raise ValueError(f"this graph was captured for {expected[0]} rows of {expected[1]} tokens; got ids "
                             f"{tuple(input_ids.shape)}, positions {tuple(positions.shape)}, {len(slots)} slots")
        self.input_ids.copy_(input_ids)
        self.positions.copy_(positions)
        self.slots.copy_(slots)
        self.graph.replay()
        return self.logits
