"""The processes ``flotilla up`` runs: started, watched, stopped, and the loopback ports they listen on.

Each child runs in its own session, so that Ctrl-C in the terminal reaches ``flotilla up`` alone and it
stops the children in its own order (the agent before the engine workers it leaves behind, the servers
last). Each child also gets SIGTERM from the kernel if ``flotilla up`` dies without stopping it (killed
with SIGKILL, say), so that no etcd or control plane outlives it holding its ports and data.
"""

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from agent.workers.processes import log_tail, until_readable
from runtime.ports import free_port, ports_free

#: Lines of a dead child's log shown with the report of its death.
LOG_TAIL_LINES = 25

_PR_SET_PDEATHSIG = 1
# Loaded before any fork: the function that runs in the child between fork and exec should only call it.
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _die_with(parent_pid: int) -> None:
    """In the child before exec: SIGTERM when ``parent_pid`` ends, and at once if it has ended already."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # it died between fork and prctl: the signal will never come
        os.kill(os.getpid(), signal.SIGTERM)


class Child:
    """One process of the stack, with its output in ``log_path``.

    ``start()`` runs it; ``exited`` completes with its exit code when it ends, whoever stopped it;
    ``stop()`` asks it to end (SIGTERM), then kills its whole process group.
    """

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = dict(env)
        self.log_path = log_path
        self._popen: subprocess.Popen[bytes] | None = None
        self._exited: asyncio.Future[int] | None = None
        self._stdout: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self._popen is None else self._popen.pid

    @property
    def exited(self) -> "asyncio.Future[int]":
        """Completes with the exit code (negative: the signal that killed it). Raises RuntimeError before start."""
        if self._exited is None:
            raise RuntimeError(f"{self.name} has not been started")
        return self._exited

    def start(self, *, capture_stdout: bool = False) -> None:
        """Start the process, appending its output to ``log_path``; with ``capture_stdout``, only its stderr, and
        ``output()`` returns its stdout once it has ended. Raises OSError when it cannot be run."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        parent = os.getpid()
        # A file rather than a pipe, which a talkative child could fill and block on; unlinked at once, so that
        # what it holds (tokens) is never left on disk.
        self._stdout = tempfile.TemporaryFile() if capture_stdout else None  # noqa: SIM115 (closed by output())
        with self.log_path.open("ab") as log_file:
            self._popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=self._stdout or log_file,
                stderr=log_file,
                env=self.env,
                start_new_session=True,
                preexec_fn=lambda: _die_with(parent),
            )
        self._exited = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().create_task(self._watch(self._popen), name=f"watch {self.name}")

    def output(self) -> str:
        """What the child wrote on stdout (``start(capture_stdout=True)``), once it has ended."""
        if self._stdout is None:
            return ""
        with self._stdout:
            self._stdout.seek(0)
            text = self._stdout.read().decode(errors="replace")
        self._stdout = None
        return text

    async def _watch(self, popen: "subprocess.Popen[bytes]") -> None:
        # A pidfd becomes readable when the process ends: an event to await, not a poll.
        try:
            pidfd = os.pidfd_open(popen.pid)
        except OSError:  # kernels before 5.3: a thread waits (and reaps, so leftovers cannot be killed by group)
            code = await asyncio.to_thread(popen.wait)
        else:
            try:
                await until_readable(pidfd)
            finally:
                os.close(pidfd)
            # What it started and left behind (Celery's pool, say) goes too. Until it is reaped, just below,
            # its pid (the group's id) cannot be given to another process.
            self.kill_group()
            code = popen.wait()
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(code)

    def log(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of its log."""
        return log_tail(self.log_path, lines)

    async def stop(self, grace_s: float, *, hurry: asyncio.Event | None = None) -> None:
        """SIGTERM, then SIGKILL to its process group after ``grace_s`` seconds or as soon as ``hurry`` is set; returns
        once it has ended."""
        if self._popen is None or self._exited is None or self._exited.done():
            return
        with contextlib.suppress(ProcessLookupError):
            self._popen.send_signal(signal.SIGTERM)
        waiters: list[asyncio.Future[Any]] = [asyncio.ensure_future(asyncio.shield(self._exited))]
        if hurry is not None:
            waiters.append(asyncio.ensure_future(hurry.wait()))
        try:
            await asyncio.wait(waiters, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        if not self._exited.done():
            self.kill_group()
            await self._exited

    def kill_group(self) -> None:
        """SIGKILL to the child's process group (its own session: the group id is its pid), unless reaped."""
        if self._popen is None or self._popen.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, signal.SIGKILL)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on ``host:port`` now."""
    return ports_free([port], host, reuse_address=True)  # as servers bind: TIME_WAIT is free for them


def choose_port(wanted: int, taken: set[int]) -> int:
    """``wanted`` when free (and not in ``taken``, the ports this stack already chose), else a free port; 0 asks
    for any free port."""
    if wanted and wanted not in taken and port_is_free(wanted):
        return wanted
    while (port := free_port()) in taken:
        pass
    return port
