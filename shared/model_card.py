"""What a model folder's card says about it: its license, from README.md's front matter (`license:`, and
`license_name:` for license: other) or config.json's "license". Plain text and JSON: no torch."""

import json
from pathlib import Path


def model_license(folder: str | Path | None) -> str | None:
    """The folder's license as its card or config names it; None where neither does (or there is no folder)."""
    if folder is None:
        return None
    folder = Path(folder)
    card = folder / "README.md"
    if card.is_file():
        lines = card.read_text(errors="replace").splitlines()
        if lines and lines[0].strip() == "---":
            fields = {}
            for line in lines[1:]:
                if line.strip() == "---":
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip().strip("'\"")
            name = fields.get("license_name") if fields.get("license") == "other" else None
            if name or fields.get("license"):
                return name or fields["license"]
    try:
        value = json.loads((folder / "config.json").read_text()).get("license")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None
