"""Building the kernels of cuda_ext/: each kernel folder holds rows.h (its per-row logic, DFLASH_HD functions),
host.cpp (the host build: those functions on one CPU thread) and kernel.cu (the CUDA kernel calling the same
functions). Both builds export plain C functions, loaded with ctypes; no torch headers are compiled (the CPU torch
wheel ships incomplete CUDA headers, and a torch extension takes a minute per file on a small machine).

- The host build compiles on first use with the system C++ compiler ($CXX, else c++), about a second; with AVX2
  where the CPU has it (the same bits: `host_flags`).
- The CUDA build compiles on first use with nvcc ($DFLASH_NVCC, else nvcc on PATH, else $CUDA_HOME/bin/nvcc) for
  the device's own architecture, only where torch sees a GPU.
- `compile_objects` compiles every kernel.cu to objects for sm_90 and sm_121 (H100/H200 and the DGX Spark's
  GB10) without a GPU: the CI check that the CUDA sources build.

Builds are cached by content (shared/native_build.py): $DFLASH_KERNEL_CACHE, else ~/.cache/dflash-serve/kernels.
"""

import ctypes
import functools
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from shared.native_build import cached_library

ROOT = Path(__file__).resolve().parent
KERNELS = ("verify", "block_attention", "dflash2_walk", "row_attention", "row_norm")  # a host build and a CUDA build each
CUDA_ONLY_KERNELS = ("row_gemm",)  # tensor-core code: no host build (its CPU path is row_gemm/reference.py)
HOST_FLAGS = ["-std=c++17", "-O3", "-ffp-contract=off", "-shared", "-fPIC"]
# where the CPU has AVX2 the host build may use its 8-wide registers: the same bits (no fused multiply-add, no
# reordered sums: -ffp-contract=off and no -ffast-math), the DFlash 2 walk's 8 partial sums in one register (a
# sampled demo walk of 1024 candidates 0.46 -> 0.38-0.41 ms a block, 6.4 -> 5.1-5.2 ms for 16; served sampled
# at 16 streams the draft phase 13.0 -> 12.2 ms)
AVX2_FLAGS = ["-mavx2"]
NVCC_FLAGS = ["-std=c++17", "-O3", "--fmad=false", "-Xcompiler", "-fPIC,-ffp-contract=off"]
CI_ARCHS = ("90", "121")

P, I64, F32, F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double
# each kernel's C entry point (dflash_<kernel>_host / _cuda) and its arguments; the CUDA one adds a stream
SIGNATURES = {
    "verify": [P] * 11 + [I64] * 4 + [P],
    "block_attention": [P] * 6 + [I64] * 10 + [F32, P],
    "dflash2_walk": [P] * 8 + [I64] * 5 + [P] * 3,
    "row_attention": [P] * 7 + [I64] * 9 + [F32],
    "row_norm": [P] * 3 + [I64] * 4 + [F32],
}
CUDA_ONLY_SIGNATURES = {
    "row_gemm": [P] * 4 + [I64] * 8,
}


def headers() -> list[Path]:
    return sorted([*ROOT.rglob("*.h"), *ROOT.rglob("*.cuh")])


def host_sources() -> list[Path]:
    return [ROOT / kernel / "host.cpp" for kernel in KERNELS]


def cuda_sources() -> list[Path]:
    return [ROOT / kernel / "kernel.cu" for kernel in (*KERNELS, *CUDA_ONLY_KERNELS)] + [ROOT / "common" / "errors.cu"]


def _bind(library: ctypes.CDLL, suffix: str, extra: list, signatures: dict = SIGNATURES) -> dict:
    functions = {}
    for kernel, argtypes in signatures.items():
        function = getattr(library, f"dflash_{kernel}_{suffix}")
        function.restype = ctypes.c_int
        function.argtypes = argtypes + extra
        functions[kernel] = function
    return functions


def host_flags() -> list[str]:
    """The host build's compiler flags on this CPU (the cache key includes them: a CPU without AVX2 builds its own)."""
    avx2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return HOST_FLAGS + (AVX2_FLAGS if avx2 else [])


@functools.cache
def host_library() -> dict | None:
    """The host build's entry points by kernel name, built if needed; None without a C++ compiler (logged)."""
    log = logging.getLogger("dflash.cuda_ext")
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        log.info("cuda_ext host build off (no C++ compiler: $CXX or c++): the PyTorch references run")
        return None
    try:
        path = cached_library("libdflash_ext_host.so", [compiler, *host_flags()], host_sources(), headers())
        return _bind(ctypes.CDLL(str(path)), "host", [])
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("cuda_ext host build failed (%s): the PyTorch references run",
                    str(getattr(exc, "stderr", "") or exc).strip()[:500])
        return None


def find_nvcc() -> str | None:
    configured = os.environ.get("DFLASH_NVCC")
    if configured:
        return shutil.which(configured)
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidate = Path(home) / "bin" / "nvcc" if home else None
    return str(candidate) if candidate is not None and candidate.exists() else None


def gencode(arch: str) -> list[str]:
    return ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]


class CudaBuild:
    """The CUDA build's entry points by kernel name (each takes a cudaStream_t last), and the name of a CUDA error
    behind a positive status."""

    def __init__(self, library: ctypes.CDLL):
        self.entries = _bind(library, "cuda", [P], {**SIGNATURES, **CUDA_ONLY_SIGNATURES})
        self._error_name = library.dflash_cuda_error_name
        self._error_name.restype, self._error_name.argtypes = ctypes.c_char_p, [ctypes.c_int]
        self._probes = {kernel: getattr(library, f"dflash_{kernel}_probe") for kernel in (*KERNELS, *CUDA_ONLY_KERNELS)}
        for probe in self._probes.values():
            probe.restype, probe.argtypes = ctypes.c_int, []

    def __getitem__(self, kernel: str):
        return self.entries[kernel]

    def error_name(self, error: int) -> str:
        return self._error_name(error).decode(errors="replace")

    def probe(self) -> str:
        """"" if every kernel can run on the current device, else what stops it (a driver older than the
        runtime nvcc linked in, no code for this architecture)."""
        for kernel, probe in self._probes.items():
            error = probe()
            if error:
                return f"{kernel}: {self.error_name(error)}"
        return ""


@functools.cache
def cuda_library(device_index: int = 0) -> CudaBuild | None:
    """The CUDA build for the architecture of GPU `device_index`, built if needed and probed there once; None
    without a GPU, without nvcc, or when it cannot run (logged: the PyTorch references run on the GPU)."""
    import torch

    log = logging.getLogger("dflash.cuda_ext")
    if not torch.cuda.is_available():
        return None
    nvcc = find_nvcc()
    if nvcc is None:
        log.warning("cuda_ext CUDA kernels off (no nvcc: set DFLASH_NVCC or CUDA_HOME): the PyTorch references run")
        return None
    major, minor = torch.cuda.get_device_capability(device_index)
    command = [nvcc, *NVCC_FLAGS, "-shared", *gencode(f"{major}{minor}")]
    try:
        path = cached_library(f"libdflash_ext_cuda_sm{major}{minor}.so", command, cuda_sources(), headers(), 900)
        built = CudaBuild(ctypes.CDLL(str(path)))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("cuda_ext CUDA build failed (%s): the PyTorch references run",
                    str(getattr(exc, "stderr", "") or exc).strip()[:500])
        return None
    with torch.cuda.device(device_index):
        why = built.probe()
    if why:
        log.warning("cuda_ext CUDA kernels cannot run on GPU %d (%s): the PyTorch references run", device_index, why)
        return None
    return built


def compile_objects(out_dir: Path, archs=CI_ARCHS, nvcc: str | None = None) -> list[Path]:
    """nvcc -c of every CUDA source for the given architectures (no GPU needed), the files side by side; raises
    CalledProcessError with the compiler's output on an error. Returns the objects."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (set DFLASH_NVCC or CUDA_HOME)")
    out_dir.mkdir(parents=True, exist_ok=True)
    running = []
    for source in cuda_sources():
        target = out_dir / f"{source.parent.name if source.parent.name != 'common' else source.stem}.o"
        command = [nvcc, *NVCC_FLAGS, "-c", *[flag for arch in archs for flag in gencode(arch)], "-o", str(target),
                   str(source)]
        running.append((command, target, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                           text=True)))
    for command, _, process in running:
        output, _ = process.communicate(timeout=600)
        if process.returncode:
            raise subprocess.CalledProcessError(process.returncode, command, output=output, stderr=output)
    return [target for _, target, _ in running]
