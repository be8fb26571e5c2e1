"""``flotilla up``: the whole stack on one machine, with one command.

It runs, each as a child process with its log in ``<data dir>/logs/``: etcd, NATS (JetStream) and Redis on
loopback; the control plane (migrations, then uvicorn) with a first admin account; the Celery worker with
the reconciler's beat; the dashboard's live-update bridge (``manage.py live_bridge``); the planner's loop
(``manage.py planner``); one agent (node ``local``); the gateway (``flotilla run in=http out=dyn``). Then,
when the control plane has no pipeline yet, it deploys one of the default model, and once that model is served it
prints where everything is.

It supervises them as systemd would (``Restart=`` with ``StartLimitBurst=``, launcher/stack/restarts.py): a
part that ends once it is up is started again, on the same ports and data, after a delay that doubles from 1 s
to 30 s, and each restart is said in one line. The agent adopts the engine workers it left running (they are in
sessions of their own, so the agent's end does not take them along), and the gateway, which needs only etcd
and NATS, keeps serving meanwhile. A part that dies while starting stops the whole stack. One that ends more than
``--restart-burst`` times within ``--restart-window`` seconds, or exits with code 2 (its configuration refused,
which a restart at once would repeat), is given up on: when it is on the serving path (the gateway, etcd, NATS:
launcher/stack/parts.py) that stops the whole stack, its log's tail shown, and ``flotilla up`` exits 1; any other
part is reported as an ERROR (what no longer works, its log's tail) while the stack serves on, and is started
again every ``--retry-given-up`` seconds.

Ctrl-C or SIGTERM stops everything, the engine workers too: the agent leaves them running when it stops (that
is how a restarted agent adopts them), so ``flotilla up`` stops them itself, through the agent's worker
records. ``ps`` shows the programs by name (``flotilla up``, ``flotilla agent local``, ``flotilla gateway``,
``flotilla worker NAMESPACE.COMPONENT.ENDPOINT ENGINE``: launcher/proctitle.py).
"""

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from agent.workers.processes import WorkerProcess
from agent.workers.records import load_records
from controlplane.web_security import web_security
from launcher.proctitle import set_title
from launcher.stack.controlplane import (
    ADMIN_TOKEN_FILE,
    ADMIN_USERNAME,
    AGENT_TOKEN_FILE,
    API_KEY_FILE,
    LOCAL_NODE,
    ControlPlaneClient,
    ControlPlaneError,
    bootstrap_command,
    development_notice,
    local_model_roots,
    manage_command,
    parse_bootstrap,
    read_secret,
    write_secret,
)
from launcher.stack.options import UpOptions, build_up_parser, parse_up_options
from launcher.stack.parts import Role, given_up_report, role_of
from launcher.stack.processes import Child, choose_port, port_is_free
from launcher.stack.restarts import GiveUp, RestartHistory, describe_end
from launcher.stack.servers import ServerSpec, etcd_server, find_binaries, nats_server, redis_server
from runtime.config import env_str
from runtime.errors import ConfigError, FlotillaError, ModelError
from runtime.fleet_contract.api_keys import secret_in
from runtime.fleet_contract.tasks import BATCHES_QUEUE, CONTROL_PLANE_QUEUE
from runtime.logging import configure_logging

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_INTERRUPTED = 0, 1, 2, 130
ETCD_PEER_PORT = 2380  # etcd's usual peer port, beside its client port 2379

SERVER_START_S = 30.0  # etcd, NATS, Redis: well under a second when all is well
SERVICE_START_S = 120.0  # the control plane and the gateway: imports and migrations on a slow machine
STOP_S = 15.0  # each child's grace between SIGTERM and SIGKILL
WORKER_STOP_S = 30.0  # an engine worker drains its requests first (FLOTILLA_DRAIN_S, 10 s by default)
_POLL_S = 0.2


def main(argv: list[str]) -> int:
    """``flotilla up ARGV``. Returns the exit code."""
    try:
        parser = build_up_parser()
        namespace = parser.parse_args(argv)
        configure_logging(env_str("FLOTILLA_LOG"), namespace.verbose)
        options = parse_up_options(parser, namespace)
        set_title("flotilla up")
        variables = set(parser.variables.values())
        return asyncio.run(Stack(options, variables).run())
    except (ConfigError, ModelError) as exc:
        print(f"flotilla up: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except FlotillaError as exc:
        print(f"flotilla up: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


class ChildDied(FlotillaError):
    """A process of the stack ended on its own and is not started again: it had not come up yet, or it keeps
    ending (the message says which)."""

    def __init__(self, child: Child, message: str) -> None:
        super().__init__(message)
        self.child = child


class Interrupted(Exception):
    """A signal asked the stack to stop while it was starting."""


class StartupFailed(FlotillaError):
    """A part did not come up; ``child``, when known, is the one whose log says why."""

    def __init__(self, message: str, child: Child | None = None) -> None:
        super().__init__(message)
        self.child = child


@dataclass
class Layout:
    """Where ``flotilla up`` keeps things under the data folder."""

    data_dir: Path

    @property
    def logs(self) -> Path:
        return self.data_dir / "logs"

    @property
    def agent_state(self) -> Path:
        return self.data_dir / "agent"


class Progress:
    """One status line: rewritten in place on a terminal, printed when it changes otherwise."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out
        self._tty = out.isatty()
        self._last = ""

    def show(self, text: str) -> None:
        if text == self._last:
            return
        self._last = text
        if self._tty:
            self._out.write(f"\r\x1b[K{text}")
        else:
            self._out.write(f"{text}\n")
        self._out.flush()

    def done(self) -> None:
        if self._tty and self._last:
            self._out.write("\r\x1b[K")
            self._out.flush()
        self._last = ""


class Stack:
    """One run of ``flotilla up``: ``run()`` starts every part, restarts those that end, and stops them all on a
    signal or when one the gateway needs keeps ending (one it does not need is reported and tried again later)."""

    def __init__(self, options: UpOptions, own_variables: set[str], out: IO[str] = sys.stdout) -> None:
        self.options = options
        self.layout = Layout(options.data_dir)
        self.out = out
        # The children's environment: ours, less the variables that configure `flotilla up` itself (the
        # gateway must not take FLOTILLA_HTTP_PORT from them, say); what each child needs is set explicitly.
        # A token in the environment would win over the agent's token file.
        dropped = {*own_variables, "FLOTILLA_AGENT_TOKEN"}
        self.base_env = {key: value for key, value in os.environ.items() if key not in dropped}
        self.base_env["PYTHONUNBUFFERED"] = "1"  # log lines reach the files as they are written
        self.children: list[Child] = []  # long-running, in start order
        self._agent: Child | None = None
        self._one_shot: set[Child] = set()
        # Long-running children that have come up: from then on their end is followed by a restart.
        self._up: set[Child] = set()
        self._histories: dict[Child, RestartHistory] = {}
        self._roles: dict[Child, Role] = {}
        self._restarts: set[asyncio.Task[None]] = set()  # each waits out a restart's delay, then starts a child
        self._failure: ChildDied | StartupFailed | None = None  # a part that is not restarted: the stack stops
        self._stopping = False
        self._changed = asyncio.Event()  # a signal came, or a part failed for good: whatever waits looks again
        self._signal: int | None = None
        self._hurry = asyncio.Event()  # a second signal: no more grace periods
        self._http = httpx.AsyncClient(timeout=2.0)
        self.urls: dict[str, str] = {}
        self.dashboard = False

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    async def run(self) -> int:
        """Start, serve, stop. Returns the exit code (0 SIGTERM, 130 Ctrl-C, 1 a part failed).

        Raises ConfigError (a port in use, a missing program, the data folder in use by another stack).
        """
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(signum, self._on_signal, signum)
        failed = False
        try:
            with self._lock_data_dir():
                try:
                    await self._start()
                    await self._until_changed()
                except (ConfigError, ModelError):
                    raise
                except Interrupted:
                    pass
                except (ChildDied, StartupFailed) as exc:
                    failed = True
                    self._report(str(exc), exc.child)
                except FlotillaError as exc:
                    failed = True
                    self._report(str(exc), None)
                finally:
                    await self._stop_all()
                    self.say("Flotilla stopped.")
        finally:
            await self._http.aclose()
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(signum)
        if failed:
            return EXIT_FAILED
        return EXIT_INTERRUPTED if self._signal == signal.SIGINT else EXIT_OK

    def _on_signal(self, signum: int) -> None:
        if self._signal is None:
            self._signal = signum
            self.say(f"\n{signal.Signals(signum).name}: stopping everything (Ctrl-C again to kill at once)")
        else:
            self._hurry.set()
        self._changed.set()

    def _report(self, message: str, child: Child | None) -> None:
        lines = [f"flotilla up: {message}"]
        if child is not None:
            lines.append(f"the last lines of its log ({child.log_path}):")
            lines += [f"  {line}" for line in child.log().splitlines()]
        lines.append("stopping the rest")
        print("\n".join(lines), file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def _lock_data_dir(self) -> Iterator[None]:
        """Hold ``up.lock`` in the data folder: two stacks on one database and one set of tokens would clash.

        Raises ConfigError naming the process that holds it.
        """
        self.layout.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock_path = self.layout.data_dir / "up.lock"
        with lock_path.open("a+") as lock_file:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock_file.seek(0)
                holder = lock_file.read().strip() or "?"
                raise ConfigError(
                    f"another `flotilla up` (pid {holder}) uses {self.layout.data_dir}; "
                    "stop it, or give this one another --data-dir"
                ) from None
            lock_file.truncate(0)
            lock_file.write(f"{os.getpid()}\n")
            lock_file.flush()
            yield

    # -- waiting -------------------------------------------------------------------------------------------

    def _raise_if_changed(self) -> None:
        """Raises Interrupted after a signal; ChildDied or StartupFailed when a long-running child that ended is not
        started again."""
        if self._signal is not None:
            raise Interrupted
        if self._failure is not None:
            raise self._failure

    async def _pause(self, seconds: float) -> None:
        """Wait ``seconds``, or less if a signal comes or a child ends (then raise as _raise_if_changed)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), seconds)
        self._raise_if_changed()

    async def _until_changed(self) -> None:
        """Wait for a signal or a child's end; raises as _raise_if_changed."""
        await self._changed.wait()
        self._raise_if_changed()

    async def _wait_ready(self, child: Child, ready: Callable[[], Awaitable[bool]], limit_s: float) -> None:
        """Return once ``ready()`` is true. Raises StartupFailed after ``limit_s`` seconds, or as _pause."""
        deadline = asyncio.get_running_loop().time() + limit_s
        while not await ready():
            if asyncio.get_running_loop().time() > deadline:
                raise StartupFailed(f"{child.name} did not answer within {limit_s:.0f} s", child)
            await self._pause(_POLL_S)
        self._up.add(child)

    async def _http_answers(self, url: str, *, ok_only: bool = False) -> bool:
        """Whether ``url`` answers: with 200 (``ok_only``), or with anything but a server error."""
        try:
            response = await self._http.get(url)
        except httpx.HTTPError:
            return False
        return response.status_code == 200 if ok_only else response.status_code < 500

    # -- starting ------------------------------------------------------------------------------------------

    def _child(self, name: str, log_name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        return Child(name, argv, {**self.base_env, **(env or {})}, self.layout.logs / f"{log_name}.log")

    def _launch(self, child: Child, *, answers: bool = False) -> Child:
        """Start a long-running child. It is up at once, or with ``answers`` once _wait_ready has seen it answer;
        an end before that fails the start (a restart would fail alike), an end after it is followed by a
        restart (_on_exit). Raises StartupFailed."""
        self._histories[child] = RestartHistory(self.options.restarts)
        self._roles[child] = role_of(child.log_path.stem)
        self._start_child(child)
        self.children.append(child)
        if not answers:
            self._up.add(child)
        return child

    def _start_child(self, child: Child) -> None:
        """Start ``child`` (again), watched by _on_exit. Raises StartupFailed."""
        try:
            child.start()
        except OSError as exc:
            raise StartupFailed(f"cannot run {child.name} ({child.argv[0]}): {exc.strerror}") from exc
        child.exited.add_done_callback(lambda exited: self._on_exit(child, exited.result()))

    def _on_exit(self, child: Child, code: int) -> None:
        """A long-running child ended: restart it later, or give up on it (which fails the stack when the gateway
        needs it)."""
        if self._stopping or self._signal is not None or self._failure is not None:
            return
        how = f"{child.name} {describe_end(code)}"
        if child not in self._up:
            self._fail(ChildDied(child, how))
            return
        policy = self.options.restarts
        decision = self._histories[child].ended(asyncio.get_running_loop().time(), code)
        if isinstance(decision, GiveUp):
            self._give_up(child, ChildDied(child, f"{how}, {decision.why(policy)}"))
            return
        self.say(
            f"{how}; restarting it in {decision.delay_s:.0f} s "
            f"(restart {decision.number} of {policy.burst} within {policy.window_s:.0f} s)"
        )
        self._restart_later(child, decision.delay_s)

    def _give_up(self, child: Child, failure: ChildDied | StartupFailed) -> None:
        """Restart ``child`` no more: fail the stack when the gateway needs it; else say so loudly, serve on, and
        start it again after ``--retry-given-up`` seconds."""
        role = self._roles[child]
        if role.serving:
            self._fail(failure)
            return
        retry_s = self.options.restarts.retry_given_up_s
        report = given_up_report(str(failure), role, str(child.log_path), child.log(), retry_s)
        print(report, file=sys.stderr, flush=True)
        self._restart_later(child, retry_s, retry=True)

    def _restart_later(self, child: Child, delay_s: float, *, retry: bool = False) -> None:
        """Start ``child`` again in ``delay_s`` seconds (unless the stack stops first); ``retry``: after a give-up."""
        task = asyncio.get_running_loop().create_task(
            self._restart(child, delay_s, retry=retry), name=f"restart {child.name}"
        )
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, child: Child, delay_s: float, *, retry: bool) -> None:
        await asyncio.sleep(delay_s)
        if retry:
            self.say(f"starting {child.name} again, {delay_s:.0f} s after giving up on it")
            self._histories[child] = RestartHistory(self.options.restarts)  # a new run of restarts
        try:
            self._start_child(child)
        except StartupFailed as exc:
            self._give_up(child, StartupFailed(str(exc), child))  # its log says how it ended before

    def _fail(self, failure: ChildDied | StartupFailed) -> None:
        self._failure = failure
        self._changed.set()

    async def _run_once(self, child: Child, *, capture: bool = False) -> str:
        """Run a command to its end; returns its stdout when ``capture`` (else it goes to the log).

        Raises StartupFailed when it cannot run or fails, or as _pause.
        """
        try:
            child.start(capture_stdout=capture)
        except OSError as exc:
            raise StartupFailed(f"cannot run {child.name} ({child.argv[0]}): {exc.strerror}") from exc
        self._one_shot.add(child)
        changed: asyncio.Future[Any] = asyncio.ensure_future(self._changed.wait())
        try:
            await asyncio.wait({child.exited, changed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
        self._raise_if_changed()  # a signal: _stop_all stops it too
        self._one_shot.discard(child)
        code = child.exited.result()
        if code != 0:
            raise StartupFailed(f"{child.name} failed (exit code {code})", child)
        return child.output()

    async def _start(self) -> None:
        options, layout = self.options, self.layout
        binaries = find_binaries(("etcd", "nats-server", "redis-server"))
        for flag, port in (("--http-port", options.http_port), ("--control-plane-port", options.control_plane_port)):
            if not port_is_free(port):
                raise ConfigError(f"{flag} {port}: 127.0.0.1:{port} is in use; choose another port with {flag}")
        self.say(f"Flotilla: starting the stack; logs in {layout.logs}/")
        # Workers still running from a `flotilla up` that was killed (it could not stop them) would hold on to
        # servers that are gone: stopped now, the agent reports them ended and the control plane restarts them.
        await self._stop_engine_workers("left running by an earlier `flotilla up`")
        taken = {options.http_port, options.control_plane_port}
        ports: dict[str, int] = {}
        for name, wanted in (
            ("etcd", options.etcd_port),
            ("etcd peer", ETCD_PEER_PORT if options.etcd_port else 0),
            ("NATS", options.nats_port),
            ("Redis", options.redis_port),
        ):
            ports[name] = choose_port(wanted, taken)
            taken.add(ports[name])
            if wanted and ports[name] != wanted and name != "etcd peer":
                self.say(f"  port {wanted} is in use (another {name}?): {name} listens on 127.0.0.1:{ports[name]}")
        # etcd holds only what lives under leases (instances, model cards): workers register again. A fresh data
        # folder also spares etcd a stored peer address that a new peer port would contradict.
        shutil.rmtree(layout.data_dir / "etcd", ignore_errors=True)
        for folder in ("nats", "redis"):  # etcd makes its own
            (layout.data_dir / folder).mkdir(mode=0o700, exist_ok=True)
        servers = [
            etcd_server(binaries["etcd"], ports["etcd"], ports["etcd peer"], layout.data_dir / "etcd"),
            nats_server(binaries["nats-server"], ports["NATS"], layout.data_dir / "nats"),
            redis_server(binaries["redis-server"], ports["Redis"], layout.data_dir / "redis"),
        ]
        await self._start_servers(servers)
        etcd_url, nats_url, redis_url = (server.url for server in servers)
        self.urls.update(etcd=etcd_url, nats=nats_url, redis=redis_url)
        served_env = {"ETCD_ENDPOINTS": etcd_url, "NATS_SERVER": nats_url}
        control_plane_env = {
            "FLOTILLA_DATA_DIR": str(layout.data_dir),
            "FLOTILLA_BROKER_URL": redis_url,
            "DJANGO_SETTINGS_MODULE": "controlplane.settings",
            # the dashboard's overview reads the gateway's traffic from its /metrics
            "FLOTILLA_GATEWAY_URL": f"http://127.0.0.1:{options.http_port}",
            # the catalog accepts local models only under these folders: --model may be anywhere
            "FLOTILLA_LOCAL_MODEL_ROOTS": local_model_roots(layout.data_dir, options.first_model),
            # API keys: published to the gateway through etcd, signed with the data folder's secret.
            "ETCD_ENDPOINTS": etcd_url,
            "FLOTILLA_API_KEYS_SECRET_FILE": str(secret_in(layout.data_dir)),
        }
        control_plane = f"http://127.0.0.1:{options.control_plane_port}"
        admin_token = await self._start_control_plane(control_plane, control_plane_env)

        agent_argv = [sys.executable, "-m", "launcher.cli", "agent", "--control-plane", control_plane]
        agent_argv += ["--name", LOCAL_NODE, "--state-dir", str(layout.agent_state)]
        agent_argv += ["--models-dir", str(layout.data_dir / "models"), "--log-dir", str(layout.logs / "workers")]
        agent_argv += ["--broker", redis_url]
        if options.gpus:
            agent_argv += ["--gpus", options.gpus]
        agent_env = {**served_env, "FLOTILLA_AGENT_TOKEN_FILE": str(layout.data_dir / AGENT_TOKEN_FILE)}
        self._agent = self._launch(self._child(f"the agent (node {LOCAL_NODE})", "agent", agent_argv, agent_env))

        celery_argv = [sys.executable, "-m", "celery", "-A", "controlplane.celery_app", "worker"]
        celery_argv += ["-Q", f"{CONTROL_PLANE_QUEUE},{BATCHES_QUEUE}"]  # a batch slice leaves a slot for the rest
        celery_argv += ["--beat", "--schedule", str(layout.data_dir / "celerybeat-schedule")]
        celery_argv += ["--concurrency", "3", "--hostname", "controlplane@%h", "--loglevel", "INFO"]
        # The reconciler (in it) fences the workers of a lost node in etcd.
        reconciler_env = {**control_plane_env, "ETCD_ENDPOINTS": etcd_url}
        self._launch(self._child("the Celery worker and beat", "celery", celery_argv, reconciler_env))
        # The workers' load on NATS, pushed live to the dashboard's pipeline pages through Redis.
        bridge_argv = [*manage_command(), "live_bridge", "--nats", nats_url]
        self._launch(self._child("the live-update bridge", "live-bridge", bridge_argv, control_plane_env))
        # The planner's loop: plans only the pipelines given planner targets (docs/planner.md); restarted if it ends.
        planner_argv = [*manage_command(), "planner", "--nats", nats_url]
        self._launch(self._child("the planner", "planner", planner_argv, control_plane_env))

        gateway_url = f"http://127.0.0.1:{options.http_port}"
        gateway_argv = [sys.executable, "-m", "launcher.cli", "run", "in=http", "out=dyn"]
        gateway_argv += ["--http-host", "127.0.0.1", "--http-port", str(options.http_port)]
        gateway_argv += ["--control-plane", control_plane]  # /v1/files and /v1/batches are the control plane's
        # The dashboard's pages (its playground) call the API from the browser: its origin, as people open it.
        dashboard = f"http://127.0.0.1:{options.control_plane_port},http://localhost:{options.control_plane_port}"
        gateway_argv += ["--allowed-origins", dashboard]
        if options.api_keys:
            gateway_argv += ["--api-keys-secret-file", control_plane_env["FLOTILLA_API_KEYS_SECRET_FILE"]]
            gateway_argv += ["--quota-redis", redis_url]  # keys' limits shared, usage recorded
        gateway = self._launch(self._child("the gateway", "gateway", gateway_argv, served_env), answers=True)
        await self._wait_ready(
            gateway, lambda: self._http_answers(f"{gateway_url}/live", ok_only=True), SERVICE_START_S
        )
        self.say(f"  gateway        {gateway_url}/v1")
        self.urls.update(gateway=gateway_url, control_plane=control_plane)

        client = ControlPlaneClient(control_plane, admin_token)
        try:
            served = await self._first_pipeline(client)
            if served:
                await self._wait_until_served(client, gateway_url, served)
        finally:
            await client.close()
        # The dashboard's pages may not be part of this version: say so rather than print a link to a 404.
        with contextlib.suppress(httpx.HTTPError):
            self.dashboard = (await self._http.get(f"{control_plane}/")).status_code < 400
        self._banner(served)

    async def _start_servers(self, servers: list[ServerSpec]) -> None:
        children = [
            self._launch(self._child(server.name, server.log_name, server.argv), answers=True) for server in servers
        ]
        for server, child in zip(servers, children, strict=True):
            await self._wait_ready(child, server.ready, SERVER_START_S)
            self.say(f"  {server.name:<14} {server.url}")

    async def _start_control_plane(self, url: str, env: dict[str, str]) -> str:
        """Migrate, make sure of the admin and the tokens, serve. Returns the admin token ``flotilla up`` uses."""
        data_dir = self.layout.data_dir
        self.say("  control plane: applying database migrations")
        migrate = self._child("the control plane's migrations", "controlplane", [*manage_command(), "migrate"], env)
        await self._run_once(migrate)
        argv, bootstrap_env, password = bootstrap_command(data_dir, api_key=self.options.api_keys)
        bootstrap = self._child("the control plane's account bootstrap", "controlplane", argv, {**env, **bootstrap_env})
        result = parse_bootstrap(await self._run_once(bootstrap, capture=True))
        if result.admin_token is not None:
            write_secret(data_dir / ADMIN_TOKEN_FILE, result.admin_token)
        if result.agent_token is not None:
            write_secret(data_dir / AGENT_TOKEN_FILE, result.agent_token)
        if result.admin_created:
            # Shown now, once: a stack that fails later must not take the only copy with it.
            self.say(
                f"\n  Created the admin account: user {ADMIN_USERNAME!r}, password {password!r}\n"
                "  (shown only this once; log in to the dashboard and change it on your Account page, /account/)\n"
            )
        if result.api_key is not None:
            write_secret(data_dir / API_KEY_FILE, result.api_key)
            self.say(
                f"\n  Created an API key for the OpenAI endpoint: {result.api_key}\n"
                f"  (shown only this once; kept in {data_dir / API_KEY_FILE}, readable by you only)\n"
            )
        port = url.rsplit(":", 1)[1]
        uvicorn_argv = [sys.executable, "-m", "uvicorn", "controlplane.asgi:application", "--host", "127.0.0.1"]
        uvicorn_argv += ["--port", port, "--no-access-log", "--http", "controlplane.http_protocol:HeadDeadlineProtocol"]
        child = self._launch(self._child("the control plane", "controlplane", uvicorn_argv, env), answers=True)
        # Any answer will do (401 without a token): Django is serving.
        await self._wait_ready(child, lambda: self._http_answers(f"{url}/api/v1/models/"), SERVICE_START_S)
        self.say(f"  control plane  {url}/")
        # It takes its web settings from this environment (env sets none): read here the same way (a bad value
        # stopped its migrations already, with the variable named).
        if notice := development_notice(web_security()):
            self.say(notice)
        return read_secret(data_dir / ADMIN_TOKEN_FILE)

    async def _first_pipeline(self, client: ControlPlaneClient) -> list[str]:
        """Deploy the first pipeline when there is none; returns the names of the running pipelines."""
        pipelines = await client.pipelines()
        first = self.options.first_model
        if not pipelines and first is not None:
            pipelines = [await client.deploy_first_pipeline(first)]
            self.say(f"  deployed a first pipeline: {first.name} ({first.engine}, 1 replica on the CPU)")
        elif first is not None and (old := await client.repoint_first_model(first)) is not None:
            # A data folder kept from a checkout since deleted: its model's file went with that checkout's venv.
            self.say(f"  model {first.name}: {old} is gone; it is now {first.source} (its failed instances restart)")
        return [str(pipeline["name"]) for pipeline in pipelines if pipeline.get("state") == "running"]

    async def _wait_until_served(self, client: ControlPlaneClient, gateway_url: str, names: list[str]) -> None:
        """Return once the gateway serves one of ``names``, showing how far their instances are meanwhile."""
        progress = Progress(self.out)
        try:
            while not set(names) & set(await self._served_models(gateway_url)):
                try:
                    text = await client.progress(names)
                except ControlPlaneError as exc:
                    text = str(exc)
                progress.show(f"  waiting for the first instance: {text}")
                await self._pause(0.5)
        finally:
            progress.done()

    async def _served_models(self, gateway_url: str) -> list[str]:
        try:
            # /health lists them too, and needs no API key.
            response = await self._http.get(f"{gateway_url}/health")
            return [str(name) for name in response.json()["models"]]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return []

    def _banner(self, served: list[str]) -> None:
        gateway, control_plane = self.urls["gateway"], self.urls["control_plane"]
        token_file = self.layout.data_dir / ADMIN_TOKEN_FILE
        question = {"role": "user", "content": "What is the capital of France?"}
        body = json.dumps({"model": served[0] if served else "MODEL", "messages": [question]})
        lines = [
            "",
            f"Flotilla is up: {', '.join(served) or 'no pipeline running yet'}",
            f"  OpenAI API     {gateway}/v1",
            f"  dashboard      {control_plane}/" if self.dashboard else "  dashboard      (not in this version yet)",
            f"  REST API       {control_plane}/api/v1/  (docs: {control_plane}/api/v1/docs/; "
            f"admin token in {token_file})",
            f"  people         {control_plane}/people/  (user {ADMIN_USERNAME}: add people, roles, passwords)",
            f"  etcd {self.urls['etcd']}, NATS {self.urls['nats']}, Redis {self.urls['redis']}",
            f"  logs           {self.layout.logs}/",
            "",
            f"  curl {gateway}/v1/chat/completions -H 'Content-Type: application/json' \\",
            *(
                [f'    -H "Authorization: Bearer $(cat {self.layout.data_dir / API_KEY_FILE})" \\']
                if self.options.api_keys
                else []
            ),
            f"    -d '{body}'",
            f'  curl -H "Authorization: Bearer $(cat {token_file})" {control_plane}/api/v1/pipelines/',
            "",
            "Ctrl-C stops everything.",
        ]
        self.say("\n".join(lines))

    # -- stopping ------------------------------------------------------------------------------------------

    async def _stop_all(self) -> None:
        """Stop every child, last started first; the engine workers right after the agent that ran them."""
        self._stopping = True  # an end from now on is asked for: no restart
        for task in list(self._restarts):
            task.cancel()
        await asyncio.gather(*self._restarts, return_exceptions=True)
        for child in list(self._one_shot):
            await child.stop(STOP_S, hurry=self._hurry)
        for child in reversed(self.children):
            await child.stop(STOP_S, hurry=self._hurry)
            if child is self._agent:
                await self._stop_engine_workers("")

    async def _stop_engine_workers(self, why: str) -> None:
        """Stop the workers the agent left running (its worker records say which): SIGTERM, then SIGKILL."""
        workers = []
        for record in load_records(self.layout.agent_state):
            process = WorkerProcess.adopt(record.pid, record.start_time, record.boot_id)
            if process is not None:
                process.terminate()
                workers.append(process)
        if not workers:
            return
        self.say(f"stopping {len(workers)} engine worker(s){' ' + why if why else ''}")
        waits = [asyncio.ensure_future(worker.wait()) for worker in workers]
        hurry = asyncio.ensure_future(self._hurry.wait())
        try:
            everyone: asyncio.Future[Any] = asyncio.gather(*waits)
            await asyncio.wait({everyone, hurry}, timeout=WORKER_STOP_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hurry.cancel()
        for worker, wait in zip(workers, waits, strict=True):
            if not wait.done():
                worker.kill()
        await asyncio.gather(*waits)
