"""API automation against the default stack (issue 39): mutating REST calls at a steady rate for minutes.

Starts the stack exactly as a person does, ``flotilla up --no-pipeline`` (etcd, NATS, Redis, the control
plane under uvicorn on SQLite, the Celery worker with beat (the reconciler), the live-update bridge, the
planner, the agent of node ``local`` and the gateway), in a fresh data folder on free ports; with
``--postgres`` a throwaway PostgreSQL 15 (tests/controlplane/postgres.py) is its ``DATABASE_URL``. Then,
as the admin (the token ``flotilla up`` keeps in the data folder):

1. deploys ``--running`` pipelines of the echo engine on the CPU (real workers, left alone: the agent
   heartbeats and reports, the bridge and the reconciler have something to do);
2. sends ``--rate`` mutating calls a second for ``--duration-s`` seconds, open loop (each call is sent on
   time whatever the earlier ones take): models created, changed, deleted; pipelines deployed, scaled,
   changed, stopped, started, deleted (of models too large for the machine, so that no worker is started for
   them: the control plane's work, not the engines', is measured); API keys created and revoked; and about
   ``--malformed`` of the calls malformed (bad JSON, wrong types, unknown ids, a client that gives up
   before its answer).

Afterwards it reads the stack's logs: reconciler passes that failed (a Celery task that raised, "database is
locked"), change notices the publisher dropped, errors the ASGI server logged ("Exception in ASGI
application"), and prints the latency of the calls (p50, p99, max; the well-formed ones), their answers by
status class, and a verdict against the floor of issue 39: 0 reconciler failures, API p99 < 1 s, 0 dropped
notices, no server error. Exit code 1 when the floor is not met. The raw numbers go to
bench/results/api_automation.json.

    .venv/bin/python bench/api_automation.py [--rate 20] [--duration-s 300] [--running 1] [--postgres]
        [--malformed 0.05] [--seed 1] [--keep DIR]

``--duration-s 30`` is a smoke test; tests/bench/test_bench_smoke.py runs it shorter still.
"""

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _common import RESULTS_DIR, cpu_seconds, free_port, percentile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the PostgreSQL helper and the bundled model's path come from the tree
FLOOR_P99_S = 1.0
REQUEST_TIMEOUT_S = 30.0
#: Seconds ``flotilla up`` has to bring the stack up (migrations, five servers, the agent's registration).
UP_TIMEOUT_S = 240.0
#: Models and pipelines kept at most, so the lists the calls read do not grow for the whole run.
MAX_MODELS = 20
MAX_PIPELINES = 40
MAX_KEYS = 40
#: A churned pipeline's model asks more memory than any machine has: it is never placed, no worker starts.
UNPLACEABLE_BYTES = 1 << 50
#: How long a "client that gives up" waits for its answer.
IMPATIENT_TIMEOUT_S = 0.002
TIMELINE_S = 10.0
_DROPPED = re.compile(r"(\d+) change notice\(s\) dropped")
_HELD = re.compile(r"and (\d+) more like it")


@dataclass(frozen=True)
class Sample:
    name: str
    sent_at: float  # seconds since the load began
    seconds: float
    status: int  # 0: no answer (transport error, timeout, or a client that gave up on purpose)
    malformed: bool
    detail: str = ""


@dataclass
class World:
    """What the bench made and believes the state is (the answers keep it true)."""

    models: dict[int, str] = field(default_factory=dict)  # id -> name, of the churned models
    pipelines: dict[int, str] = field(default_factory=dict)  # id -> "running" | "stopped"
    pipeline_models: dict[int, int] = field(default_factory=dict)
    keys: list[int] = field(default_factory=list)
    busy: set[int] = field(default_factory=set)  # pipelines with a call in flight
    serial: int = 0

    def name(self, prefix: str) -> str:
        self.serial += 1
        return f"{prefix}-{self.serial}"


# --- the stack --------------------------------------------------------------------------------------------


@dataclass
class Stack:
    process: subprocess.Popen[bytes]
    data_dir: Path
    control_plane: str
    log_path: Path

    @property
    def logs(self) -> Path:
        return self.data_dir / "logs"

    def token(self) -> str:
        return (self.data_dir / "admin.token").read_text().strip()

    def stop(self) -> None:
        """SIGTERM ``flotilla up`` (it stops its parts in order), SIGKILL its group if it takes too long."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@contextlib.contextmanager
def flotilla_up(data_dir: Path, database_url: str | None, *, http_port: int | None = None) -> Iterator[Stack]:
    """``flotilla up --no-pipeline`` in ``data_dir`` on free ports (the gateway on ``http_port`` if given);
    yields once its control plane answers and a reconciler pass has been recorded. Raises RuntimeError with
    the log's tail when it does not come up."""
    control_plane_port = free_port()
    argv = [sys.executable, "-m", "launcher.cli", "up", "--no-pipeline", "--data-dir", str(data_dir)]
    argv += ["--http-port", str(http_port or free_port()), "--control-plane-port", str(control_plane_port)]
    argv += ["--etcd-port", "0", "--nats-port", "0", "--redis-port", "0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if database_url:
        env["DATABASE_URL"] = database_url
    log_path = data_dir / "flotilla-up.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    stack = Stack(process, data_dir, f"http://127.0.0.1:{control_plane_port}", log_path)
    try:
        wait_up(stack)
        yield stack
    finally:
        stack.stop()


def wait_up(stack: Stack) -> None:
    deadline = time.monotonic() + UP_TIMEOUT_S
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if stack.process.poll() is not None:
                raise RuntimeError(f"flotilla up exited ({stack.process.returncode}):\n{tail(stack.log_path)}")
            # The banner comes last: every part is up.
            if "Flotilla is up" in stack.log_path.read_text(errors="replace"):
                with contextlib.suppress(httpx.HTTPError):
                    health = client.get(f"{stack.control_plane}/api/v1/health/")
                    if health.status_code == 200:
                        return
            time.sleep(0.5)  # another process's start-up: nothing to await
    raise RuntimeError(f"flotilla up did not come up in {UP_TIMEOUT_S:g} s:\n{tail(stack.log_path)}")


def stack_cpu_s(root: int) -> float:
    """CPU seconds used so far by ``root``'s descendants that are still running (the stack's parts and the
    engine workers; ``flotilla up`` itself is left out)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    total = 0.0
    for pid in found:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


def tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


# --- the calls --------------------------------------------------------------------------------------------


def echo_model_body(name: str, memory_bytes: int) -> dict[str, Any]:
    from runtime.models.source import default_model_path

    # The echo engine reads no weights; the bundled GGUF is a source the catalog accepts (flotilla up allows
    # its folder) and gives the tokenizer.
    return {
        "name": name,
        "source_kind": "gguf",
        "source": str(default_model_path()),
        "engine": "echo_full",
        "memory_bytes": memory_bytes,
    }


def pipeline_body(name: str, model: str, replicas: int) -> dict[str, Any]:
    return {
        "name": name,
        "model": model,
        "groups": [{"engine": "echo_full", "replicas": replicas, "gpus_per_replica": 0}],
    }


async def call(
    client: httpx.AsyncClient,
    name: str,
    method: str,
    path: str,
    began: float,
    *,
    body: Any = None,
    content: bytes | None = None,
    malformed: bool = False,
    give_up_s: float | None = None,
) -> tuple[Sample, Any]:
    """Send one call; its sample and its JSON answer (None when there is none)."""
    start = time.perf_counter()
    extra: dict[str, Any] = {} if give_up_s is None else {"timeout": give_up_s}
    try:
        if content is not None:
            response = await client.request(
                method, path, content=content, headers={"Content-Type": "application/json"}, **extra
            )
        else:
            response = await client.request(method, path, json=body, **extra)
    except httpx.HTTPError as exc:
        return Sample(name, start - began, time.perf_counter() - start, 0, malformed, f"{type(exc).__name__}"), None
    seconds = time.perf_counter() - start
    try:
        answer = response.json()
    except ValueError:
        answer = None
    detail = "" if response.is_success else response.text[:200]
    return Sample(name, start - began, seconds, response.status_code, malformed, detail), answer


class Mix:
    """Chooses and sends the next call from what exists (``World``)."""

    def __init__(self, client: httpx.AsyncClient, world: World, rng: random.Random, malformed: float) -> None:
        self.client, self.world, self.rng, self.malformed = client, world, rng, malformed
        self.began = time.perf_counter()

    async def one(self) -> Sample:
        if self.rng.random() < self.malformed:
            return await self.bad()
        world, rng = self.world, self.rng
        choices: list[tuple[str, float]] = [("model.update", 1.0), ("key.create", 1.0)]
        if len(world.models) < MAX_MODELS:
            choices.append(("model.create", 1.0))
        if world.models and len(world.pipelines) < MAX_PIPELINES:
            choices.append(("pipeline.create", 2.0))
        if self._idle_pipelines("running"):
            choices += [("pipeline.scale", 3.0), ("pipeline.update", 2.0), ("pipeline.stop", 2.0)]
        if self._idle_pipelines("stopped"):
            choices += [("pipeline.start", 1.5), ("pipeline.delete", 1.0)]
        if world.keys:
            choices.append(("key.revoke", 1.0))
        if [m for m in world.models if m not in world.pipeline_models.values()]:
            choices.append(("model.delete", 0.5))
        names, weights = zip(*choices, strict=True)
        kind = rng.choices(names, weights)[0]
        return await getattr(self, kind.replace(".", "_"))()

    def _idle_pipelines(self, state: str) -> list[int]:
        return [pk for pk, now in self.world.pipelines.items() if now == state and pk not in self.world.busy]

    async def send(self, name: str, method: str, path: str, body: Any = None) -> tuple[Sample, Any]:
        return await call(self.client, name, method, path, self.began, body=body)

    async def model_create(self) -> Sample:
        name = self.world.name("churn-model")
        sample, answer = await self.send("model.create", "POST", "models/", echo_model_body(name, UNPLACEABLE_BYTES))
        if sample.status == 201:
            self.world.models[answer["id"]] = name
        return sample

    async def model_update(self) -> Sample:
        if not self.world.models:
            return await self.key_create()
        pk = self.rng.choice(list(self.world.models))
        body = {"default_engine_args": {"bench_serial": self.world.serial}}
        self.world.serial += 1
        sample, _ = await self.send("model.update", "PATCH", f"models/{pk}/", body)
        return sample

    async def model_delete(self) -> Sample:
        free = [m for m in self.world.models if m not in self.world.pipeline_models.values()]
        pk = self.rng.choice(free)
        name = self.world.models.pop(pk)
        sample, _ = await self.send("model.delete", "DELETE", f"models/{pk}/")
        if sample.status not in (204, 404):
            self.world.models[pk] = name
        return sample

    async def pipeline_create(self) -> Sample:
        model_id = self.rng.choice(list(self.world.models))
        body = pipeline_body(self.world.name("churn"), self.world.models[model_id], self.rng.randint(1, 2))
        sample, answer = await self.send("pipeline.create", "POST", "pipelines/", body)
        if sample.status == 201:
            self.world.pipelines[answer["id"]] = "running"
            self.world.pipeline_models[answer["id"]] = model_id
        return sample

    async def _on_pipeline(self, state: str, name: str, method: str, suffix: str, body: Any = None) -> Sample:
        pk = self.rng.choice(self._idle_pipelines(state))
        self.world.busy.add(pk)
        try:
            sample, _ = await self.send(name, method, f"pipelines/{pk}/{suffix}", body)
        finally:
            self.world.busy.discard(pk)
        if sample.status in (200, 204):
            if name == "pipeline.stop":
                self.world.pipelines[pk] = "stopped"
            elif name == "pipeline.start":
                self.world.pipelines[pk] = "running"
            elif name == "pipeline.delete":
                del self.world.pipelines[pk]
                del self.world.pipeline_models[pk]
        return sample

    async def pipeline_scale(self) -> Sample:
        return await self._on_pipeline(
            "running", "pipeline.scale", "POST", "scale/", {"replicas": self.rng.randint(0, 3)}
        )

    async def pipeline_update(self) -> Sample:
        mode = self.rng.choice(["round_robin", "random", "kv"])
        return await self._on_pipeline("running", "pipeline.update", "PATCH", "", {"router": {"mode": mode}})

    async def pipeline_stop(self) -> Sample:
        return await self._on_pipeline("running", "pipeline.stop", "POST", "stop/")

    async def pipeline_start(self) -> Sample:
        return await self._on_pipeline("stopped", "pipeline.start", "POST", "start/")

    async def pipeline_delete(self) -> Sample:
        return await self._on_pipeline("stopped", "pipeline.delete", "DELETE", "")

    async def key_create(self) -> Sample:
        sample, answer = await self.send("key.create", "POST", "api-keys/", {"name": self.world.name("bench-key")})
        if sample.status == 201:
            self.world.keys.append(answer["id"])
            if len(self.world.keys) > MAX_KEYS:
                self.world.keys.pop(0)
        return sample

    async def key_revoke(self) -> Sample:
        pk = self.world.keys.pop(self.rng.randrange(len(self.world.keys)))
        sample, _ = await self.send("key.revoke", "POST", f"api-keys/{pk}/revoke/")
        return sample

    async def bad(self) -> Sample:
        """A malformed call, as a schema fuzzer sends them: each must be a 4xx (or, for the client that gives up
        before its answer, nothing), never a 5xx."""
        kind = self.rng.randrange(7)
        began = self.began
        if kind == 0:
            sample, _ = await call(
                self.client, "bad.json", "POST", "pipelines/", began, content=b'{"name": ', malformed=True
            )
        elif kind == 1:
            body = {"name": 7, "model": [], "groups": "many"}
            sample, _ = await call(self.client, "bad.types", "POST", "pipelines/", began, body=body, malformed=True)
        elif kind == 2:
            body = {"replicas": 10**9}
            sample, _ = await call(
                self.client, "bad.scale", "POST", "pipelines/0/scale/", began, body=body, malformed=True
            )
        elif kind == 3:
            body = {"router": {"mode": "nonsense"}, "name": "fixed"}
            pk = next(iter(self.world.pipelines), 0)
            sample, _ = await call(
                self.client, "bad.update", "PATCH", f"pipelines/{pk}/", began, body=body, malformed=True
            )
        elif kind == 4:
            sample, _ = await call(self.client, "bad.path", "POST", "pipelines/%00/stop/", began, malformed=True)
        elif kind == 5:
            body = {"name": "", "expires_at": "yesterday", "allowed_models": [None]}
            sample, _ = await call(self.client, "bad.key", "POST", "api-keys/", began, body=body, malformed=True)
        else:
            # A client that gives up at once (a fuzzer's timeout): its request may still be waiting for a thread
            # when it leaves.
            sample, _ = await call(
                self.client, "gave.up", "GET", "pipelines/", began, malformed=True, give_up_s=IMPATIENT_TIMEOUT_S
            )
        return sample


async def setup(client: httpx.AsyncClient, world: World, running: int) -> None:
    """The running pipelines (real echo workers), and a few models to churn pipelines of."""
    for number in range(running):
        name = f"running-{number}"
        answer = (await client.post("models/", json=echo_model_body(name, 64 << 20))).raise_for_status().json()
        (await client.post("pipelines/", json=pipeline_body(name, answer["name"], 1))).raise_for_status()
    for _ in range(4):
        name = world.name("churn-model")
        answer = (await client.post("models/", json=echo_model_body(name, UNPLACEABLE_BYTES))).raise_for_status().json()
        world.models[answer["id"]] = name


async def load(stack: Stack, args: argparse.Namespace) -> tuple[list[Sample], float]:
    """Send the calls; returns the samples and the seconds the load lasted."""
    rng = random.Random(args.seed)
    world = World()
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    headers = {"Authorization": f"Bearer {stack.token()}"}
    async with httpx.AsyncClient(
        base_url=f"{stack.control_plane}/api/v1/", headers=headers, timeout=REQUEST_TIMEOUT_S, limits=limits
    ) as client:
        await setup(client, world, args.running)
        mix = Mix(client, world, rng, args.malformed)
        tasks: list[asyncio.Task[Sample]] = []
        interval = 1.0 / args.rate
        start = time.perf_counter()
        mix.began = start
        total = int(args.duration_s * args.rate)
        for number in range(total):
            due = start + number * interval
            if (wait := due - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(mix.one()))
        samples = list(await asyncio.gather(*tasks))
        return samples, time.perf_counter() - start


# --- what the logs say ------------------------------------------------------------------------------------


@dataclass
class LogCounts:
    reconciler_failures: int = 0
    database_locked: int = 0
    dropped_notices: int = 0
    drop_reports: int = 0
    asgi_errors: int = 0
    lines: list[str] = field(default_factory=list)  # a few examples


def read_logs(logs: Path) -> LogCounts:
    counts = LogCounts()
    for path in sorted(logs.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            interesting = False
            if "database is locked" in line:
                counts.database_locked += 1
                interesting = True
            if path.name == "celery.log" and re.search(r"Task \S*reconcile\S* \S+ raised unexpected", line):
                counts.reconciler_failures += 1
                interesting = True
            if (match := _DROPPED.search(line)) is not None:
                counts.dropped_notices += int(match.group(1))
                counts.drop_reports += 1 + (int(held.group(1)) if (held := _HELD.search(line)) else 0)
                interesting = True
            if "Exception in ASGI application" in line:
                counts.asgi_errors += 1
                interesting = True
            if interesting and len(counts.lines) < 12:
                counts.lines.append(f"{path.name}: {line[:300]}")
    return counts


# --- the report -------------------------------------------------------------------------------------------


def report(
    samples: list[Sample], seconds: float, counts: LogCounts, args: argparse.Namespace, stack_cpu: float
) -> bool:
    wellformed = [s for s in samples if not s.malformed]
    latencies = [s.seconds for s in wellformed if s.status]
    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    statuses = Counter(f"{s.status // 100}xx" if s.status else "no answer" for s in wellformed)
    bad_statuses = Counter(f"{s.status // 100}xx" if s.status else "no answer" for s in samples if s.malformed)
    server_errors = [s for s in samples if s.status >= 500 or (s.status == 0 and s.name != "gave.up")]
    print(
        f"api_automation: {len(samples)} calls in {seconds:.1f} s "
        f"({len(samples) / seconds:.1f}/s asked {args.rate:g}/s)"
    )
    print(
        f"  well-formed: {len(wellformed)}, answers {dict(statuses)}; malformed: {len(samples) - len(wellformed)}, "
        f"answers {dict(bad_statuses)}"
    )
    print(
        f"  latency of the well-formed calls: p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
        f"max {max(latencies) * 1000:.1f} ms"
    )
    by_name: dict[str, list[float]] = {}
    for sample in wellformed:
        if sample.status:
            by_name.setdefault(sample.name, []).append(sample.seconds)
    for name, values in sorted(by_name.items()):
        p50_ms, p99_ms = percentile(values, 50) * 1000, percentile(values, 99) * 1000
        print(f"    {name:<16} n={len(values):<5} p50 {p50_ms:7.1f} ms  p99 {p99_ms:8.1f} ms")
    print("  p99 per window of the load:")
    windows: dict[int, list[float]] = {}
    for sample in wellformed:
        if sample.status:
            windows.setdefault(int(sample.sent_at // TIMELINE_S), []).append(sample.seconds)
    print("    " + " ".join(f"{percentile(values, 99) * 1000:.0f}" for _, values in sorted(windows.items())) + " ms")
    for sample in server_errors[:10]:
        print(f"  server error: {sample.name} {sample.status} {sample.detail}")
    print(
        f"  the stack's CPU during the load: {stack_cpu:.2f} cores "
        f"(of {os.cpu_count()}; load average {os.getloadavg()[0]:.1f})"
    )
    print(f"  reconciler failures: {counts.reconciler_failures}; 'database is locked' lines: {counts.database_locked}")
    print(f"  change notices dropped: {counts.dropped_notices} (in {counts.drop_reports} reports)")
    print(f"  ASGI errors logged: {counts.asgi_errors}")
    for line in counts.lines:
        print(f"    {line}")
    met = (
        counts.reconciler_failures == 0
        and counts.database_locked == 0
        and counts.dropped_notices == 0
        and counts.drop_reports == 0
        and counts.asgi_errors == 0
        and not server_errors
        and p99 < FLOOR_P99_S
    )
    verdict = "met" if met else "NOT met"
    print(f"floor (issue 39: 0 reconciler failures, p99 < {FLOOR_P99_S:g} s, 0 dropped notices, no 5xx): {verdict}")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "api_automation.json").write_text(
        json.dumps(
            {
                "args": vars(args),
                "seconds": seconds,
                "p50_s": p50,
                "p99_s": p99,
                "stack_cpu_cores": stack_cpu,
                "statuses": dict(statuses),
                "malformed_statuses": dict(bad_statuses),
                "server_errors": len(server_errors),
                "reconciler_failures": counts.reconciler_failures,
                "database_locked": counts.database_locked,
                "dropped_notices": counts.dropped_notices,
                "asgi_errors": counts.asgi_errors,
                "floor_met": met,
            },
            indent=2,
            default=str,
        )
    )
    return met


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=20.0, help="mutating calls per second (20)")
    parser.add_argument("--duration-s", type=float, default=300.0, help="seconds of load (300)")
    parser.add_argument("--running", type=int, default=1, help="pipelines of real echo workers, left alone (1)")
    parser.add_argument("--malformed", type=float, default=0.05, help="share of malformed calls (0.05)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--postgres", action="store_true", help="a throwaway PostgreSQL 15 instead of SQLite")
    parser.add_argument("--keep", type=Path, help="use this data folder and keep it (logs, database)")
    args = parser.parse_args()
    with contextlib.ExitStack() as exits:
        database_url = None
        if args.postgres:
            from tests.controlplane import postgres

            if not postgres.available():
                raise SystemExit("--postgres: PostgreSQL 15 is not installed (make system-deps installs it)")
            database_url = exits.enter_context(postgres.PostgresServer()).url
        if args.keep is not None:
            data_dir = args.keep.absolute()
        else:
            data_dir = Path(exits.enter_context(tempfile.TemporaryDirectory(prefix="flotilla-api-automation-")))
        stack = exits.enter_context(flotilla_up(data_dir, database_url))
        print(f"api_automation: the stack is up ({stack.control_plane}, logs in {stack.logs}/)", flush=True)
        cpu_before = stack_cpu_s(stack.process.pid)
        samples, seconds = asyncio.run(load(stack, args))
        stack_cpu = (stack_cpu_s(stack.process.pid) - cpu_before) / seconds
        time.sleep(2.0)  # the last notices and passes reach the logs
        counts = read_logs(stack.logs)
    met = report(samples, seconds, counts, args, stack_cpu)
    sys.exit(0 if met else 1)


if __name__ == "__main__":
    main()
