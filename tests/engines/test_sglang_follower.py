"""``flotilla run out=sglang --num-nodes 2 --node-rank 1``, a rank that serves nothing, run as a person runs it.

SGLang needs CUDA and does not install here, so a stand-in ``sglang`` package is put on the path: its
``Engine`` records what it was given and starts one process for this node's scheduler, as SGLang's does on a
rank above 0 when told not to block (``SGLANG_BLOCK_NONZERO_RANK_CHILDREN=0``). What is tested is Flotilla's
side: the arguments, the log line, the wait on the scheduler processes, the exit codes and the clean-up.
"""

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

STAND_IN = """
import json, multiprocessing, os, time

def _schedule():  # this node's scheduler: runs until stopped
    time.sleep(3600)

class Engine:
    def __init__(self, **kwargs):
        record = {"kwargs": kwargs, "block": os.environ.get("SGLANG_BLOCK_NONZERO_RANK_CHILDREN")}
        self.scheduler = multiprocessing.get_context("fork").Process(target=_schedule, name="scheduler_TP1")
        self.scheduler.start()
        record["scheduler"] = self.scheduler.pid
        with open(os.environ["STAND_IN_RECORD"], "w") as file:
            json.dump(record, file)

    def shutdown(self):
        if os.environ.get("STAND_IN_SHUTDOWN") == "hangs":
            time.sleep(3600)  # an engine whose shutdown never returns
        self.scheduler.terminate()
        self.scheduler.join()
        with open(os.environ["STAND_IN_RECORD"] + ".exit", "w") as file:
            file.write(str(self.scheduler.exitcode))
"""

# On a busy machine the stand-in's SIGTERM could reach its scheduler before CPython had set up the forked
# child, which drops the signals caught so far: the scheduler ran on and the stand-in's shutdown waited for
# it for ever (the rank logged its stop and did not exit). The rank now bounds the engine's shutdown
# (SHUTDOWN_WAIT_S) and stops the schedulers itself; the last test makes that case happen every time.
pytestmark = pytest.mark.slow


@pytest.fixture
def leader() -> Iterator[str]:
    """The leader's address: a loopback socket that accepts connections, as the leader's distributed store does
    (the rank's leader watch probes it; a made-up address would send it off this machine)."""
    with socket.socket() as store:
        store.bind(("127.0.0.1", 0))
        store.listen(16)
        yield f"127.0.0.1:{store.getsockname()[1]}"


@pytest.fixture
def shutdown() -> str:
    """How the stand-in's shutdown behaves: "stops" its scheduler, or "hangs" (the test parametrizes it)."""
    return "stops"


@pytest.fixture
def follower(tmp_path: Path, leader: str, shutdown: str) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    (tmp_path / "lib" / "sglang").mkdir(parents=True)
    (tmp_path / "lib" / "sglang" / "__init__.py").write_text(STAND_IN)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    record = tmp_path / "record.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "lib"), str(Path.cwd())]),
        "STAND_IN_RECORD": str(record),
        "PYTHONFAULTHANDLER": "1",  # SIGABRT dumps every thread's stack: see ended()
        "STAND_IN_SHUTDOWN": shutdown,
    }
    args = ["in=http", "out=sglang", str(model), "--tensor-parallel-size", "2", "--num-nodes", "2", "--node-rank", "1"]
    args += ["--leader-addr", leader, "--extra-engine-args", '{"page_size": 32}']
    process = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "run", *args], stderr=subprocess.PIPE, text=True, env=env
    )
    yield process, record
    if process.poll() is None:
        process.kill()
        process.wait()


def wait_until_up(process: subprocess.Popen[str], record: Path) -> tuple[dict[str, object], str]:
    """The stand-in's record and the log so far, once Flotilla says the schedulers are up."""
    assert process.stderr is not None
    logged = ""
    while "the engine's processes are up" not in logged:
        line = process.stderr.readline()  # blocks until the next line: the log is the event awaited
        if not line:
            raise AssertionError(f"the follower ended before its schedulers were up (exit {process.wait()}):\n{logged}")
        logged += line
    values: dict[str, object] = json.loads(record.read_text())
    return values, logged


def ended(process: subprocess.Popen[str]) -> str:
    """The rest of the rank's log once it exits; a rank still running after a minute is made to dump its
    threads' stacks (SIGABRT, faulthandler) and the test fails with them."""
    try:
        return process.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        _, dump = process.communicate(timeout=30)
        raise AssertionError(f"the rank did not exit within 60 s; its threads:\n{dump[-6000:]}") from None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone too: its parent has not reaped it yet.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_a_rank_above_0_starts_its_schedulers_with_the_multi_node_arguments_and_stops_them_on_a_signal(
    follower: tuple[subprocess.Popen[str], Path], leader: str, signum: signal.Signals, code: int
) -> None:
    process, record = follower
    started, logged = wait_until_up(process, record)
    kwargs = started["kwargs"]
    assert isinstance(kwargs, dict)
    assert (kwargs["nnodes"], kwargs["node_rank"], kwargs["dist_init_addr"], kwargs["tp_size"]) == (
        2,
        1,
        leader,
        2,
    )
    assert kwargs["page_size"] == 32 and "kv_events_config" not in kwargs
    assert started["block"] == "0"  # SGLang returns once its schedulers are ready instead of blocking
    process.send_signal(signum)
    rest = ended(process)
    stderr = logged + rest
    assert process.returncode == code, stderr
    assert f"serving as rank 1 of 2 for the leader at {leader}" in stderr
    assert "in=http is ignored here" in stderr
    assert f"stopped by {signum.name}" in stderr
    assert not alive(int(str(started["scheduler"])))
    # The scheduler, forked after the rank set its signal handlers, ended by the engine's SIGTERM as any
    # process does, not by the rank's own handler (which, raising in the fork, could swallow the signal).
    assert Path(f"{record}.exit").read_text() == str(-signal.SIGTERM), stderr
    assert "_Stopped" not in stderr


def test_a_rank_above_0_exits_1_when_its_scheduler_dies(follower: tuple[subprocess.Popen[str], Path]) -> None:
    process, record = follower
    started, logged = wait_until_up(process, record)
    scheduler = int(str(started["scheduler"]))
    os.kill(scheduler, signal.SIGKILL)
    rest = ended(process)
    stderr = logged + rest
    assert process.returncode == 1, stderr
    assert f"rank 1 of 2 stops: SGLang's process scheduler_TP1 (pid {scheduler}) exited with code -9" in stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("shutdown", ["hangs"])
def test_a_rank_whose_engine_shutdown_hangs_stops_the_schedulers_itself_and_exits(
    follower: tuple[subprocess.Popen[str], Path],
) -> None:
    process, record = follower
    started, logged = wait_until_up(process, record)
    process.send_signal(signal.SIGTERM)
    rest = ended(process)
    stderr = logged + rest
    assert process.returncode == 0, stderr
    assert "SGLang's shutdown has not ended after 10 s; stopping its 1 scheduler process(es) here" in stderr
    assert not alive(int(str(started["scheduler"])))
