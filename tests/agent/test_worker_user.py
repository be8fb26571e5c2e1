"""Workers as another user than a root agent's: which user, the spawn's arguments, the models folder shared with
the workers' group, and (run as root) a real worker as ``nobody`` that cannot read the agent's token and is still
stopped with everything it started."""

import asyncio
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.workers import processes
from agent.workers.processes import WorkerProcess, process_start_time
from agent.workers.records import load_records
from agent.workers.supervisor import Supervisor, WorkerState
from agent.workers.worker_user import SHARED_UMASK, WorkerUser, lookup_user, resolve_worker_user, share_models_dir
from launcher.agent_command import agent_main
from runtime.errors import ConfigError
from tests.agent.test_supervisor import Statuses, kill_recorded_workers, pid_gone, spec

WORKER = WorkerUser(name="flotilla-worker", uid=990, gid=990, groups=(44, 990), home="/var/lib/flotilla-worker")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


def users(name: str) -> WorkerUser:
    known = {"flotilla-worker": WORKER, "root": WorkerUser("root", 0, 0, (0,), "/root")}
    return known[name]


def test_a_root_agent_switches_to_the_named_user() -> None:
    assert resolve_worker_user("flotilla-worker", euid=0, lookup=users) == WORKER


def test_without_a_name_the_workers_run_as_the_agent_and_a_root_agent_warns(caplog: pytest.LogCaptureFixture) -> None:
    assert resolve_worker_user(None, euid=1000, lookup=users) is None
    assert caplog.records == []
    assert resolve_worker_user("", euid=0, lookup=users) is None
    assert "its engine workers run as root too, and can read its token" in caplog.text


@pytest.mark.parametrize(
    ("name", "euid", "message"),
    [
        ("nosuch", 0, "there is no user 'nosuch' on this machine: create it"),
        ("root", 0, "'root' is root: the workers would hold every privilege"),
        ("flotilla-worker", 1000, "only an agent running as root can start its workers as 'flotilla-worker'"),
    ],
)
def test_a_user_the_agent_cannot_switch_to_is_refused_naming_the_variable(name: str, euid: int, message: str) -> None:
    with pytest.raises(ConfigError, match="FLOTILLA_WORKER_USER") as raised:
        resolve_worker_user(name, euid=euid, lookup=users)
    assert message in str(raised.value)


def test_naming_the_agents_own_user_switches_nothing() -> None:
    assert resolve_worker_user("flotilla-worker", euid=990, lookup=users) is None


def test_the_agent_refuses_an_unknown_worker_user_with_exit_code_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FLOTILLA_WORKER_USER", "no-such-user-here")
    code = agent_main(["--control-plane", "http://127.0.0.1:9", "--token", "flt_x", "--name", "gpu-a"])
    assert code == 2
    assert "--worker-user (FLOTILLA_WORKER_USER): there is no user 'no-such-user-here'" in capsys.readouterr().err


class Spawned(Exception):
    """Raised in place of starting a process: the arguments it would have been started with."""

    def __init__(self, argv: list[str], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.argv, self.kwargs = argv, kwargs


def spawn_arguments(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, user: WorkerUser | None) -> dict[str, Any]:
    def popen(argv: list[str], **kwargs: Any) -> None:
        raise Spawned(argv, kwargs)

    monkeypatch.setattr(processes.subprocess, "Popen", popen)
    env = {"PATH": "/usr/bin", "HOME": "/root", "USER": "root"}
    with pytest.raises(Spawned) as spawned:
        WorkerProcess.spawn(["flotilla", "run"], env, tmp_path / "worker.log", user=user)
    return spawned.value.kwargs


def test_a_worker_is_started_as_the_worker_user_with_its_groups_home_and_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    kwargs = spawn_arguments(monkeypatch, tmp_path, WORKER)
    assert (kwargs["user"], kwargs["group"], kwargs["extra_groups"]) == (990, 990, [44, 990])
    assert kwargs["cwd"] == "/"  # its home does not exist here
    env = kwargs["env"]
    assert (env["HOME"], env["USER"], env["LOGNAME"]) == (WORKER.home, WORKER.name, WORKER.name)


def test_without_a_worker_user_the_spawn_switches_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    kwargs = spawn_arguments(monkeypatch, tmp_path, None)
    assert not {"user", "group", "extra_groups", "cwd"} & set(kwargs)
    assert kwargs["env"]["HOME"] == "/root"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_models_folder_is_shared_with_the_workers_group_and_nobody_else(tmp_path: Path) -> None:
    models = tmp_path / "models"
    blobs = models / "models--acme--m" / "blobs"
    blobs.mkdir(parents=True, mode=0o700)
    os.chmod(models, 0o700)
    weights = blobs / "abc"
    weights.write_bytes(b"weights")
    os.chmod(weights, 0o606)
    (models / "models--acme--m" / "link").symlink_to(weights)
    gid = os.getgid()  # a group this process may give its files without privileges
    me = WorkerUser("me", os.getuid(), gid, (gid,), str(tmp_path))
    previous = os.umask(0o077)
    try:
        assert share_models_dir(models, me) == 4
        assert os.umask(previous) == SHARED_UMASK  # so that later downloads are group-readable too
    finally:
        os.umask(previous)
    assert [mode(path) for path in (models, blobs.parent, blobs)] == [0o2750] * 3
    assert mode(weights) == 0o640 and weights.stat().st_gid == gid
    assert share_models_dir(models, me) == 0  # the next start finds nothing to change
    os.umask(previous)


# -- a real switch (tests run as root here) -------------------------------------------------------------------

# Stands in for `flotilla run`, as sh, which `nobody` may run (the tests' Python may be under root's home).
REPORT = """
echo "uid=$(id -u) gid=$(id -g) home=$HOME cwd=$(pwd)"
echo "token in environment: $(env | grep -c FLOTILLA_AGENT_TOKEN)"
cat "$TOKEN_FILE" >/dev/null 2>&1 && echo "token file: read" || echo "token file: refused"
cat "/proc/$AGENT_PID/environ" >/dev/null 2>&1 && echo "agent environ: read" || echo "agent environ: refused"
"""
STUBBORN = """
trap '' TERM
setsid sh -c 'echo $$ > "$FIFO"; exec sleep 600' &
while :; do sleep 1; done
"""


@pytest.fixture
def agent_files() -> Iterator[Path]:
    # tmp_path is root's (0700): the token lies where nobody could reach it but for its own mode.
    with tempfile.TemporaryDirectory(prefix="flotilla-agent-") as directory:
        os.chmod(directory, 0o755)
        yield Path(directory)


def supervisor(tmp_path: Path, statuses: Statuses, script: str, base_env: dict[str, str]) -> Supervisor:
    return Supervisor(
        node="node-a",
        state_dir=tmp_path / "state",
        log_dir=tmp_path / "logs",
        readiness=NeverReady(),
        on_status=statuses,
        command=["/bin/sh", "-c", script, "flotilla"],
        stop_timeout_s=0.5,
        leftover_grace_s=0.5,
        base_env=base_env,
        worker_user=lookup_user("nobody"),
    )


class NeverReady:
    async def wait_registered(self, pid: int, labels: object) -> int:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


@as_root
async def test_a_worker_as_nobody_can_read_neither_the_token_file_nor_the_agents_environment(
    tmp_path: Path, agent_files: Path
) -> None:
    token = agent_files / "agent.token"
    token.write_text("flt_agent_secret\n")
    os.chmod(token, 0o600)  # as deploy/ keeps it, owned by the agent's user
    statuses = Statuses()
    # What the agent's own environment holds: its token among the rest; the allowlist keeps the token out.
    environ = {"PATH": "/usr/bin:/bin", "FLOTILLA_AGENT_TOKEN": "flt_x", "FLOTILLA_AGENT_TOKEN_FILE": str(token)}
    # This process is the agent: the supervisor runs in it.
    script = REPORT.replace("$TOKEN_FILE", str(token)).replace("$AGENT_PID", str(os.getpid()))
    work = supervisor(tmp_path, statuses, script, environ)
    work.start(spec(3, "mocker"))
    await statuses.next(WorkerState.STARTING)
    failed = await statuses.next(WorkerState.FAILED)  # it exits 0 unasked, as a report
    nobody = lookup_user("nobody")
    assert f"uid={nobody.uid} gid={nobody.gid} home={nobody.home} cwd=/" in failed.reason
    assert "token in environment: 0" in failed.reason
    assert "token file: refused" in failed.reason
    assert "agent environ: refused" in failed.reason


@as_root
async def test_a_worker_as_nobody_is_still_stopped_with_what_it_left_in_another_session(
    tmp_path: Path, agent_files: Path
) -> None:
    fifo = agent_files / "left-behind"
    os.mkfifo(fifo, 0o666)
    os.chmod(fifo, 0o666)
    statuses = Statuses()
    work = supervisor(tmp_path, statuses, STUBBORN.replace('"$FIFO"', str(fifo)), {"PATH": "/usr/bin:/bin"})
    try:
        work.start(spec(4, "mocker"))
        starting = await statuses.next(WorkerState.STARTING)
        left = int(await asyncio.to_thread(fifo.read_text))  # once it is in a session of its own
        assert os.stat(f"/proc/{left}").st_uid == lookup_user("nobody").uid
        assert os.getsid(left) == left  # its own session: only the mark in its environment finds it
        await work.stop(4)
        assert [status.state for status in statuses.pending()] == [WorkerState.STOPPING, WorkerState.STOPPED]
        assert process_start_time(starting.pid or 0) is None
        await pid_gone(left)
    finally:
        kill_recorded_workers(tmp_path / "state")
    assert load_records(tmp_path / "state") == []
