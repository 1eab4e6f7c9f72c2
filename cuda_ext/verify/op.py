"""The verify kernel as a torch custom op (dflash::verify_block, with a fake implementation so torch.compile and
CUDA graphs capture it), and `verify_block`, which picks the kernel or the reference (cuda_ext/dispatch.py). On
CPU the host build is the default: it equals the reference bit for bit and never builds a dense q (a sampled
batch of 16 x 7 drafts over 152k tokens: 7.4 ms against 218 ms; greedy rows about alike)."""

import torch

from cuda_ext.dispatch import call_kernel, kernel_entry
from cuda_ext.verify import reference

CUDA_MAX_VOCAB = 1_300_000  # the CUDA kernel keeps a float64 per 256 ids in shared memory; larger: the reference


def _launch(scores: torch.Tensor, draft: torch.Tensor, num_drafts: torch.Tensor, sampled: torch.Tensor,
            q_form: torch.Tensor, q_dense: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor,
            accept_u: torch.Tensor, sample_u: torch.Tensor) -> torch.Tensor:
    """The kernel's launch behind the custom op (verify_block_kernel's contract); on CPU `verify_block` calls it
    directly: the custom op's dispatch cost more than the host build's verify of a demo step."""
    batch, width = draft.shape
    vocab, k = scores.shape[-1], q_ids.shape[-1]
    scores, draft = scores.float().contiguous(), draft.long().contiguous()
    num_drafts, sampled = num_drafts.long().contiguous(), sampled.to(torch.uint8).contiguous()
    q_form = q_form.to(torch.int32).contiguous()
    q_ids, q_probs = q_ids.long().contiguous(), q_probs.float().contiguous()
    q_dense = q_dense.float().contiguous()
    accept_u, sample_u = accept_u.double().contiguous(), sample_u.double().contiguous()
    _check_shapes(scores, draft, num_drafts, sampled, q_form, q_dense, q_ids, q_probs, accept_u, sample_u)
    workspace = torch.empty(batch, 2, vocab, dtype=torch.float32, device=scores.device)
    out = torch.empty(batch, 2, dtype=torch.int64, device=scores.device)
    present = {"q_dense": q_dense.shape == (batch, width, vocab), "q_ids": k > 0}  # absent: null for the kernel
    pointers = [t.data_ptr() for t in (scores, draft, num_drafts, sampled, q_form)]
    pointers += [q_dense.data_ptr() if present["q_dense"] else None] + [t.data_ptr() if present["q_ids"] else None
                                                                       for t in (q_ids, q_probs)]
    pointers += [t.data_ptr() for t in (accept_u, sample_u, workspace)]
    call_kernel("verify", scores.device, *pointers, batch, width, vocab, k, out.data_ptr())
    return out


def _greedy_launch(scores: torch.Tensor, draft: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """An all-greedy batch on the host build: a greedy row reads only its scores, drafts and count, so the proposal,
    uniform and workspace pointers go null (building them was most of a demo step's verify in the serving loop)."""
    batch, width = draft.shape
    vocab = scores.shape[-1]
    scores, draft, num_drafts = scores.float().contiguous(), draft.long().contiguous(), num_drafts.long().contiguous()
    if scores.shape != (batch, width + 1, vocab) or num_drafts.shape != (batch,):
        raise ValueError(f"dflash::verify_block: inconsistent shapes ({tuple(scores.shape)}, {tuple(draft.shape)}, "
                         f"{tuple(num_drafts.shape)})")
    sampled = torch.zeros(batch, dtype=torch.uint8)
    out = torch.empty(batch, 2, dtype=torch.int64)
    call_kernel("verify", scores.device, scores.data_ptr(), draft.data_ptr(), num_drafts.data_ptr(),
                sampled.data_ptr(), None, None, None, None, None, None, None, batch, width, vocab, 0, out.data_ptr())
    return out


@torch.library.custom_op("dflash::verify_block", mutates_args=())
def verify_block_kernel(scores: torch.Tensor, draft: torch.Tensor, num_drafts: torch.Tensor, sampled: torch.Tensor,
                        q_form: torch.Tensor, q_dense: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor,
                        accept_u: torch.Tensor, sample_u: torch.Tensor) -> torch.Tensor:
    """reference.verify_block's contract, in one launch (the host build on CPU tensors). A row the kernel refuses
    (a draft count outside 0..n, a token id outside the vocabulary, a q form without its tensors) comes back as
    (-1, -1)."""
    return _launch(scores, draft, num_drafts, sampled, q_form, q_dense, q_ids, q_probs, accept_u, sample_u)


@verify_block_kernel.register_fake
def _(scores, draft, num_drafts, sampled, q_form, q_dense, q_ids, q_probs, accept_u, sample_u):
    return draft.new_empty(draft.shape[0], 2, dtype=torch.int64)


def _check_shapes(scores, draft, num_drafts, sampled, q_form, q_dense, q_ids, q_probs, accept_u, sample_u) -> None:
    """The kernel trusts its arguments' shapes: a mismatch is a bug, refused before any memory is read. Only shapes
    are checked here (no value is read back: a CUDA graph can capture the op); the kernel checks each row's values."""
    batch, width = draft.shape
    vocab = scores.shape[-1]
    ok = (scores.shape == (batch, width + 1, vocab) and num_drafts.shape == sampled.shape == q_form.shape == (batch,)
          and accept_u.shape == (batch, width) and sample_u.shape == (batch,)
          and q_ids.shape == q_probs.shape and q_ids.shape[:2] == (batch, width)
          and q_dense.shape in ((batch, width, vocab), (0,)))
    if not ok:
        described = ", ".join(f"{tuple(t.shape)}" for t in (scores, draft, num_drafts, q_dense, q_ids, accept_u))
        raise ValueError(f"dflash::verify_block: inconsistent shapes ({described})")


def verify_block(scores: torch.Tensor, draft: torch.Tensor, num_drafts: torch.Tensor, sampled: torch.Tensor,
                 q_form: torch.Tensor | None = None, q_dense: torch.Tensor | None = None,
                 q_ids: torch.Tensor | None = None, q_probs: torch.Tensor | None = None,
                 accept_u: torch.Tensor | None = None, sample_u: torch.Tensor | None = None,
                 use_kernel: bool | None = None) -> torch.Tensor:
    """One verify step (reference.verify_block's contract; absent proposal tensors mean no row of that form, absent
    uniforms an all-greedy batch), on the kernel where dispatch picks it (use_kernel forces the choice). Returns
    [b, 2] int64 on the host: accepted count, next token (the step's one device-to-host read)."""
    batch, width = draft.shape
    device = scores.device
    if q_form is None:
        q_form = torch.zeros(batch, dtype=torch.int32, device=device)
    if q_dense is None:
        q_dense = torch.zeros(0, device=device)
    if q_ids is None:
        q_ids = torch.zeros(batch, width, 0, dtype=torch.int64, device=device)
        q_probs = torch.zeros(batch, width, 0, device=device)
    if accept_u is None:
        accept_u = torch.ones(batch, width, dtype=torch.float64, device=device)
        sample_u = torch.zeros(batch, dtype=torch.float64, device=device)
    args = (scores, draft, num_drafts, sampled, q_form, q_dense, q_ids, q_probs, accept_u, sample_u)
    if use_kernel is None:
        use_kernel = kernel_entry("verify", device, cpu_default=True) is not None and (
            device.type != "cuda" or scores.shape[-1] <= CUDA_MAX_VOCAB)
    if not use_kernel:
        return reference.verify_block(*args).cpu()
    launch = _launch if device.type == "cpu" else verify_block_kernel  # a CUDA launch stays capturable
    return _checked(launch(*args).cpu(), width, scores.shape[-1])


def _checked(out: torch.Tensor, width: int, vocab: int) -> torch.Tensor:
    """The kernel's [b, 2] answer, or an IndexError naming the rows it refused."""
    bad = (out[:, 0] < 0).nonzero()[:, 0].tolist()
    if bad:
        raise _refused(bad, width, vocab)
    return out


def _refused(rows: list[int], width: int, vocab: int) -> IndexError:
    return IndexError(f"dflash::verify_block: rows {rows} hold a draft count outside 0..{width}, a token id outside "
                      f"the vocabulary ({vocab}), or a q form without its tensors")


def verify_greedy(scores: torch.Tensor, draft: torch.Tensor, num_drafts: torch.Tensor) -> tuple[list[int], list[int]]:
    """verify_block for an all-greedy batch (logits [b, n+1, V], drafts [b, n], counts [b]): the accepted counts and
    next tokens as lists. On CPU the host build reads only these three (no proposal or uniform tensors built, no
    sampled flag read back), the serving loop's usual step. On CUDA the reference (PyTorch's argmax and a prefix
    match): on an H200 (2026-12-04, benchmarks/gpu_kernels.py, 152k vocabulary, block 8) it took 0.21 / 0.25 /
    0.19 ms at batch 1 / 8 / 32 against the kernel's 0.60 / 0.63 / 1.12 ms (a thread block per row walks 8 x 152k
    logits; sampled rows are the kernel's: 0.37 against 1.26 ms at batch 1)."""
    if scores.device.type == "cuda":
        out = verify_block(scores, draft, num_drafts, torch.zeros(draft.shape[0], dtype=torch.bool,
                                                                  device=scores.device), use_kernel=False)
        return out[:, 0].tolist(), out[:, 1].tolist()
    if scores.device.type == "cpu" and kernel_entry("verify", scores.device, cpu_default=True) is not None:
        rows = _greedy_launch(scores, draft, num_drafts).tolist()
        bad = [row for row, (accepted, _) in enumerate(rows) if accepted < 0]
        if bad:
            raise _refused(bad, draft.shape[1], scores.shape[-1])
        return [accepted for accepted, _ in rows], [token for _, token in rows]
    out = verify_block(scores, draft, num_drafts, torch.zeros(draft.shape[0], dtype=torch.bool, device=scores.device))
    return out[:, 0].tolist(), out[:, 1].tolist()
