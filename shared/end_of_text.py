"""The token ids that end a target's text: its config's eos ids and tokenizer_config.json's eos_token (the gateway's
stop tokens, and the ends a grammar allows in the verify worker: one rule for both)."""

import json
from pathlib import Path

from tokenizers import Tokenizer

from shared.errors import ConfigError


def token_text(value) -> str | None:
    """A tokenizer_config.json token entry's text: a string, or an AddedToken's {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_settings(folder: str | Path) -> dict:
    """tokenizer_config.json of a model folder ({} where it has none)."""
    path = Path(folder) / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{str(path)!r} is not valid JSON: {exc}") from None


def end_of_text_ids(tokenizer: Tokenizer, settings: dict, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    """config_eos, then tokenizer_config's eos_token where the tokenizer knows it; each once."""
    ids = list(config_eos)
    eos = token_text(settings.get("eos_token"))
    if eos is not None and tokenizer.token_to_id(eos) is not None:
        ids.append(tokenizer.token_to_id(eos))
    return tuple(dict.fromkeys(ids))
