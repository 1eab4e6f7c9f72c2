"""Reading config.json values with errors that name the file and the key (torch-free)."""

from shared.errors import ConfigError


def config_int(config: dict, key: str, default: int | None = None, minimum: int = 1,
               where: str = "config.json") -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"{where}: {key!r} must be {wanted}, got {value!r}")
    return value
