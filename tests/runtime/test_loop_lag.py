"""A process says when its event loop falls behind, and by how much."""

import asyncio
import logging
import re
import time

import pytest

from runtime import loop_lag


async def test_a_blocked_loop_is_reported_with_its_lag(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(loop_lag, "SAMPLE_S", 0.01)
    monkeypatch.setattr(loop_lag, "WARN_LAG_S", 0.2)
    watcher = asyncio.create_task(loop_lag.watch_loop_lag())
    try:
        with caplog.at_level(logging.WARNING, logger="runtime.loop_lag"):
            await asyncio.sleep(0.05)
            assert not caplog.records  # an idle loop is on time
            time.sleep(0.4)  # noqa: ASYNC251  # blocking the loop is the point
            await asyncio.sleep(0.05)
        [record] = caplog.records
        lag = float(re.search(r"ran up to ([\d.]+) s late", record.getMessage()).group(1))  # type: ignore[union-attr]
        assert lag >= 0.4
    finally:
        watcher.cancel()
