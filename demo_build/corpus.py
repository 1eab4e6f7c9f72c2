"""The demo corpus: the Python standard library's own source (Lib/ only, no site-packages, no tests), with a
fixed set of modules held out for validation and for the benchmark prompts."""

import sysconfig
from pathlib import Path

HELD_OUT = (
    "json/", "csv.py", "heapq.py", "bisect.py", "textwrap.py", "shlex.py", "fractions.py", "statistics.py",
    "difflib.py", "string.py", "glob.py", "fnmatch.py", "calendar.py", "colorsys.py", "graphlib.py",
    "ipaddress.py", "pprint.py", "queue.py", "sched.py", "secrets.py", "tokenize.py", "ast.py", "dataclasses.py",
    "functools.py", "operator.py", "enum.py", "uuid.py", "zipapp.py", "wave.py", "numbers.py",
)
SKIPPED_DIRS = ("site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_files(root: Path | None = None) -> list[Path]:
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(part in SKIPPED_DIRS for part in parts[:-1]):
            continue
        files.append(path)
    return files


def is_held_out(path: Path, root: Path | None = None) -> bool:
    relative = path.relative_to(root or stdlib_root()).as_posix()
    return any(relative == h or (h.endswith("/") and relative.startswith(h)) for h in HELD_OUT)


def split(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files)."""
    files = python_files(root)
    held = [f for f in files if is_held_out(f, root)]
    return [f for f in files if not is_held_out(f, root)], held


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")
