"""A rank above 0 ends (exit 1) when its leader stops answering at --leader-addr, instead of waiting for ever.

The leader is a real TCP listener; the rank's engine processes are stood in for by a follower that waits
until it is closed, as vLLM's and SGLang's wait on their workers (tests/engines/test_vllm_multinode.py
kills a real vLLM leader).
"""

import logging
import socket
import threading
import time

import pytest

from engines.shared.node_group import LeaderAddress
from launcher import follower as follower_module
from launcher import leader_watch
from launcher.leader_watch import LeaderWatch, leader_answers
from launcher.options import RunOptions


def listening() -> tuple[socket.socket, LeaderAddress]:
    server = socket.create_server(("127.0.0.1", 0))
    return server, LeaderAddress("127.0.0.1", server.getsockname()[1])


def test_a_leader_that_stops_answering_is_reported_once_after_the_misses_in_a_row() -> None:
    server, leader = listening()
    assert leader_answers(leader, timeout_s=1)
    gone: list[str] = []
    watch = LeaderWatch(leader, gone.append, interval_s=0.05, misses=3)
    watch.start()
    time.sleep(0.3)
    assert gone == []  # it answers: nothing to say
    server.close()
    deadline = time.monotonic() + 5
    while not gone and time.monotonic() < deadline:
        time.sleep(0.02)
    watch.stop()
    assert len(gone) == 1 and f"the leader at {leader} has not answered" in gone[0]
    assert not leader_answers(leader, timeout_s=1)


class WaitsForEver:
    """A rank's engine processes, up and joined: ``wait`` returns only when they are closed."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def start(self) -> None:
        pass

    def wait(self) -> str:
        self.closed.wait()
        return "the workers were shut down"

    def close(self) -> None:
        self.closed.set()


def test_a_rank_whose_leader_is_gone_stops_with_exit_1_saying_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    server, leader = listening()
    rank = WaitsForEver()
    monkeypatch.setattr(follower_module, "build_follower", lambda options: rank)
    monkeypatch.setattr(leader_watch, "INTERVAL_S", 0.05)
    monkeypatch.setattr(leader_watch, "MISSES", 3)
    options = RunOptions(output="vllm", model="m", num_nodes=2, node_rank=1, leader_addr=leader)
    threading.Timer(0.5, server.close).start()  # the leader dies half a second in
    with caplog.at_level(logging.ERROR, logger="launcher.follower"):
        started = time.monotonic()
        code = follower_module.run_follower(options)
    assert code == 1
    assert rank.closed.is_set()  # its processes were stopped on the way out
    assert time.monotonic() - started < 10
    assert f"rank 1 of 2 stops: the leader at {leader} has not answered" in caplog.text
