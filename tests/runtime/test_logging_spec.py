"""FLOTILLA_LOG takes the RUST_LOG-like syntax Dynamo uses."""

import logging

import pytest

from runtime.errors import ConfigError
from runtime.logging import TRACE, configure_logging, parse_log_spec


def test_a_bare_level_sets_the_root_level() -> None:
    assert parse_log_spec("debug") == (logging.DEBUG, {})


def test_targets_get_their_own_level_and_the_flotilla_prefix_is_optional() -> None:
    root, targets = parse_log_spec("flotilla.runtime=debug,frontend_gateway::http_app=trace,warn")
    assert root == logging.WARNING
    assert targets == {"runtime": logging.DEBUG, "frontend_gateway.http_app": TRACE}


def test_an_unknown_level_is_a_config_error_naming_the_directive() -> None:
    with pytest.raises(ConfigError, match="runtime=loud"):
        parse_log_spec("runtime=loud")


def test_verbose_flags_lower_the_root_level() -> None:
    configure_logging("info", verbosity=2)
    assert logging.getLogger().level == TRACE
    configure_logging("info", verbosity=1)
    assert logging.getLogger().level == logging.DEBUG
    configure_logging("runtime=error,info")
    assert logging.getLogger("runtime").level == logging.ERROR
    configure_logging("info")
