"""The node's CPU utilisation from /proc/stat: busy ticks (all but idle and iowait) over the ticks between two
readings; none from the first reading, nor from a file that is missing or not /proc/stat's (logged once)."""

import logging
from pathlib import Path

import pytest

from agent.control_plane_client import HeartbeatReply, NodeReport
from agent.cpu_usage import CpuMeter, CpuTimes, parse_cpu_times, utilization_percent
from agent.heartbeats import Heartbeats
from agent.inventory import Inventory

# A Linux 6.x /proc/stat, trimmed: the aggregate line, then one per CPU, then other counters.
PROC_STAT = """\
cpu  4705 356 584 3699 23 23 0 0 0 0
cpu0 1393280 32966 572056 13343292 6130 0 17875 0 23 0
cpu1 1335812 32967 572001 13299847 6111 0 10040 0 0 0
intr 114930548 113199788 3 0 5 263 0 4 [... lots more numbers ...]
ctxt 1990473
btime 1062191376
processes 2915
"""


def stat_line(user: int, idle: int, iowait: int = 0, *, guest: int = 0) -> str:
    """/proc/stat text whose aggregate line has ``user``, ``idle`` and ``iowait`` ticks (and ``guest``, which the
    kernel also counts in ``user``)."""
    return f"cpu  {user} 0 0 {idle} {iowait} 0 0 0 {guest} 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"


def test_the_aggregate_line_is_read_with_idle_and_iowait_as_not_busy() -> None:
    # total: user..steal (4705+356+584+3699+23+23+0+0); busy: that less idle (3699) and iowait (23).
    assert parse_cpu_times(PROC_STAT) == CpuTimes(busy=5668, total=9390)


def test_guest_time_is_not_counted_twice() -> None:
    assert parse_cpu_times(stat_line(100, 300, guest=60)) == CpuTimes(busy=100, total=400)


def test_an_old_kernel_s_four_fields_are_read() -> None:
    assert parse_cpu_times("cpu  10 0 5 85\n") == CpuTimes(busy=15, total=100)


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("", "no aggregate cpu line"),
        ("cpu0 1 2 3 4 5\n", "no aggregate cpu line"),
        ("cpu  1 2 x 4 5\n", "not a count"),
        ("cpu  1 2 3\n", "too few fields"),
    ],
)
def test_text_that_is_not_proc_stat_s_is_a_value_error_saying_why(text: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        parse_cpu_times(text)


def test_the_utilisation_is_the_busy_share_of_the_ticks_between_two_readings() -> None:
    before = parse_cpu_times(stat_line(user=1000, idle=9000, iowait=100))
    after = parse_cpu_times(stat_line(user=1300, idle=9600, iowait=200))  # 300 busy of 1000 ticks
    assert utilization_percent(before, after) == 30.0
    assert utilization_percent(before, before) is None  # no tick passed


def test_counters_that_went_back_give_no_figure_and_a_shrinking_iowait_stays_within_bounds() -> None:
    assert utilization_percent(CpuTimes(busy=500, total=1000), CpuTimes(busy=5, total=10)) is None  # a reboot
    # iowait (counted as not busy) that went back makes busy grow by more than the ticks that passed.
    assert utilization_percent(CpuTimes(busy=100, total=1000), CpuTimes(busy=300, total=1100)) == 100.0
    assert utilization_percent(CpuTimes(busy=300, total=1000), CpuTimes(busy=200, total=1100)) == 0.0


def test_the_meter_has_no_figure_at_first_then_the_share_since_its_last_reading(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    meter = CpuMeter(stat)
    stat.write_text(stat_line(user=0, idle=0))
    assert meter.read() is None
    stat.write_text(stat_line(user=250, idle=750))
    assert meter.read() == 25.0
    stat.write_text(stat_line(user=1250, idle=750))
    assert meter.read() == 100.0


def test_a_missing_or_strange_proc_stat_gives_no_figure_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stat = tmp_path / "stat"
    meter = CpuMeter(stat)
    with caplog.at_level(logging.INFO, logger="agent.cpu_usage"):
        assert meter.read() is None
        assert meter.read() is None
        stat.write_text("not /proc/stat\n")
        assert meter.read() is None
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 1 and str(stat) in said[0] and "reporting none" in said[0]
    # Readable again: a fresh start (no figure), then figures.
    stat.write_text(stat_line(user=0, idle=0))
    assert meter.read() is None
    stat.write_text(stat_line(user=10, idle=30))
    assert meter.read() == 25.0


class RecordingRegistry:
    """The control plane as the heartbeats see it: it keeps what it is sent."""

    def __init__(self) -> None:
        self.sent: list[NodeReport] = []

    async def register(self, report: NodeReport) -> None:
        self.sent.append(report)

    async def heartbeat(self, report: NodeReport) -> HeartbeatReply | None:
        self.sent.append(report)
        return None


async def test_the_heartbeats_report_the_utilisation_between_them_whatever_else_reads_the_inventory(
    tmp_path: Path,
) -> None:
    stat = tmp_path / "stat"
    stat.write_text(stat_line(user=0, idle=0))
    inventory = Inventory([1 << 30], cpu_meter=CpuMeter(stat))
    registry = RecordingRegistry()
    heartbeats = Heartbeats(
        client=registry,
        inventory=inventory,
        gpu_memory_in_use=dict,
        node="node-a",
        address="",
        version="",
        machine_id="",
        engines=(),
        interval_s=3600,
    )
    await heartbeats.register()
    stat.write_text(stat_line(user=90, idle=10))
    inventory.read()  # a start checking its GPUs meanwhile
    stat.write_text(stat_line(user=100, idle=300))
    report = await heartbeats.node_report()
    assert registry.sent[0].cpu_utilization_percent is None  # the first report has none
    assert report.cpu_utilization_percent == 25.0  # 100 busy of the 400 ticks since the registration's read
