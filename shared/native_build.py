"""Compiling hand-written native sources into a shared library once, cached by content: the C++ CPU kernels
(shared/cpu_kernels) and the host and CUDA builds of cuda_ext/ use it. The library lands in a folder keyed by a
hash of the sources, the headers they include and the command, so a changed source or flag builds anew and
processes that start together never load a half-written file.

Cache folder: $DFLASH_KERNEL_CACHE, else ~/.cache/dflash-serve/kernels.
"""

import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path


def cache_folder() -> Path:
    configured = os.environ.get("DFLASH_KERNEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "dflash-serve" / "kernels"


def build_key(command: list[str], inputs: list[Path]) -> str:
    """A hash of the compile command and every input file's bytes (sources and headers)."""
    digest = hashlib.sha256(" ".join(command).encode())
    for path in sorted(inputs):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def cached_library(name: str, command: list[str], sources: list[Path], headers: list[Path] = (),
                   timeout: float = 300) -> Path:
    """The shared library `name` built by `command + ["-o", OUT, *sources]` (cached). Raises
    subprocess.CalledProcessError (with the compiler's stderr) or OSError when the build fails."""
    target = cache_folder() / build_key(command, [*sources, *headers]) / name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logging.getLogger("dflash.native_build").info("compiling %s (first use) into %s", name, target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / name
        subprocess.run([*command, "-o", str(built), *map(str, sources)], check=True, capture_output=True, text=True,
                       timeout=timeout)
        os.replace(built, target)  # atomic: a process building at the same time loads one whole file or the other
    return target
