"""The first run of cuda_ext on a GPU, in one command: build the CUDA kernels for this device, run the kernel
tests (their GPU parity tests included: CUDA kernel against the host build and the PyTorch reference, and a CUDA
graph replay), then time each kernel against its PyTorch reference on the GPU:

- verify: a 152k-vocabulary step (block 8), greedy and sampled (sparse q of 32 candidates), batch 1, 8 and 32;
- block attention: a Qwen3-8B-shaped drafter layer (32 heads on 8 KV heads of 128, block 16, bfloat16 cache,
  ragged contexts of 512..2048), batch 1, 8 and 32;
- the DFlash 2 walk: block 16, 32 candidates, rank 256, 152k vocabulary, batch 1, 8 and 32.

Medians of CUDA-event timings after a warm-up. On a machine without a GPU it says so and exits 2; `--device
cpu` runs the same script on the host builds instead (a dry run of the script itself: small batches, one round).

    python benchmarks/gpu_kernels.py [--skip-tests] [--rounds 50] [--batches 1,8,32]
    DFLASH_KERNELS=host python benchmarks/gpu_kernels.py --device cpu --batches 1 --rounds 1
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


def median_ms(function, rounds: int, device: str) -> float:
    for _ in range(3 if device == "cuda" else 1):
        function()
    times = []
    for _ in range(rounds):
        if device != "cuda":
            started = time.perf_counter()
            function()
            times.append((time.perf_counter() - started) * 1e3)
            continue
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def verify_inputs(batch: int, vocab: int, width: int, sampled: bool, generator: torch.Generator, device: str):
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


def time_verify(rounds: int, batches: list[int], device: str) -> None:
    generator = torch.Generator().manual_seed(0)
    print("verify, 152k vocabulary, block 8 (ms; kernel includes the one device-to-host read)")
    for sampled in (False, True):
        for batch in batches:
            args = verify_inputs(batch, 151_936, 7, sampled, generator, device)
            kernel = median_ms(lambda: verify_block(*args, use_kernel=True), rounds, device)
            reference = median_ms(lambda: verify_reference.verify_block(*args).cpu(), rounds, device)
            on_host = [t.cpu() for t in args]  # the reference's sums in the kernels' order (CPU cumsum)
            same = torch.equal(verify_block(*args, use_kernel=True), verify_reference.verify_block(*on_host))
            print(f"  {'sampled' if sampled else 'greedy '} batch {batch:2d}: kernel {kernel:8.3f}  "
                  f"reference {reference:8.3f}  ({reference / kernel:5.1f}x)  same tokens: {same}")


def time_block_attention(rounds: int, batches: list[int], device: str) -> None:
    generator = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block, capacity = 32, 8, 128, 16, 2048 + 16
    print("block attention, Qwen3-8B-shaped drafter layer, bfloat16 cache, block 16 (ms)")
    for batch in batches:
        contexts = torch.randint(512, 2048, (batch,), generator=generator)
        keys = torch.randn(batch, kv_heads, capacity, dim, generator=generator).to(device, torch.bfloat16)
        values = torch.randn(batch, kv_heads, capacity, dim, generator=generator).to(device, torch.bfloat16)
        q = torch.randn(batch, heads, block, dim, generator=generator).to(device, torch.bfloat16)
        slots = torch.arange(batch, device=device)
        positions = (contexts[:, None] + torch.arange(block)).to(device)
        ends = (contexts + block).to(device)
        args = (q, keys, values, slots, ends, positions, 0, False, dim ** -0.5)
        kernel = median_ms(lambda: block_attention(*args, use_kernel=True), rounds, device)
        reference = median_ms(lambda: attention_reference.block_attention(*args), rounds, device)
        error = (block_attention(*args, use_kernel=True).float() - attention_reference.block_attention(*args).float())
        print(f"  batch {batch:2d}: kernel {kernel:8.3f}  reference {reference:8.3f}  ({reference / kernel:5.1f}x)  "
              f"max |diff| {error.abs().max().item():.2e}")


def time_walk(rounds: int, batches: list[int], device: str) -> None:
    generator = torch.Generator().manual_seed(2)
    vocab, rank, k, rows = 151_936, 256, 32, 15
    predecessor = torch.randn(vocab, rank, generator=generator).to(device) * 0.1
    successor = torch.randn(vocab, rank, generator=generator).to(device) * 0.1
    print("DFlash 2 walk, block 16, 32 candidates, rank 256 (ms)")
    for batch in batches:
        unary, candidates = torch.randn(batch, rows, vocab, generator=generator).to(device).topk(k, -1)
        anchors = torch.randint(0, vocab, (batch,), generator=generator).to(device)
        projected = torch.randn(batch, rows, rank, generator=generator).to(device)
        temperatures = torch.zeros(batch, device=device)
        temperatures[batch // 2:] = 0.8
        uniforms = torch.rand(batch, rows, generator=generator, dtype=torch.float64).to(device)
        args = (unary, candidates, anchors, projected, predecessor, successor, temperatures, uniforms)
        kernel = median_ms(lambda: walk(*args, use_kernel=True), rounds, device)
        reference = median_ms(lambda: walk_reference.walk(*args), rounds, device)
        same = torch.equal(walk(*args, use_kernel=True)[0], walk_reference.walk(*args)[0])
        print(f"  batch {batch:2d}: kernel {kernel:8.3f}  reference {reference:8.3f}  ({reference / kernel:5.1f}x)  "
              f"same path: {same}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no GPU visible to torch: nothing to run (the host builds are tested by the suite)")
        return 2
    started = time.perf_counter()
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, nvcc {build.find_nvcc()}")
        if build.cuda_library() is None:
            print("the CUDA build failed or cannot run here (see the warning above)")
            return 1
        print(f"CUDA kernels built/loaded in {time.perf_counter() - started:.1f} s")
    elif build.host_library() is None:
        print("the host build failed (see the warning above)")
        return 1
    if not args.skip_tests:
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", str(ROOT / "tests" / "test_cuda_ext.py")],
                               cwd=ROOT)
        if tests.returncode != 0:
            print("kernel tests failed: timings skipped")
            return tests.returncode
    time_verify(args.rounds, batches, args.device)
    time_block_attention(args.rounds, batches, args.device)
    time_walk(args.rounds, batches, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
