"""runtime.ports: ports for servers started a moment later lie outside the kernel's ephemeral range, are free when
chosen, and are not chosen again on this host while their servers start."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.shared.zmq_kv_events import free_tcp_ports
from runtime import ports
from runtime.errors import EngineError

ROOT = Path(__file__).resolve().parents[2]

# Another process choosing a port among the spans given to it (JSON [[start, stop], ...]): it prints the port, or
# why there is none.
CHOOSER = """
import json, sys
from runtime import ports
spans = [range(start, stop) for start, stop in json.loads(sys.argv[1])]
ports._candidates = lambda count: spans
try:
    print(ports.free_port())
except OSError as exc:
    print(exc)
"""


@pytest.fixture
def ledger_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A ledger of this test's own (the suite's other workers choose ports meanwhile), in a temporary directory
    that the processes it starts use too."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(ports.tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    monkeypatch.setattr(ports, "_chosen_here", {})
    yield tmp_path
    ports.tempfile.tempdir = None


def choose_elsewhere(spans: list[range], tmpdir: Path) -> str:
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": str(ROOT)}
    spans_json = json.dumps([[span.start, span.stop] for span in spans])
    done = subprocess.run(
        [sys.executable, "-c", CHOOSER, spans_json], capture_output=True, text=True, env=env, timeout=60, check=True
    )
    return done.stdout.strip()


def test_the_ephemeral_range_is_the_kernels() -> None:
    low, high = (int(part) for part in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert ports.ephemeral_range() == (low, high)


def test_ports_are_outside_the_ephemeral_range_free_and_not_chosen_twice(ledger_dir: Path) -> None:
    low, high = ports.ephemeral_range()
    chosen = [ports.free_port() for _ in range(300)]
    assert len(set(chosen)) == len(chosen)
    assert all(ports.LOWEST <= port < low or high < port <= 65535 for port in chosen)
    for port in chosen[:20]:
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))  # raises if the port was not free (a TIME_WAIT on it included)
            server.listen()


def test_consecutive_ports_are_all_free(ledger_dir: Path) -> None:
    first = ports.free_ports(4)
    for port in range(first, first + 4):
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))


def test_another_process_does_not_choose_the_ports_this_one_holds(
    ledger_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    first = ports.free_ports(3)
    held = [range(first, first + 3)]
    assert choose_elsewhere(held, ledger_dir).startswith("no 1 consecutive free ports")
    # With a ledger of its own (another user, say) it takes one: the ports are free, only held.
    assert int(choose_elsewhere(held, tmp_path_factory.mktemp("elsewhere"))) in held[0]


def test_a_port_held_longer_than_hold_s_is_chosen_again(ledger_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = ports.free_ports(1)
    monkeypatch.setattr(ports, "_candidates", lambda count: [range(first, first + 1)])
    with pytest.raises(OSError, match="no 1 consecutive free ports"):
        ports.free_ports(1, attempts=3)
    monkeypatch.setattr(ports, "HOLD_S", 0.0)
    assert ports.free_ports(1) == first


class _Scripted:
    """Stands for the random module: ``randrange`` gives the scripted indices, in order."""

    def __init__(self, indices: list[int]) -> None:
        self.indices = iter(indices)

    def randrange(self, stop: int) -> int:
        index = next(self.indices)
        assert index < stop
        return index


def test_a_port_in_use_is_not_chosen(ledger_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        free = closed.getsockname()[1]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(ports, "_candidates", lambda count: [range(busy, busy + 1), range(free, free + 1)])
        monkeypatch.setattr(ports, "random", _Scripted([0, 0, 1]))
        assert ports.free_ports(1) == free


def test_no_room_outside_the_ephemeral_range_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = tmp_path / "ip_local_port_range"
    whole.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", whole)
    with pytest.raises(OSError, match=r"no 2 consecutive free ports on 127\.0\.0\.1 outside the ephemeral range"):
        ports.free_ports(2)
    with pytest.raises(EngineError, match="no free ports for an engine's KV event publishers"):
        free_tcp_ports(2)


def test_an_unreadable_range_file_means_linuxs_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_RANGE_FILE", tmp_path / "absent")
    assert ports.ephemeral_range() == ports.DEFAULT_EPHEMERAL


def test_an_unwritable_ledger_holds_this_processs_choices(ledger_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ledger_path", lambda: ledger_dir / "no-such-dir" / "ledger")
    first = ports.free_ports(1)
    monkeypatch.setattr(ports, "_candidates", lambda count: [range(first, first + 1)])
    with pytest.raises(OSError, match="no 1 consecutive free ports"):
        ports.free_ports(1, attempts=3)
