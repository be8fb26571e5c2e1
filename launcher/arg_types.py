"""Argparse ``type=`` checks shared by the launcher's commands (run, up, agent): each turns a flag's text
into its value or says, in one line, what is wrong with it (argparse adds the flag's name, or the
environment variable's, and exits 2)."""

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

from runtime.errors import FlotillaError

T = TypeVar("T")


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """A whole number from ``minimum`` to ``maximum`` (None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{value} must be at most {maximum}")
        return value

    return parse


def tcp_port(*, any_free: bool = False) -> Callable[[str], int]:
    """A TCP port; with ``any_free``, 0 too (the command then picks a free one)."""
    low = 0 if any_free else 1
    what = "1-65535, or 0 for any free port" if any_free else "1-65535"
    whole = integer(low)

    def parse(text: str) -> int:
        value = whole(text)
        if value > 65535:
            raise argparse.ArgumentTypeError(f"{value} is not a TCP port ({what})")
        return value

    return parse


def number(
    minimum: float, maximum: float = math.inf, *, above_minimum: bool = False, unit: str = ""
) -> Callable[[str], float]:
    """A finite number from ``minimum`` (excluded with ``above_minimum``) to ``maximum``, in ``unit``."""
    of_unit = f" of {unit}" if unit else ""
    if math.isfinite(maximum):
        low = f"above {minimum:g}" if above_minimum else f"{minimum:g}"
        rule = f"must be between {low} and {maximum:g}{' ' + unit if unit else ''}"
    elif above_minimum and minimum == 0:
        rule = f"must be a positive number{of_unit}"
    else:
        rule = f"must be a finite number{of_unit}, {minimum:g} or more"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number{of_unit}") from None
        low_ok = value > minimum if above_minimum else value >= minimum
        if not (low_ok and value <= maximum and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{value} {rule}")
        return value

    return parse


def checked_by(check: Callable[[str], T]) -> Callable[[str], T]:
    """``check``'s value, its FlotillaError (a ConfigError, say) told as the flag's error."""

    def parse(text: str) -> T:
        try:
            return check(text)
        except FlotillaError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse
