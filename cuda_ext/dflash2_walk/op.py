"""The DFlash 2 walk as a torch custom op (dflash::dflash2_walk, with a fake implementation), and `walk`, which
picks the kernel or the reference (cuda_ext/dispatch.py). On CPU the host build is the default: one call for the
whole path where the reference runs a handful of PyTorch ops per row. For a sampled walk over the demo drafter's
1024 candidates (selector_sample_top_k) the reference took 2.15 ms for one block and the host build 0.46 ms
(about even at 16 blocks, 5.2 against 6.1 ms; built with AVX2, cuda_ext/build.py, 0.41 and 5.1 ms); served
sampled at concurrency 1 (temperature 1, top-p 0.95), the draft call went from 3.7 to 1.7 ms and speculative
decoding from 224 to 315 tok/s with a draft worker. (An earlier measurement had the host build's sequential sums
20% slower on sampled demo decoding; its pair term has summed in 8 interleaved partial sums since.)"""

import torch

from cuda_ext.dflash2_walk import reference

CUDA_MAX_CANDIDATES, CUDA_MAX_RANK = 2048, 1024  # rows.h: kWalkMaxCandidates, kWalkMaxRank
from cuda_ext.dispatch import call_kernel, kernel_entry


def _launch(unary: torch.Tensor, candidates: torch.Tensor, anchors: torch.Tensor, projected: torch.Tensor,
            predecessor: torch.Tensor, successor: torch.Tensor, temperatures: torch.Tensor,
            uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's launch behind the custom op (walk_kernel's contract); on CPU `walk` calls it directly: the
    custom op's dispatch cost more than the host build's walk of a demo block."""
    device = unary.device
    unary, projected = unary.float().contiguous(), projected.float().contiguous()
    candidates, anchors = candidates.long().contiguous(), anchors.long().contiguous()
    predecessor, successor = predecessor.float().contiguous(), successor.float().contiguous()
    temperatures, uniforms = temperatures.float().contiguous(), uniforms.double().contiguous()
    batch, rows, k = candidates.shape
    rank, vocab = predecessor.shape[1], predecessor.shape[0]
    if not (unary.shape == candidates.shape and anchors.shape == temperatures.shape == (batch,)
            and projected.shape == (batch, rows, rank) and successor.shape == predecessor.shape
            and uniforms.shape == (batch, rows) and k >= 1):
        described = ", ".join(str(tuple(t.shape)) for t in (unary, candidates, anchors, projected, predecessor,
                                                            successor, temperatures, uniforms))
        raise ValueError(f"dflash::dflash2_walk: inconsistent shapes ({described})")
    tokens = torch.empty(batch, rows, dtype=torch.int64, device=device)
    choices = torch.empty(batch, rows, dtype=torch.int64, device=device)
    q = torch.empty(batch, rows, k, dtype=torch.float32, device=device)
    call_kernel("dflash2_walk", device, unary.data_ptr(), candidates.data_ptr(), anchors.data_ptr(),
                projected.data_ptr(), predecessor.data_ptr(), successor.data_ptr(), temperatures.data_ptr(),
                uniforms.data_ptr(), batch, rows, k, rank, vocab, tokens.data_ptr(), choices.data_ptr(), q.data_ptr())
    return tokens, choices, q


@torch.library.custom_op("dflash::dflash2_walk", mutates_args=())
def walk_kernel(unary: torch.Tensor, candidates: torch.Tensor, anchors: torch.Tensor, projected: torch.Tensor,
                predecessor: torch.Tensor, successor: torch.Tensor, temperatures: torch.Tensor,
                uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reference.walk's contract in one launch (uniforms [b, n] float64, read for sampled rows only). A row with a
    token id outside the selector's vocabulary gets tokens and choices of -1 and a zero q (`walk` raises an
    IndexError for it on CPU)."""
    return _launch(unary, candidates, anchors, projected, predecessor, successor, temperatures, uniforms)


@walk_kernel.register_fake
def _(unary, candidates, anchors, projected, predecessor, successor, temperatures, uniforms):
    shape = candidates.shape
    return (candidates.new_empty(shape[:2], dtype=torch.int64), candidates.new_empty(shape[:2], dtype=torch.int64),
            unary.new_empty(shape, dtype=torch.float32))


def kernel_fits(candidates: torch.Tensor, predecessor: torch.Tensor) -> bool:
    """Whether the CUDA kernel takes these sizes (its shared memory holds a row's K scores and the rank's query);
    the host build takes any."""
    return candidates.device.type != "cuda" or (candidates.shape[-1] <= CUDA_MAX_CANDIDATES
                                                and predecessor.shape[1] <= CUDA_MAX_RANK)


def walk(unary: torch.Tensor, candidates: torch.Tensor, anchors: torch.Tensor, projected: torch.Tensor,
         predecessor: torch.Tensor, successor: torch.Tensor, temperatures: torch.Tensor,
         uniforms: torch.Tensor | None, use_kernel: bool | None = None):
    """reference.walk, on the kernel where dispatch picks it (use_kernel forces the choice). Without uniforms
    every row is greedy, as in the reference."""
    if use_kernel is None:  # on CPU the host build is the default, greedy or sampled
        use_kernel = (kernel_entry("dflash2_walk", unary.device, cpu_default=True) is not None
                      and kernel_fits(candidates, predecessor))
    if not use_kernel:
        return reference.walk(unary, candidates, anchors, projected, predecessor, successor, temperatures, uniforms)
    if uniforms is None:
        temperatures = temperatures.clamp(max=0)  # all greedy (no read-back of device values)
        uniforms = torch.zeros(candidates.shape[:2], dtype=torch.float64, device=unary.device)
    launch = _launch if unary.device.type == "cpu" else walk_kernel  # a CUDA launch stays capturable
    tokens, choices, q = launch(unary, candidates, anchors, projected, predecessor, successor, temperatures, uniforms)
    if tokens.device.type == "cpu" and bool((tokens < 0).any()):
        raise IndexError(f"dflash2_walk: a token id outside the vocabulary of the selector ({predecessor.shape[0]})")
    return tokens, choices, q
