"""Typed readers for configuration from the environment.

Every CLI flag has an environment variable; these helpers parse them and fail loudly, naming the
variable, when a value is malformed. A secret may also come from ``NAME_FILE`` (a path to read).
"""

import math
import os
from pathlib import Path

from runtime.errors import ConfigError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str | None = None) -> str | None:
    """Return ``$NAME``, else the contents of the file named by ``$NAME_FILE``, else ``default``."""
    value = os.environ.get(name)
    if value is not None:
        return value
    file_name = os.environ.get(f"{name}_FILE")
    if file_name:
        try:
            return Path(file_name).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{name}_FILE={file_name!r} cannot be read: {exc.strerror}") from exc
    return default


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``$NAME`` as an int within ``[minimum, maximum]``; raise ConfigError otherwise."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} is not an integer") from exc
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={value} is below the minimum {minimum}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name}={value} is above the maximum {maximum}")
    return value


#: Variables huggingface_hub reads as whole numbers as it is imported: any other value makes every import of it
#: raise (huggingface_hub 2.4), so a command that downloads models would die with a traceback.
HUB_WHOLE_NUMBER_VARIABLES = ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT")


def check_hub_variables() -> None:
    """Raise ConfigError for a variable of HUB_WHOLE_NUMBER_VARIABLES that huggingface_hub would fail on."""
    for name in HUB_WHOLE_NUMBER_VARIABLES:
        raw = os.environ.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            int(raw)
        except ValueError:
            raise ConfigError(
                f"{name}={raw!r} is not a whole number of seconds: huggingface_hub, which downloads models, reads "
                "it as one and cannot start otherwise (set it to 1 or more, or unset it)"
            ) from None


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    """Return ``$NAME`` as a finite float no smaller than ``minimum``; raise ConfigError otherwise."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} is not a number") from exc
    # float() accepts "nan" and "inf", which slip past every comparison below.
    if not math.isfinite(value):
        raise ConfigError(f"{name}={raw!r} is not a finite number")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={value} is below the minimum {minimum}")
    return value


def env_bool(name: str, default: bool) -> bool:
    """Return ``$NAME`` as a bool (1/true/yes/on or 0/false/no/off); raise ConfigError otherwise."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def env_list(name: str, default: tuple[str, ...] = ()) -> list[str]:
    """Return ``$NAME`` split on commas, each item stripped, empty items dropped; ``default`` when unset or blank."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return list(default)
    return [item.strip() for item in raw.split(",") if item.strip()]
