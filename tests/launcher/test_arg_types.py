import argparse
from collections.abc import Callable

import pytest

from launcher.arg_types import checked_by, integer, number, tcp_port
from runtime.errors import ConfigError


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [
        (integer(1), "two", "'two' is not an integer"),
        (integer(1), "0", "0 must be at least 1"),
        (integer(0, 8), "9", "9 must be at most 8"),
        (tcp_port(), "0", "0 must be at least 1"),
        (tcp_port(), "65536", "65536 is not a TCP port (1-65535)"),
        (tcp_port(any_free=True), "70000", "70000 is not a TCP port (1-65535, or 0 for any free port)"),
        (number(0.0, 1.0), "1.5", "1.5 must be between 0 and 1"),
        (number(0.0, 1.0), "nan", "nan must be between 0 and 1"),
        (number(0.0), "inf", "inf must be a finite number, 0 or more"),
        (number(0.0, above_minimum=True, unit="seconds"), "0", "0.0 must be a positive number of seconds"),
        (number(0.0, above_minimum=True, unit="seconds"), "soon", "'soon' is not a number of seconds"),
        (number(0.1, 3600.0, unit="seconds"), "0.05", "0.05 must be between 0.1 and 3600 seconds"),
    ],
)
def test_a_value_outside_its_range_is_refused_saying_the_range(
    parse: Callable[[str], object], text: str, message: str
) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as raised:
        parse(text)
    assert str(raised.value) == message


def test_values_inside_their_range_come_back_converted() -> None:
    assert integer(0, 8)("8") == 8
    assert tcp_port(any_free=True)("0") == 0
    assert tcp_port()("65535") == 65535
    assert number(0.0, 1.0)("1") == 1.0
    assert number(0.0, above_minimum=True)("1e-9") == 1e-9


def test_a_checks_config_error_becomes_the_flags_error() -> None:
    def even(text: str) -> int:
        if int(text) % 2:
            raise ConfigError(f"{text} is odd")
        return int(text)

    assert checked_by(even)("4") == 4
    with pytest.raises(argparse.ArgumentTypeError, match=r"^3 is odd$"):
        checked_by(even)("3")
