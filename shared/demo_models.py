"""Where the embedded default pair lives: models/demo in the source tree (trained, committed), else the random
stand-in built on the fly."""

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parents[1] / "models" / "demo"
DEFAULT_DRAFTER = "draft2"  # the DFlash 2 drafter: the faster of the two demo drafters (see docs/architecture.md)


def default_pair(draft: str | Path | None = None) -> tuple[Path, Path, str]:
    """(target folder, drafter folder, a label saying which pair it is). draft: the user's drafter, which
    replaces the demo drafter (the label then names it)."""
    target, demo_draft = DEMO_DIR / "target", DEMO_DIR / DEFAULT_DRAFTER
    if (target / "config.json").is_file() and (demo_draft / "config.json").is_file():
        pair = "the embedded demo pair (models/demo: a small Python code model and its DFlash 2 drafter)"
        target_only = "the embedded demo target (models/demo: a small Python code model)"
    else:
        from draft_worker.random_pair import ensure_random_pair

        target, demo_draft = ensure_random_pair()
        pair = "the RANDOM (untrained) demo pair: models/demo is missing, output is gibberish"
        target_only = "the RANDOM (untrained) demo target: models/demo is missing, output is gibberish"
    if draft is None:
        return target, demo_draft, pair
    return target, Path(draft), f"{target_only}, with the drafter {str(draft)!r}"
