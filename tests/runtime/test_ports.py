"""runtime.ports: ports for servers started a moment later lie outside the kernel's ephemeral range, are free when
chosen, and are not handed out twice."""

from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypeVar, cast

import pytest

from engines.shared.zmq_kv_events import free_tcp_ports
from runtime import ports
from runtime.errors import EngineError


def test_the_ephemeral_range_is_the_kernels() -> None:
    low, high = (int(part) for part in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert ports.ephemeral_range() == (low, high)


def test_ports_are_outside_the_ephemeral_range_free_and_not_handed_out_twice() -> None:
    low, high = ports.ephemeral_range()
    chosen = [ports.free_port() for _ in range(300)]
    assert len(set(chosen)) == len(chosen)
    assert all(ports.LOWEST <= port < low or high < port <= 65535 for port in chosen)
    for port in chosen[:20]:
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))  # raises if the port was not free
            server.listen()


def test_consecutive_ports_are_all_free() -> None:
    first = ports.free_ports(4)
    for port in range(first, first + 4):
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))


T = TypeVar("T")


class _Scripted:
    """Stands for the random module: ``choice`` gives the scripted ports, in order, and the first span."""

    def __init__(self, script: Iterator[int]) -> None:
        self.script = script

    def choice(self, seq: Sequence[T]) -> T:
        if isinstance(seq, range):
            return cast(T, next(self.script))
        return seq[0]


def test_a_port_in_use_is_not_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        free = closed.getsockname()[1]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(ports, "_candidates", lambda count: [range(ports.LOWEST, 65536 - count + 1)])
        monkeypatch.setattr(ports, "random", _Scripted(iter([busy, busy, free])))
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
