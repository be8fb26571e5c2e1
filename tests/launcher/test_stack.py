"""`flotilla up`: its refusals, the processes it runs, and the whole stack end to end (servers, control plane,
Celery, an agent, the gateway, a mocker pipeline) up to Ctrl-C, after which no process of it is left; a part that
dies is restarted (the agent adopting its worker while the gateway serves) until it keeps dying: then a part the
gateway needs stops the stack, and any other is reported while the gateway serves on."""

import asyncio
import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agent.workers.processes import process_start_time, until_readable
from agent.workers.records import load_records
from launcher.stack.processes import Child, choose_port
from launcher.stack.servers import find_binaries
from runtime.errors import ConfigError
from tests.servers import free_port, smollm2_path

MODEL = "SmolLM2-135M-Instruct.Q4_1"
BANNER = "Flotilla is up"

# serial: whole stacks of a dozen processes each, with deadlines for their starts and stops.
pytestmark = pytest.mark.serial


def up_command(data_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "launcher.cli", "up", "--data-dir", str(data_dir), *args]


def run_up(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(up_command(data_dir, *args), capture_output=True, text=True, timeout=60)


# -- refusals: each names what to change, with exit code 2 -------------------------------------------------


def test_an_engine_that_needs_a_gpu_is_refused_naming_the_flag(tmp_path: Path) -> None:
    result = run_up(tmp_path, "--engine", "vllm")
    assert result.returncode == 2
    assert "--engine" in result.stderr and "'vllm'" in result.stderr


def test_a_model_that_does_not_exist_is_refused_naming_the_flag(tmp_path: Path) -> None:
    result = run_up(tmp_path, "--model", str(tmp_path / "nothing.gguf"))
    assert result.returncode == 2
    assert result.stderr.startswith("flotilla up: --model (FLOTILLA_MODEL_PATH)")


def test_llamacpp_with_a_model_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    result = run_up(tmp_path / "data", "--model", str(folder), "--engine", "llamacpp")
    assert result.returncode == 2
    assert "--engine llamacpp loads a GGUF file" in result.stderr


def test_a_bad_variable_is_refused_naming_it(tmp_path: Path) -> None:
    env = {**os.environ, "FLOTILLA_CONTROL_PLANE_PORT": "eighty"}
    result = subprocess.run(up_command(tmp_path), capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert "FLOTILLA_CONTROL_PLANE_PORT" in result.stderr


def test_a_gateway_port_in_use_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_up(tmp_path, "--http-port", str(port), "--no-pipeline")
    assert result.returncode == 2
    assert f"--http-port {port}: 127.0.0.1:{port} is in use" in result.stderr
    assert not (tmp_path / "logs").exists()


def test_a_second_up_on_the_same_data_folder_is_refused(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    with (tmp_path / "up.lock").open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write("4242\n")
        lock.flush()
        result = run_up(tmp_path, "--no-pipeline", "--http-port", str(free_port()))
    assert result.returncode == 2
    assert f"another `flotilla up` (pid 4242) uses {tmp_path}" in result.stderr


def test_missing_servers_point_to_make_system_deps() -> None:
    with pytest.raises(ConfigError, match=r"no-such-server is not installed: run `make system-deps`"):
        find_binaries(("sh", "no-such-server"))


# -- ports ---------------------------------------------------------------------------------------------------


def test_a_free_usual_port_is_taken_and_a_busy_one_is_replaced() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        busy_port = busy.getsockname()[1]
        free = free_port()
        assert choose_port(free, set()) == free
        replacement = choose_port(busy_port, set())
        assert replacement not in (busy_port, 0)
        assert choose_port(free, {free}) != free  # already chosen for another server of the stack


# -- children ------------------------------------------------------------------------------------------------


async def test_stopping_a_child_that_ignores_sigterm_kills_its_whole_group(tmp_path: Path) -> None:
    # The shell ignores SIGTERM and has a child of its own: both go, through the process group.
    pid_file = tmp_path / "grandchild"
    script = f"trap '' TERM; sleep 300 & echo $! > {pid_file}.tmp; mv {pid_file}.tmp {pid_file}; wait"
    child = Child("stubborn", ["sh", "-c", script], {"PATH": os.environ["PATH"]}, tmp_path / "stubborn.log")
    child.start()
    while not pid_file.exists():  # noqa: ASYNC110 (another process's file: no event to await)
        await asyncio.sleep(0.02)
    grandchild = os.pidfd_open(int(pid_file.read_text()))
    try:
        await child.stop(0.2)
        assert child.exited.result() == -signal.SIGKILL
        # A pidfd turns readable when its process has ended: the grandchild was killed too.
        await asyncio.wait_for(until_readable(grandchild), 10)
    finally:
        os.close(grandchild)


async def test_a_childs_captured_output_is_kept_apart_from_its_log(tmp_path: Path) -> None:
    child = Child("talker", ["sh", "-c", "echo secret; echo noise >&2"], {}, tmp_path / "talker.log")
    child.start(capture_stdout=True)
    assert await child.exited == 0
    assert child.output() == "secret\n"
    assert (tmp_path / "talker.log").read_text() == "noise\n"


def test_a_child_gets_sigterm_when_flotilla_up_is_killed(tmp_path: Path) -> None:
    parent_script = f"""
import asyncio, sys
sys.path.insert(0, {str(Path.cwd())!r})
from pathlib import Path
from launcher.stack.processes import Child

async def main():
    child = Child("sleeper", ["sleep", "300"], {{}}, Path({str(tmp_path / "sleeper.log")!r}))
    child.start()
    print(child.pid, flush=True)
    await asyncio.sleep(300)

asyncio.run(main())
"""
    parent = subprocess.Popen([sys.executable, "-c", parent_script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    sleeper = int(parent.stdout.readline())
    assert process_start_time(sleeper) is not None
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while process_start_time(sleeper) is not None:
        assert time.monotonic() < deadline, "the child outlived the killed parent"
        time.sleep(0.02)  # another process's end: it is not our child, so no event to await


# -- the whole stack -----------------------------------------------------------------------------------------


def descendants(pid: int) -> dict[int, int]:
    """Every process under ``pid`` now, as pid -> start time (which tells a reused pid apart)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found: dict[int, int] = {}
    queue = [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            start = process_start_time(child)
            if start is not None:
                found[child] = start
                queue.append(child)
    return found


def still_running(processes: dict[int, int]) -> list[int]:
    return [pid for pid, start in processes.items() if process_start_time(pid) == start]


def wait_for_end(processes: dict[int, int], timeout_s: float) -> dict[int, str]:
    """Wait up to ``timeout_s`` for ``processes`` to end; those still running then, with their command lines."""
    deadline = time.monotonic() + timeout_s
    while still_running(processes) and time.monotonic() < deadline:
        time.sleep(0.1)  # other processes' ends: there is no event to await
    return {pid: args_of(pid) for pid in still_running(processes)}


class Up:
    """A `flotilla up` process on free ports, with the mocker engine, its output in a file."""

    def __init__(self, data_dir: Path, log_path: Path, *args: str) -> None:
        self.data_dir = data_dir
        self.log_path = log_path
        self.http_port = free_port()
        self.control_plane_port = free_port()
        ports = ["--http-port", str(self.http_port), "--control-plane-port", str(self.control_plane_port)]
        ports += ["--etcd-port", "0", "--nats-port", "0", "--redis-port", "0"]
        env = {**os.environ, "FLOTILLA_LOG": "info", "FLOTILLA_RECONCILE_S": "0.5"}
        with log_path.open("wb") as log_file:
            self.process = subprocess.Popen(
                up_command(data_dir, *ports, "--engine", "mocker", *args), stdout=log_file, stderr=log_file, env=env
            )

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def control_plane(self) -> str:
        return f"http://127.0.0.1:{self.control_plane_port}"

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_until_up(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while BANNER not in self.output():
            assert self.process.poll() is None, self.output()
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.1)  # another process's output: no event to await

    def api_key_header(self) -> dict[str, str]:
        """The header of the API key ``flotilla up`` made for the OpenAI endpoint."""
        return {"Authorization": f"Bearer {(self.data_dir / 'api.key').read_text().strip()}"}

    def admin(self) -> httpx.Client:
        token = (self.data_dir / "admin.token").read_text().strip()
        return httpx.Client(base_url=f"{self.control_plane}/api/v1", headers={"Authorization": f"Bearer {token}"})

    def stop(self, signum: int) -> int:
        self.process.send_signal(signum)
        return self.process.wait(timeout=120)


def stop_stack(stack: Up) -> None:
    """Stop ``stack`` whatever happened: by SIGTERM, else by force, its engine workers too (which a killed
    `flotilla up` cannot stop)."""
    if stack.process.poll() is None:
        stack.process.terminate()
        try:
            stack.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            stack.process.kill()
            stack.process.wait()
    for record in load_records(stack.data_dir / "agent"):
        if process_start_time(record.pid) == record.start_time:
            os.killpg(record.pid, signal.SIGKILL)


@pytest.fixture
def stacks() -> Iterator[list[Up]]:
    """Every stack a test starts is stopped at its end, whatever happened."""
    started: list[Up] = []
    yield started
    for stack in started:
        stop_stack(stack)


@pytest.fixture(scope="module")
def served_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """One stack serving a mocker pipeline, shared by the tests that look at its processes or kill one it restarts
    (starting a stack takes most of a test's time). One restart per part, and a part given up on is tried again 3 s
    later: a give-up takes two kills, and its retry little time."""
    folder = tmp_path_factory.mktemp("served")
    stack = Up(folder / "data", folder / "up.log", "--restart-burst", "1", "--retry-given-up", "3")
    try:
        stack.wait_until_up()
        yield stack
    finally:
        stop_stack(stack)


def args_of(pid: int) -> str:
    """The command line ``ps`` shows for ``pid`` ("" once it has gone)."""
    result = subprocess.run(["ps", "-o", "args=", "-p", str(pid)], capture_output=True, text=True, check=False)
    return result.stdout.strip()


def pid_titled(stack: Up, title: str, timeout: float = 60) -> int:
    """The pid of the process of ``stack`` that ``ps`` shows as ``title``, once there is one."""
    deadline = time.monotonic() + timeout
    while True:
        found = [pid for pid in descendants(stack.process.pid) if args_of(pid) == title]
        if found:
            return found[0]
        assert stack.process.poll() is None, stack.output()
        assert time.monotonic() < deadline, f"no process titled {title!r}: {stack.output()}"
        time.sleep(0.1)  # another process's start: no event to await


def wait_for_output(stack: Up, text: str, timeout: float = 60) -> None:
    """Return once ``stack`` has printed ``text``."""
    deadline = time.monotonic() + timeout
    while text not in stack.output():
        assert stack.process.poll() is None or text in stack.output(), f"{text!r} not printed: {stack.output()}"
        assert time.monotonic() < deadline, f"{text!r} not printed: {stack.output()}"
        time.sleep(0.1)  # another process's output: no event to await


def bridges(stack: Up) -> list[int]:
    """The pids of the live-update bridge of ``stack`` now (none, or one)."""
    return [pid for pid in descendants(stack.process.pid) if "live_bridge" in args_of(pid)]


def kill_each_start(stack: Up, times: int) -> list[int]:
    """SIGKILL the live-update bridge of ``stack`` ``times`` times, each time once it runs again; returns the pids."""
    killed: list[int] = []
    for _ in range(times):
        deadline = time.monotonic() + 60
        while not (alive := [pid for pid in bridges(stack) if pid not in killed]):
            assert stack.process.poll() is None, stack.output()
            assert time.monotonic() < deadline, stack.output()
            time.sleep(0.1)  # another process's start: no event to await
        os.kill(alive[0], signal.SIGKILL)
        killed.append(alive[0])
    return killed


def chat(stack: "Up") -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
    }
    return httpx.post(f"{stack.gateway}/v1/chat/completions", json=body, headers=stack.api_key_header(), timeout=60)


def test_up_serves_the_apis_and_ctrl_c_leaves_no_process_behind_even_after_giving_up_on_a_part(
    tmp_path: Path, stacks: list[Up]
) -> None:
    stack = Up(tmp_path / "data", tmp_path / "up.log", "--restart-burst", "0")
    stacks.append(stack)
    stack.wait_until_up()
    output = stack.output()

    # The admin's password is printed once, and works.
    password = re.search(r"Created the admin account: user 'admin', password '([^']+)'", output)
    assert password is not None, output
    with httpx.Client(base_url=stack.control_plane) as browser:
        csrf = browser.get("/admin/login/").cookies["csrftoken"]
        login = browser.post(
            "/admin/login/",
            data={"username": "admin", "password": password.group(1), "csrfmiddlewaretoken": csrf},
            headers={"Referer": f"{stack.control_plane}/admin/login/"},
        )
        # A wrong password shows the form again (200); a right one signs in and redirects.
        assert login.status_code == 302 and "sessionid" in browser.cookies, login.text[:500]

    # The REST API: the first pipeline, its ready instance on node "local".
    with stack.admin() as api:
        pipelines = api.get("pipelines/").json()["results"]
        assert [(p["name"], p["groups"][0]["engine"]) for p in pipelines] == [(MODEL, "mocker")]
        instances = api.get("instances/", params={"state": "ready"}).json()["results"]
        assert [(i["pipeline_name"], i["node"]) for i in instances] == [(MODEL, "local")]
    assert oct((stack.data_dir / "agent-local.token").stat().st_mode & 0o777) == "0o600"

    # The OpenAI API.
    # The OpenAI API needs the API key printed once (and kept in api.key); without it, a 401.
    key = re.search(r"Created an API key for the OpenAI endpoint: (sk-flt-\S+)", output)
    assert key is not None and stack.api_key_header() == {"Authorization": f"Bearer {key.group(1)}"}, output
    assert oct((stack.data_dir / "api.key").stat().st_mode & 0o777) == "0o600"
    refused = httpx.get(f"{stack.gateway}/v1/models", timeout=10)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    models = httpx.get(f"{stack.gateway}/v1/models", headers=stack.api_key_header(), timeout=10).json()
    assert [model["id"] for model in models["data"]] == [MODEL]
    reply = chat(stack)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] > 0

    # A part off the serving path given up on (--restart-burst 0) is to be started again 300 s later: not once
    # Ctrl-C came.
    kill_each_start(stack, 1)
    wait_for_output(stack, "flotilla up: ERROR: the live-update bridge was killed by signal 9 (SIGKILL), and restarts")
    assert chat(stack).status_code == 200

    # Ctrl-C: every process goes, the engine worker (which the agent leaves running when it stops) included.
    processes = descendants(stack.process.pid)
    workers = load_records(stack.data_dir / "agent")
    assert len(workers) == 1 and workers[0].pid in processes
    assert stack.stop(signal.SIGINT) == 130
    assert still_running(processes) == []
    assert "starting the live-update bridge again" not in stack.output()


def test_up_after_a_killed_up_stops_its_orphaned_worker_and_reuses_the_admin_and_pipeline(
    tmp_path: Path, stacks: list[Up]
) -> None:
    first = Up(tmp_path / "data", tmp_path / "first.log")
    stacks.append(first)
    first.wait_until_up()
    admin_token = (first.data_dir / "admin.token").read_text()
    api_key = first.api_key_header()
    # Killed outright, `flotilla up` stops nothing: its own children end (the kernel sends them SIGTERM), but the
    # engine worker, which the agent started and leaves running, is orphaned.
    first_processes = descendants(first.process.pid)
    first.process.kill()
    first.process.wait()
    [orphan] = load_records(first.data_dir / "agent")
    assert process_start_time(orphan.pid) == orphan.start_time

    second = Up(tmp_path / "data", tmp_path / "second.log")
    stacks.append(second)
    second.wait_until_up()
    output = second.output()
    assert "stopping 1 engine worker(s) left running by an earlier `flotilla up`" in output
    assert process_start_time(orphan.pid) != orphan.start_time
    assert "Created the admin account" not in output
    assert (second.data_dir / "admin.token").read_text() == admin_token
    # The API key too: the same one works, and no new one is printed.
    assert "Created an API key" not in output and second.api_key_header() == api_key
    with second.admin() as api:
        assert [p["name"] for p in api.get("pipelines/").json()["results"]] == [MODEL]
    assert chat(second).status_code == 200

    processes = descendants(second.process.pid)
    assert second.stop(signal.SIGTERM) == 0
    assert still_running(processes) == []
    # The killed stack's own children went with it (SIGTERM from the kernel; a loaded machine may take
    # them a few seconds to shut down).
    lingering = wait_for_end(first_processes, timeout_s=20)
    assert lingering == {}, lingering


def test_ps_names_up_the_agent_the_gateway_and_the_engine_worker(served_stack: Up) -> None:
    assert args_of(served_stack.process.pid) == "flotilla up"
    pid_titled(served_stack, "flotilla agent local")
    pid_titled(served_stack, "flotilla gateway")
    [worker] = load_records(served_stack.data_dir / "agent")
    # The worker serves the pipeline's namespace (its name, made address-safe) at backend.generate.
    assert re.fullmatch(r"flotilla worker [\w-]+\.backend\.generate mocker", args_of(worker.pid)), args_of(worker.pid)


def test_a_killed_agent_is_restarted_and_adopts_its_worker_while_the_gateway_serves(served_stack: Up) -> None:
    stack = served_stack
    agent = pid_titled(stack, "flotilla agent local")
    [worker] = load_records(stack.data_dir / "agent")
    agent_log = stack.data_dir / "logs" / "agent.log"
    adopted = "adopted 1 running worker(s)"
    adoptions = agent_log.read_text().count(adopted)

    # Chat completions one after another, from before the kill until after the new agent has adopted the worker.
    statuses: list[int | str] = []
    done = threading.Event()

    def keep_asking() -> None:
        while not done.is_set():
            try:
                statuses.append(chat(stack).status_code)
            except httpx.HTTPError as exc:
                statuses.append(repr(exc))

    asker = threading.Thread(target=keep_asking)
    asker.start()
    try:
        os.kill(agent, signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + 90
        while agent_log.read_text().count(adopted) == adoptions:
            assert stack.process.poll() is None, stack.output()
            assert time.monotonic() < deadline, stack.output()
            time.sleep(0.1)  # another process's log: no event to await
        back_after = time.monotonic() - killed
    finally:
        done.set()
        asker.join()

    print(f"the agent adopted its worker {back_after:.1f} s after its kill; {len(statuses)} chat completions meanwhile")
    assert statuses and set(statuses) == {200}, statuses
    assert pid_titled(stack, "flotilla agent local") != agent
    assert "the agent (node local) was killed by signal 9 (SIGKILL); restarting it in 1 s (restart 1 of 1" in (
        stack.output()
    )
    assert process_start_time(worker.pid) == worker.start_time  # adopted, not started again
    assert [record.pid for record in load_records(stack.data_dir / "agent")] == [worker.pid]
    assert chat(stack).status_code == 200
    assert stack.process.poll() is None


def test_a_part_off_the_serving_path_that_keeps_dying_is_reported_while_the_gateway_serves_and_tried_again_later(
    served_stack: Up,
) -> None:
    stack = served_stack
    killed = kill_each_start(stack, 2)  # restarted once (--restart-burst 1), then one end too many
    bridge = "the live-update bridge was killed by signal 9 (SIGKILL)"
    wait_for_output(stack, f"flotilla up: ERROR: {bridge}, its 2nd end within 120 s: it keeps failing.")
    output = stack.output()
    assert f"{bridge}; restarting it in 1 s (restart 1 of 1 within 120 s)" in output
    assert "The OpenAI endpoint does not need it: it goes on serving" in output
    assert "No longer works meanwhile: the dashboard's pipeline pages do not update live" in output
    assert f"The last lines of its log ({stack.data_dir}/logs/live-bridge.log):" in output
    assert "`flotilla up` starts it again in 3 s" in output

    assert chat(stack).status_code == 200
    assert stack.process.poll() is None
    # --retry-given-up later, a new bridge, with its restarts counted afresh.
    wait_for_output(stack, "starting the live-update bridge again, 3 s after giving up on it")
    deadline = time.monotonic() + 60
    while not [pid for pid in bridges(stack) if pid not in killed]:
        assert time.monotonic() < deadline, stack.output()
        time.sleep(0.1)  # another process's start: no event to await
    assert stack.process.poll() is None


def test_a_part_the_gateway_needs_that_dies_stops_the_stack_naming_it_with_its_log(
    tmp_path: Path, stacks: list[Up]
) -> None:
    stack = Up(tmp_path / "data", tmp_path / "up.log", "--no-pipeline", "--restart-burst", "0")
    stacks.append(stack)
    stack.wait_until_up()
    processes = descendants(stack.process.pid)
    os.kill(pid_titled(stack, "flotilla gateway"), signal.SIGKILL)
    assert stack.process.wait(timeout=120) == 1
    output = stack.output()
    assert "flotilla up: the gateway was killed by signal 9 (SIGKILL), and restarts are off (--restart-burst 0)" in (
        output
    )
    assert f"the last lines of its log ({stack.data_dir}/logs/gateway.log)" in output
    assert still_running(processes) == []


def test_up_on_a_data_folder_whose_model_file_went_with_an_old_checkout_points_it_at_this_ones(
    tmp_path: Path, stacks: list[Up]
) -> None:
    # A data folder outlives the checkout that made it: its first model is the GGUF in that checkout's venv.
    old, new = tmp_path / "old-checkout" / f"{MODEL}.gguf", tmp_path / "new-checkout" / f"{MODEL}.gguf"
    for path in (old, new):
        path.parent.mkdir()
        shutil.copyfile(smollm2_path(), path)
    first = Up(tmp_path / "data", tmp_path / "first.log", "--model", str(old))
    stacks.append(first)
    first.wait_until_up()
    assert first.stop(signal.SIGTERM) == 0
    old.unlink()  # the old checkout is deleted
    second = Up(tmp_path / "data", tmp_path / "second.log", "--model", str(new))
    stacks.append(second)
    second.wait_until_up()
    assert f"model {MODEL}: {old} is gone; it is now {new}" in second.output()
    with second.admin() as api:
        [model] = api.get("models/", params={"name": MODEL}).json()["results"]
    assert model["source"] == str(new)
    assert chat(second).status_code == 200
