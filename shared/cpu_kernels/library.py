"""Building and loading the C++ CPU kernels (bf16_gemm.cpp, attention.cpp): compiled on first use with the system's C++
compiler (about a second; no torch headers) into a cache folder keyed by the source and flags, loaded with
ctypes. Without a compiler, on a CPU without AVX2 + FMA, or with DFLASH_CPU_KERNELS=off, `cpu_kernels()` is
None and every caller keeps its PyTorch path.

Cache folder: $DFLASH_KERNEL_CACHE, else ~/.cache/dflash-serve/kernels. Compiler: $CXX, else c++.
"""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from shared.attention import cached_attention

SOURCES = [Path(__file__).with_name(name) for name in ("bf16_gemm.cpp", "attention.cpp")]
FLAGS = ["-std=c++17", "-O3", "-mavx2", "-mfma", "-shared", "-fPIC"]
TILE = 16  # output columns per weight tile (kTile in the source)


class CpuKernels:
    """The loaded library's functions, with tensor-level wrappers."""

    def __init__(self, library: ctypes.CDLL):
        self._gemm = library.dflash_bf16_gemm
        self._gemm.restype = None
        self._gemm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_void_p]
        self._attention = library.dflash_attention
        self._attention.restype = ctypes.c_int
        self._attention.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_void_p] + \
            [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_void_p]

    def __deepcopy__(self, memo) -> "CpuKernels":
        return self  # the loaded library is shared (ctypes functions cannot be copied)

    @staticmethod
    def bf16_tiles(weight: torch.Tensor) -> torch.Tensor:
        """weight [out, in] (float32 values exactly representable in bfloat16) -> the kernel's layout:
        [ceil(out / 16), in, 16] bfloat16, the last tile zero-padded."""
        out_features, in_features = weight.shape
        tiles = -(-out_features // TILE)
        padded = weight.new_zeros(tiles * TILE, in_features, dtype=torch.bfloat16)
        padded[:out_features] = weight.to(torch.bfloat16)
        return padded.view(tiles, TILE, in_features).transpose(1, 2).contiguous()  # [tiles, in, 16]

    def bf16_matmul(self, x: torch.Tensor, tiles: torch.Tensor, out_features: int) -> torch.Tensor:
        """x [..., in] float32 @ the tiled weight -> [..., out] float32 (rows computed independently)."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # [m, in]
        out = torch.empty(rows.shape[0], out_features, dtype=torch.float32, device=x.device)
        if rows.shape[0]:
            self._gemm(rows.data_ptr(), rows.shape[0], rows.shape[1], tiles.data_ptr(), out_features,
                       out.data_ptr())
        return out.view(*x.shape[:-1], out_features)


    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
        """shared.attention.cached_attention's contract, computed row by row (see attention.cpp): q [batch, heads,
        queries, dim]; k, v [batch, kv_heads, keys, dim] (cache views: only the last two dims need be dense);
        mask [batch, 1, queries, keys]. Returns [batch, queries, heads * dim]. Float32 only; other head sizes
        (not a multiple of 8, or over 256) take cached_attention."""
        batch, heads, queries, dim = q.shape
        kv_heads, keys = k.shape[1], k.shape[2]
        if q.dtype != torch.float32 or dim % 8 or dim > 256:
            return cached_attention(q, k, v, mask, scale)
        q = q.contiguous()
        k, v = (t if t.stride(-1) == 1 and t.stride(-2) == dim else t.contiguous() for t in (k, v))
        visible = mask.expand(batch, 1, queries, keys)[:, 0].contiguous().view(torch.uint8)  # [batch, queries, keys]
        out = torch.empty(batch, queries, heads * dim, dtype=torch.float32, device=q.device)
        if out.numel():
            self._attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), v.stride(0),
                            v.stride(1), visible.data_ptr(), batch, heads, kv_heads, queries, keys, dim, scale,
                            out.data_ptr())
        return out


def bf16_exact(weight: torch.Tensor) -> bool:
    """Whether every value of a float32 tensor survives a round trip through bfloat16 unchanged."""
    return bool(torch.equal(weight.to(torch.bfloat16).to(weight.dtype), weight))


def cache_folder() -> Path:
    configured = os.environ.get("DFLASH_KERNEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "dflash-serve" / "kernels"


def _why_unavailable(compiler: str | None) -> str:
    """Why this machine cannot use the kernels ("" when it can)."""
    if os.environ.get("DFLASH_CPU_KERNELS", "auto").lower() in ("off", "0", "false", "no"):
        return "DFLASH_CPU_KERNELS=off"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"a {platform.machine()} CPU (the kernels are AVX2)"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "a CPU without AVX2"
    if compiler is None:
        return "no C++ compiler ($CXX or c++)"
    return ""


def _build(compiler: str, target: Path) -> None:
    """Compile into a private file, then rename: processes that build at once never load a half-written one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([compiler, *FLAGS, "-o", str(built), *map(str, SOURCES)], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(built, target)


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The kernels, built if needed (once per process); None where they cannot run (logged once)."""
    log = logging.getLogger("dflash.cpu_kernels")
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    why = _why_unavailable(compiler)
    if why:
        log.info("C++ CPU kernels off (%s): float32 projections use PyTorch's GEMM", why)
        return None
    sources = b"".join(source.read_bytes() for source in SOURCES)
    key = hashlib.sha256(sources + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    target = cache_folder() / key / "libdflash_cpu.so"
    try:
        if not target.exists():
            _build(compiler, target)
        return CpuKernels(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("C++ CPU kernels unavailable (build or load failed: %s): float32 projections use PyTorch's GEMM",
                    str(detail).strip()[:500])
        return None
