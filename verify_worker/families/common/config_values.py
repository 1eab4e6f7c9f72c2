"""Reading config.json values with errors that name the key."""

from shared.errors import ConfigError


def config_int(config: dict, key: str, default: int | None = None, minimum: int = 1) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"config.json: {key!r} must be an integer >= {minimum}, got {value!r}")
    return value
