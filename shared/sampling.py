"""Logits processing and random draws shared by plain decoding, drafting and verification.

Speculative and plain decoding call the same `sampling_probs`, so they sample the same distribution.
Every draw takes an explicit uniform number from the request's own generator, so a seeded request consumes
the same random stream whether it runs alone or in a batch.
"""

import numpy as np
import torch

from shared.cpu_kernels.library import cpu_kernels
from shared.sampling_params import SamplingParams


def sampling_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
) -> torch.Tensor:
    """Probabilities after temperature, top-k, then top-p; float32, same shape as logits [..., vocab].

    temperature, top_p, top_k: per-row settings broadcastable to logits.shape[:-1] (temperature > 0;
    top_k 0 means no cut). Top-k keeps the k most likely tokens; top-p then keeps the smallest prefix of the
    sorted renormalised distribution whose mass reaches top_p (always at least one token; top_p >= 1 cuts
    nothing).

    Rows that cut nothing (top_p >= 1, no top-k) skip the sort.
    """
    vocab = logits.shape[-1]
    scaled = logits.float() / temperature[..., None].float()  # [..., vocab]
    probs = torch.softmax(scaled, dim=-1)
    shape = probs.shape[:-1]
    top_p = torch.broadcast_to(top_p.to(probs.device).float(), shape)
    k = torch.broadcast_to(torch.where(top_k > 0, top_k, vocab).to(probs.device), shape)
    cut = (top_p < 1) | (k < vocab)  # [...]
    if not bool(cut.any()):
        return probs
    if bool(cut.all()):  # every row cut (one setting for the batch, as usual): no gather and scatter of rows
        return _cut_rows(probs.reshape(-1, vocab), top_p.reshape(-1), k.reshape(-1)).view(probs.shape)
    out = probs.clone()
    out[cut] = _cut_rows(probs[cut], top_p[cut], k[cut])
    return out


def _cut_rows(probs: torch.Tensor, top_p: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p of probs [R, vocab] with top_p [R] and k [R] (vocab = no top-k cut). On CPU the C++ kernel
    (shared/cpu_kernels/top_p.cpp: it sorts only the buckets of value the kept prefix reaches, 40 us a row of the
    demo target's sampled rows against 87 us for the whole sort), else, and for rows it refuses (a value that is
    not a finite number), the whole sort."""
    kernels = cpu_kernels() if probs.device.type == "cpu" and probs.dtype == torch.float32 else None
    cut_rows = kernels.top_p_cut(probs, top_p, k) if kernels is not None else None
    return cut_rows if cut_rows is not None else _cut_rows_sorted(probs, top_p, k)


def _cut_rows_sorted(probs: torch.Tensor, top_p: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """_cut_rows by sorting every row whole (the reference of the C++ kernel, and the path off CPU)."""
    sorted_probs, order = _sort_descending(probs)  # [R, vocab]
    sorted_probs = sorted_probs * (torch.arange(probs.shape[-1], device=probs.device) < k[:, None])
    sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)  # top_p 1: no cut
    keep[:, 0] = True  # the most likely token always stays (a top_p below float32's range keeps it alone)
    sorted_probs = sorted_probs * keep
    sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _sort_descending(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of probs [R, vocab] sorted along the vocabulary, largest first. On CPU numpy's
    quicksort: torch's CPU sort of several vocabulary-long rows measured 6x slower (1.5 ms for 8 x 4096)."""
    if probs.device.type != "cpu":
        return probs.sort(dim=-1, descending=True)
    order = torch.from_numpy(np.argsort(-probs.detach().numpy(), axis=-1, kind="quicksort"))
    return probs.gather(-1, order), order


def batch_sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """sampling_probs with one SamplingParams per row of logits [rows, ..., vocab]."""
    extra = (1,) * (logits.dim() - 2)

    def column(values):  # [rows, 1, ...]
        return torch.tensor(values, device=logits.device).view(len(values), *extra)

    return sampling_probs(
        logits,
        column([p.temperature for p in params]),
        column([p.top_p for p in params]),
        column([p.top_k for p in params]),
    )


CDF_CHUNK = 256  # the draw's summation chunk; the kernels' kCdfChunk (cuda_ext/common/hd.h)


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [..., vocab] (need not be normalised), uniforms [...] in [0, 1) -> ids [...]: the
    first id whose cumulative probability exceeds u times the total.

    The sums are float64 in a fixed order that the kernels reproduce exactly (cuda_ext/common/hd.h): in order
    within chunks of CDF_CHUNK ids, and the chunk totals in order before them. So every build draws the same
    token from the same probabilities and uniform."""
    vocab = probs.shape[-1]
    chunks = -(-vocab // CDF_CHUNK)
    padded = torch.nn.functional.pad(probs.double(), (0, chunks * CDF_CHUNK - vocab))  # zeros add nothing
    within = padded.view(*probs.shape[:-1], chunks, CDF_CHUNK).cumsum(-1)  # [..., chunks, CDF_CHUNK]
    ends = within[..., -1].cumsum(-1)  # [..., chunks]: the running total after each chunk
    starts = torch.cat([torch.zeros_like(ends[..., :1]), ends[..., :-1]], -1)
    cdf = (starts[..., None] + within).flatten(-2)[..., :vocab].contiguous()  # [..., vocab], non-decreasing
    target = uniforms.double() * ends[..., -1]
    ids = torch.searchsorted(cdf, target[..., None], right=True)[..., 0]
    return ids.clamp_(max=vocab - 1)


def request_generator(seed: int, stream: int) -> torch.Generator:
    """A CPU generator for one request; `stream` separates the verifier's and the drafter's draws."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed((seed * 1_000_003 + stream) % (2**63))
    return generator
