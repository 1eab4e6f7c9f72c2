"""The first run of cuda_ext on a GPU, in one command: build the CUDA kernels for this device, run the kernel
tests (their GPU parity tests included: CUDA kernel against the host build and the PyTorch reference, and a CUDA
graph replay), then time each kernel against its PyTorch reference on the GPU:

- verify: a 152k-vocabulary step (block 8), greedy and sampled (sparse q of 32 candidates), batch 1, 8 and 32;
- block attention: a Qwen3-8B-shaped drafter layer (32 heads on 8 KV heads of 128, block 16, bfloat16 cache,
  ragged contexts of 512..2048), batch 1, 8 and 32;
- the DFlash 2 walk: block 16, 32 candidates, rank 256, 152k vocabulary, batch 1, 8 and 32.

Medians of CUDA-event timings after a warm-up. On a machine without a GPU it says so and exits 2.

    python benchmarks/gpu_kernels.py [--skip-tests] [--rounds 50]
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cuda_ext import build  # noqa: E402
from cuda_ext.block_attention import reference as attention_reference  # noqa: E402
from cuda_ext.block_attention.op import block_attention  # noqa: E402
from cuda_ext.dflash2_walk import reference as walk_reference  # noqa: E402
from cuda_ext.dflash2_walk.op import walk  # noqa: E402
from cuda_ext.verify import reference as verify_reference  # noqa: E402
from cuda_ext.verify.op import verify_block  # noqa: E402
from cuda_ext.verify.reference import SPARSE  # noqa: E402


def median_ms(function, rounds: int) -> float:
    for _ in range(3):
        function()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def verify_inputs(batch: int, vocab: int, width: int, sampled: bool, generator: torch.Generator):
    device = "cuda"
    logits = torch.randn(batch, width + 1, vocab, generator=generator).to(device) * 3
    scores = torch.softmax(logits, -1) if sampled else logits
    draft = logits[:, :width].argmax(-1)
    draft[:, width // 2] = (draft[:, width // 2] + 1) % vocab  # a rejection half way
    k = 32
    q_ids = torch.randint(0, vocab, (batch, width, k), generator=generator).to(device)
    q_ids[..., 0] = draft
    q_probs = torch.softmax(torch.randn(batch, width, k, generator=generator), -1).to(device)
    return (scores, draft, torch.full((batch,), width, device=device),
            torch.full((batch,), sampled, dtype=torch.bool, device=device),
            torch.full((batch,), SPARSE, dtype=torch.int32, device=device), torch.zeros(0, device=device), q_ids,
            q_probs, torch.rand(batch, width, generator=generator, dtype=torch.float64).to(device),
            torch.rand(batch, generator=generator, dtype=torch.float64).to(device))


def time_verify(rounds: int) -> None:
    generator = torch.Generator().manual_seed(0)
    print("verify, 152k vocabulary, block 8 (ms; kernel includes the one device-to-host read)")
    for sampled in (False, True):
        for batch in (1, 8, 32):
            args = verify_inputs(batch, 151_936, 7, sampled, generator)
            kernel = median_ms(lambda: verify_block(*args, use_kernel=True), rounds)
            reference = median_ms(lambda: verify_reference.verify_block(*args).cpu(), rounds)
            on_host = [t.cpu() for t in args]  # the reference's sums in the kernels' order (CPU cumsum)
            same = torch.equal(verify_block(*args, use_kernel=True), verify_reference.verify_block(*on_host))
            print(f"  {'sampled' if sampled else 'greedy '} batch {batch:2d}: kernel {kernel:8.3f}  "
                  f"reference {reference:8.3f}  ({reference / kernel:5.1f}x)  same tokens: {same}")


def time_block_attention(rounds: int) -> None:
    generator = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block, capacity = 32, 8, 128, 16, 2048 + 16
    print("block attention, Qwen3-8B-shaped drafter layer, bfloat16 cache, block 16 (ms)")
    for batch in (1, 8, 32):
        contexts = torch.randint(512, 2048, (batch,), generator=generator)
        keys = torch.randn(batch, kv_heads, capacity, dim, generator=generator).to("cuda", torch.bfloat16)
        values = torch.randn(batch, kv_heads, capacity, dim, generator=generator).to("cuda", torch.bfloat16)
        q = torch.randn(batch, heads, block, dim, generator=generator).to("cuda", torch.bfloat16)
        slots = torch.arange(batch, device="cuda")
        positions = (contexts[:, None] + torch.arange(block)).cuda()
        ends = (contexts + block).cuda()
        args = (q, keys, values, slots, ends, positions, 0, False, dim ** -0.5)
        kernel = median_ms(lambda: block_attention(*args, use_kernel=True), rounds)
        reference = median_ms(lambda: attention_reference.block_attention(*args), rounds)
        error = (block_attention(*args, use_kernel=True).float() - attention_reference.block_attention(*args).float())
        print(f"  batch {batch:2d}: kernel {kernel:8.3f}  reference {reference:8.3f}  ({reference / kernel:5.1f}x)  "
              f"max |diff| {error.abs().max().item():.2e}")


def time_walk(rounds: int) -> None:
    generator = torch.Generator().manual_seed(2)
    vocab, rank, k, rows = 151_936, 256, 32, 15
    predecessor = torch.randn(vocab, rank, generator=generator).cuda() * 0.1
    successor = torch.randn(vocab, rank, generator=generator).cuda() * 0.1
    print("DFlash 2 walk, block 16, 32 candidates, rank 256 (ms)")
    for batch in (1, 8, 32):
        unary, candidates = torch.randn(batch, rows, vocab, generator=generator).cuda().topk(k, -1)
        anchors = torch.randint(0, vocab, (batch,), generator=generator).cuda()
        projected = torch.randn(batch, rows, rank, generator=generator).cuda()
        temperatures = torch.zeros(batch, device="cuda")
        temperatures[batch // 2:] = 0.8
        uniforms = torch.rand(batch, rows, generator=generator, dtype=torch.float64).cuda()
        args = (unary, candidates, anchors, projected, predecessor, successor, temperatures, uniforms)
        kernel = median_ms(lambda: walk(*args, use_kernel=True), rounds)
        reference = median_ms(lambda: walk_reference.walk(*args), rounds)
        same = torch.equal(walk(*args, use_kernel=True)[0], walk_reference.walk(*args)[0])
        print(f"  batch {batch:2d}: kernel {kernel:8.3f}  reference {reference:8.3f}  ({reference / kernel:5.1f}x)  "
              f"same path: {same}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no GPU visible to torch: nothing to run (the host builds are tested by the suite)")
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, nvcc {build.find_nvcc()}")
    started = time.perf_counter()
    if build.cuda_library() is None:
        print("the CUDA build failed (see the warning above)")
        return 1
    print(f"CUDA kernels built/loaded in {time.perf_counter() - started:.1f} s")
    if not args.skip_tests:
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", str(ROOT / "tests" / "test_cuda_ext.py")],
                               cwd=ROOT)
        if tests.returncode != 0:
            print("kernel tests failed: timings skipped")
            return tests.returncode
    time_verify(args.rounds)
    time_block_attention(args.rounds)
    time_walk(args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
