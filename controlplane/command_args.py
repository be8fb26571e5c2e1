"""Argument types the control plane's long-running management commands share (reconcile, live_bridge,
planner): a bad flag is an argparse error naming it, never a traceback."""

import argparse
from collections.abc import Callable

from runtime.errors import ConfigError
from runtime.settings import parse_nats_servers


def seconds_at_least(minimum: float) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, at least ``minimum``."""

    def seconds(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not minimum <= value < float("inf"):
            raise argparse.ArgumentTypeError(f"{value:g} must be a finite number of seconds, at least {minimum:g}")
        return value

    return seconds


def nats_servers_flag(text: str) -> list[str]:
    """An argparse type: ``--nats``'s comma-separated NATS URLs, checked as NATS_SERVER's are."""
    try:
        return parse_nats_servers(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("NATS_SERVER", "--nats")) from None
