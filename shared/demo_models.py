"""Where the embedded default pair lives: models/demo in the source tree (trained, committed), else the random
stand-in built on the fly."""

import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

DEMO_DIR = Path(__file__).resolve().parents[1] / "models" / "demo"
# The demo drafters, preferred first: DFlash 2 (the faster, served at block 8), then the DFlash one it grew from.
DEMO_DRAFTERS = (("draft2", "its DFlash 2 drafter"), ("draft", "its DFlash drafter"))
RANDOM_PAIR_VERSION = "random-demo-v1"


def random_pair_dir() -> Path:
    """Where the random stand-in pair is built (once): the user cache, or $DFLASH_CACHE_DIR."""
    root = os.environ.get("DFLASH_CACHE_DIR") or Path.home() / ".cache" / "dflash"
    return Path(root) / RANDOM_PAIR_VERSION


def ensure_random_pair() -> tuple[Path, Path]:
    """(target, drafter) of the random pair, built by demo_build in a child process if missing (it needs the
    models' code, which shared/ does not import)."""
    root = random_pair_dir()
    if not (root / "target" / "config.json").is_file() or not (root / "draft" / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "demo_build.random_pair", str(root)], check=True)
    return root / "target", root / "draft"


class DefaultPair(NamedTuple):
    target: Path
    draft: Path
    label: str  # which pair this is, for a start-up message
    embedded: bool  # the trained models/demo target (False: the random stand-in)


def default_pair(draft: str | Path | None = None, demo_dir: Path = DEMO_DIR) -> DefaultPair:
    """The target and drafter to use when no --target is given. draft: the user's drafter, which replaces the
    demo drafter (only the demo target is then needed, and the label names the user's drafter)."""
    target = demo_dir / "target"
    if (target / "config.json").is_file():
        if draft is not None:
            label = f"the embedded demo target (models/demo: a small Python code model), with the drafter {str(draft)!r}"
            return DefaultPair(target, Path(draft), label, True)
        for name, which in DEMO_DRAFTERS:
            if (demo_dir / name / "config.json").is_file():
                label = f"the embedded demo pair (models/demo: a small Python code model and {which})"
                return DefaultPair(target, demo_dir / name, label, True)
    random_target, random_draft = ensure_random_pair()
    why = "models/demo is missing, output is gibberish"
    if draft is not None:
        label = f"the RANDOM (untrained) demo target ({why}), with the drafter {str(draft)!r}"
        return DefaultPair(random_target, Path(draft), label, False)
    return DefaultPair(random_target, random_draft, f"the RANDOM (untrained) demo pair: {why}", False)
