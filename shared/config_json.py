"""Reading a checkpoint folder's config.json (torch-free: every role reads it)."""

import json
from pathlib import Path

from shared.errors import CheckpointError


def read_config(folder: str | Path) -> dict:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {str(folder)!r} does not exist")
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{str(path)!r} is missing: a checkpoint folder needs a config.json")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{str(path)!r} must hold a JSON object")
    return config
