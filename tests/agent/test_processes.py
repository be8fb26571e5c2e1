"""Worker processes: exit reasons a person can act on, log tails, and a pid never mistaken for another process."""

import asyncio
import os
import signal
import sys
from pathlib import Path

from agent.workers.processes import ExitStatus, WorkerProcess, boot_id, describe_exit, log_tail, process_start_time


def test_exit_reasons_say_what_happened_and_what_to_do() -> None:
    assert "out-of-memory killer" in describe_exit(ExitStatus(signal=signal.SIGKILL))
    assert "segmentation fault" in describe_exit(ExitStatus(signal=signal.SIGSEGV))
    assert "SIGUSR1" in describe_exit(ExitStatus(signal=signal.SIGUSR1))
    assert "restarting cannot help" in describe_exit(ExitStatus(code=2))
    assert describe_exit(ExitStatus(code=1)) == "failed with exit code 1"
    assert "without being asked" in describe_exit(ExitStatus(code=0))
    assert "unknown" in describe_exit(ExitStatus())


def test_a_log_tail_is_the_last_whole_lines(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    log.write_text("".join(f"line {n} {'x' * 300}\n" for n in range(1000)))
    tail = log_tail(log, 3).splitlines()
    assert [line.split()[1] for line in tail] == ["997", "998", "999"]
    assert log_tail(log, 0) == ""
    assert log_tail(tmp_path / "missing.log", 5) == ""
    short = tmp_path / "short.log"
    short.write_text("only line, no newline")
    assert log_tail(short, 5) == "only line, no newline"


def test_a_process_is_known_by_its_start_time_and_boot() -> None:
    start = process_start_time(os.getpid())
    assert start is not None and start > 0
    assert WorkerProcess.adopt(os.getpid(), start, boot_id()) is not None
    # The same pid with another start time is a reused pid; another boot id is a machine that rebooted.
    assert WorkerProcess.adopt(os.getpid(), start + 1, boot_id()) is None
    assert WorkerProcess.adopt(os.getpid(), start, "another-boot") is None


async def test_a_child_s_exit_code_and_killing_signal_are_read(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    exits = WorkerProcess.spawn([sys.executable, "-c", "print('bye'); raise SystemExit(7)"], os.environ, log)
    assert await exits.wait() == ExitStatus(code=7)
    assert log.read_text() == "bye\n"
    sleeper = WorkerProcess.spawn([sys.executable, "-c", "import time; time.sleep(600)"], os.environ, log)
    assert sleeper.is_running()
    sleeper.kill()
    assert await sleeper.wait() == ExitStatus(signal=signal.SIGKILL)
    assert not sleeper.is_running()


async def test_an_adopted_process_is_waited_for_without_being_its_parent(tmp_path: Path) -> None:
    child = WorkerProcess.spawn([sys.executable, "-c", "import time; time.sleep(600)"], os.environ, tmp_path / "log")
    adopted = WorkerProcess.adopt(child.pid, child.start_time, boot_id())
    assert adopted is not None and adopted.is_running()
    waiting = asyncio.create_task(adopted.wait())
    os.kill(child.pid, signal.SIGKILL)
    assert await waiting == ExitStatus()  # not its parent: the exit code is not for it to read
    assert await child.wait() == ExitStatus(signal=signal.SIGKILL)
