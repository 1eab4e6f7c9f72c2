"""A target step captured once in a CUDA graph and replayed: the forward (and, if asked, the lm_head) for one shape
bucket (batch rows x new tokens x key length), without launching each of its kernels from Python again.

The step is the family's own `step` on a StepBatch that carries the host's facts (key_length, and slots read by
index), so nothing is read back from the device while it is captured. A replay computes what an eager call of the
same bucket computes, with the same kernels in the same order: the same bits (tests/test_step_host_facts.py, on a
GPU). Rows are not padded here: verify_worker/step_buckets.py pads a step to its bucket.
"""

from dataclasses import dataclass

import torch

from verify_worker.families.interface import StepBatch, TargetFamily, TargetOutput, TargetState


@dataclass(frozen=True)
class StepShape:
    batch: int  # rows
    tokens: int  # new tokens per row (1: a plain decode step; the block size: a verify step)
    key_length: int  # key positions each row may attend to (a bucket: at least every row's last position + 1)


@dataclass
class GraphOutputs:
    """The captured step's outputs (overwritten by the next replay: copy what must outlive it)."""

    step: TargetOutput  # hidden [b, s, hidden], taps [b, s, taps * hidden] or None
    logits: torch.Tensor | None  # [b, s, vocab] where the lm_head was captured too


class CudaGraphStep:
    """One captured step of `target` on `state` for `shape` (tapping `taps`; with the lm_head if `logits`), built
    from first inputs (input_ids, positions [b, s], slots [b]): the warm-up calls before the capture and the replay
    after it really run that step three times and write the state, so give rows whose writes harm nothing (a
    positional cache: the same writes again; a recurrent state: rows that take in no token, lengths 0, as
    step_buckets.py's placeholders do). `outputs` then hold that step's results; `run` copies the next inputs into
    the captured buffers and replays. pool: a CUDA graph memory pool shared with the other shapes' graphs
    (torch.cuda.graph_pool_handle()), or None for a pool of its own. lengths [b]: each row's real tokens (None:
    all of them), a buffer of the graph too, so a replay's rows may take in fewer (a recurrent state's padding)."""

    def __init__(self, target: TargetFamily, state: TargetState, shape: StepShape, input_ids: torch.Tensor,
                 positions: torch.Tensor, slots: torch.Tensor, taps: tuple[int, ...] = (), logits: bool = True,
                 warmups: int = 2, pool=None, lengths: torch.Tensor | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("a CUDA graph step needs a CUDA device")
        self.shape = shape
        device = target.embed_weight.device
        if device.type != "cuda":
            raise ValueError(f"the target is on {device}, not on a CUDA device")
        self._check(input_ids, positions, slots)
        self.input_ids = input_ids.to(device, torch.long).clone()  # [b, s]
        self.positions = positions.to(device, torch.long).clone()  # [b, s]
        self.slots = slots.to(device, torch.long).clone()  # [b]
        if lengths is None:
            lengths = torch.full((shape.batch,), shape.tokens)
        self.lengths = lengths.to(device, torch.long).clone()  # [b]
        batch = StepBatch(self.input_ids, self.positions, self.slots, self.lengths, key_length=shape.key_length)

        def step() -> GraphOutputs:
            out = target.step(batch, state, taps)
            return GraphOutputs(out, target.logits(out.hidden) if logits else None)

        side = torch.cuda.Stream()  # warm-up off the default stream, as capture asks (lazy inits, autotuning)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmups):
                step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = step()
        self.graph.replay()  # a capture records without running: the outputs hold this step's results only now

    def _check(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        expected = (self.shape.batch, self.shape.tokens)
        if tuple(input_ids.shape) != expected or tuple(positions.shape) != expected or len(slots) != expected[0]:
            raise ValueError(f"this graph is for {expected[0]} rows of {expected[1]} tokens; got ids "
                             f"{tuple(input_ids.shape)}, positions {tuple(positions.shape)}, {len(slots)} slots")

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            lengths: torch.Tensor | None = None) -> GraphOutputs:
        """input_ids, positions [batch, tokens] and slots, lengths [batch] (None: all tokens) of the captured shape;
        every position must be below the shape's key_length (not checked here: that would read the device)."""
        self._check(input_ids, positions, slots)
        self.input_ids.copy_(input_ids)
        self.positions.copy_(positions)
        self.slots.copy_(slots)
        if lengths is None:
            self.lengths.fill_(self.shape.tokens)
        else:
            self.lengths.copy_(lengths)
        self.graph.replay()
        return self.outputs
