"""Kernels for the per-step costs of both workers: verification (verify/), the drafter's block attention
(block_attention/), the DFlash 2 selector's walk (dflash2_walk/), and the row-invariant target step of
--batch-invariant: attention (row_attention/), RMSNorm (row_norm/) and, CUDA only, the GEMM (row_gemm/). Each
folder holds the per-row logic written once for both builds (rows.h), the CUDA kernel (kernel.cu), the host build
of the same logic (host.cpp), the PyTorch reference that is the CPU path or the test oracle (reference.py), and
the torch custom op with its fake implementation and the dispatch by device (op.py). See build.py for how the
builds are made and dispatch.py for which one runs."""
