"""Flags that also read an environment variable, which is checked exactly as the flag would be.

argparse alone falls short here: a string default goes through the flag's ``type`` but never through
its ``choices`` (``FLOTILLA_ROUTER_MODE=bogus`` would pass and fail later with a traceback), and its
error names the flag, not the variable that held the bad value. So each flag declares its variable
(``add_flag(..., env="FLOTILLA_X")``), the variable's value becomes the flag's default once it has
gone through the flag's own type and choices, and a bad value is kept as an error that
``check_environment()`` raises after parsing, so that ``--help`` still works.
"""

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from runtime.config import env_str
from runtime.errors import ConfigError


class EnvArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose ``add_flag`` options each have an environment variable."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: flag -> its variable, in the order they were added.
        self.variables: dict[str, str] = {}
        self._environment_errors: list[ConfigError] = []

    def add_flag(
        self,
        flag: str,
        *,
        env: str,
        help: str,
        type: Callable[[str], Any] = str,
        choices: Sequence[str] | None = None,
        default: Any = None,
        switch: bool = False,
        repeat: bool = False,
    ) -> None:
        """Add ``flag``, taking its default from ``$env`` (or ``${env}_FILE``) when set.

        A ``switch`` takes no value on the command line (``--reuse-port``); its variable is a boolean
        (1/0, true/false, yes/no, on/off). A ``repeat`` flag may be given several times (a list of values;
        None when never given); its variable holds values separated by commas, to which the command line's
        are added. The help text gets `` [ENV]`` appended. A value the flag would refuse is recorded, and
        raised by ``check_environment()``; it is an error even when the flag is also given, since it would
        break the next run that leaves the flag out.
        """
        self.variables[flag] = env
        try:
            raw = env_str(env)
            # Blank counts as unset, as in the other readers (runtime/config.py): EnvironmentFile
            # templates often list every variable with an empty value.
            if raw is not None and raw.strip() and repeat:
                default = [_convert(env, part.strip(), type, choices) for part in raw.split(",") if part.strip()]
            elif raw is not None and raw.strip():
                default = _convert(env, raw, parse_boolean if switch else type, choices)
        except ConfigError as exc:
            self._environment_errors.append(exc)
        if switch:
            self.add_argument(flag, action="store_const", const=True, default=bool(default), help=f"{help} [{env}]")
            return
        if repeat:
            # The command line's values are added to the variable's (argparse appends to a copy of the default).
            self.add_argument(
                flag, type=type, choices=choices, default=default, action="append", help=f"{help} [{env}]"
            )
            return
        self.add_argument(flag, type=type, choices=choices, default=default, help=f"{help} [{env}]")

    def check_environment(self) -> None:
        """Raise ConfigError for the first environment variable that its flag would refuse."""
        if self._environment_errors:
            raise self._environment_errors[0]


def _convert(env: str, raw: str, type: Callable[[str], Any], choices: Sequence[str] | None) -> Any:
    """``raw`` through ``type`` and ``choices``, as argparse would take it from the command line.

    Raises ConfigError naming ``env``, the value, and what is allowed.
    """
    try:
        value = type(raw)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{env}: {exc}") from None
    except (TypeError, ValueError):
        name = getattr(type, "__name__", "value")
        raise ConfigError(f"{env}={raw!r} is not a valid {name}") from None
    if choices is not None and value not in choices:
        raise ConfigError(f"{env}={raw!r} is not one of: {', '.join(map(str, choices))}")
    return value


def parse_boolean(text: str) -> bool:
    """1/true/yes/on or 0/false/no/off (any case); raises ArgumentTypeError otherwise."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")
