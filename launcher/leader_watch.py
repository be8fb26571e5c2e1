"""A rank above 0 watches its leader: one that is gone for good ends the rank (exit 1), as a dead worker does.

When the leader (rank 0) dies, the engine's processes on the other ranks do not notice: they wait for the next
step it would broadcast, for ever, holding their GPUs. The leader's ``torch.distributed`` store listens at
``--leader-addr`` for as long as its engine lives (vLLM's ``master_port``, SGLang's ``dist_init_addr``), so
the rank connects to it every ``interval_s`` and, after ``misses`` refusals or timeouts in a row (about 10 s
by default: a restart of the leader's network or a busy accept queue is shorter), says so and interrupts
the main thread, where ``launcher/follower.py`` waits on the engine's processes.
"""

import socket
import threading
from collections.abc import Callable

from engines.shared.node_group import LeaderAddress

INTERVAL_S = 2.0
MISSES = 5


def leader_answers(leader: LeaderAddress, timeout_s: float) -> bool:
    """Whether something accepts a connection at ``leader`` within ``timeout_s``."""
    try:
        with socket.create_connection((leader.host, leader.port), timeout=timeout_s):
            return True
    except OSError:  # refused, unreachable, timed out, a name that no longer resolves
        return False


class LeaderWatch:
    """Probes ``leader`` from a daemon thread; calls ``on_gone`` (once) when it stops answering."""

    def __init__(
        self,
        leader: LeaderAddress,
        on_gone: Callable[[str], None],
        *,
        interval_s: float | None = None,
        misses: int | None = None,
    ) -> None:
        """``interval_s`` and ``misses`` default to INTERVAL_S and MISSES (read when the watch is made)."""
        self.leader = leader
        self._on_gone = on_gone
        self._interval_s = INTERVAL_S if interval_s is None else interval_s
        self._misses = MISSES if misses is None else misses
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"leader watch {leader}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._interval_s * 2)

    def _run(self) -> None:
        missed = 0
        while not self._stopped.wait(self._interval_s):
            if leader_answers(self.leader, timeout_s=self._interval_s):
                missed = 0
                continue
            missed += 1
            if missed >= self._misses:
                gone_for = missed * self._interval_s
                self._on_gone(f"the leader at {self.leader} has not answered for {gone_for:.0f} s (is rank 0 down?)")
                return
