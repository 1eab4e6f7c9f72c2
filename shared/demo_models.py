"""Where the embedded default pair lives: models/demo in the source tree (trained, committed), else the random
stand-in built on the fly."""

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parents[1] / "models" / "demo"


def default_pair() -> tuple[Path, Path, str]:
    """(target folder, drafter folder, a label saying which pair it is)."""
    target, draft = DEMO_DIR / "target", DEMO_DIR / "draft"
    if (target / "config.json").is_file() and (draft / "config.json").is_file():
        return target, draft, "the embedded demo pair (models/demo: a small Python code model and its DFlash drafter)"
    from draft_worker.random_pair import ensure_random_pair

    target, draft = ensure_random_pair()
    return target, draft, "the RANDOM (untrained) demo pair: models/demo is missing, output is gibberish"
