"""Markers of the agent's tests."""

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # The agent's process tests (a control plane, servers and workers each) take seconds apiece.
    config.addinivalue_line("markers", "slow: starts real servers and processes; deselect with -m 'not slow'")
