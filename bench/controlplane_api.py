"""Control-plane API latency while a fleet of simulated agents heartbeats (issue 8).

Brings up the real control plane (``uvicorn controlplane.asgi:application``) on a free loopback port
with a fresh data directory and database: SQLite by default, ``--database-url postgresql://…`` for a
server of yours (its database must be empty: it is migrated), or ``--postgres`` for a throwaway
PostgreSQL 15 started here (as tests/controlplane does); and a redis-server as Celery's broker, since
actions ask for a reconciler pass through it (no reconciler or Celery worker runs). uvicorn keeps idle
connections for 3 intervals (``keep_alive_seconds``). Then:

1. migrates, and creates ``--nodes`` agent tokens and an operator's token (in this process, through
   the control plane's own actions: faster than a ``manage.py createtoken`` per node);
2. every simulated agent (one httpx client each) registers its node with ``--gpus`` GPUs;
3. deploys a few pipelines over the fleet and places their instances, so lists are not empty;
4. baseline: the operator's calls alone for ``--baseline`` seconds (no heartbeats);
5. load: the same calls for ``--duration`` seconds while every agent heartbeats every ``--interval``
   seconds, phases staggered evenly, with its inventory (GPU memory and utilisation change each time).

The operator's calls are the ones people make (node, pipeline, instance, model and audit lists, a
node's and a pipeline's detail, a scale call), one every ``1/--rate`` seconds whatever the answers
take (open loop). Latency is taken from sending a request to reading its whole answer.

    .venv/bin/python bench/controlplane_api.py [--duration 60] [--baseline 20] [--nodes 200]
        [--interval 5] [--rate 10] [--gpus 8] [--workers 1] [--postgres | --database-url URL]
        [--profile FILE] [--log FILE]

Prints p50/p99/max of the operator's calls (without and with the heartbeats, and the ratio) and of
the heartbeats, per call and per 5 s window, every non-2xx answer, the CPU the server and this load
generator used, and writes bench/results/controlplane_api.json. ``--profile FILE`` samples the server
with py-spy during the loaded phase. Floor (issue 8): operator p99 <= 100 ms under the heartbeats.
"""

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import secrets
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvloop
from _common import RESULTS_DIR, ServerProcess, free_port, percentile, running_server

ROOT = Path(__file__).resolve().parent.parent
RESULTS = RESULTS_DIR
# The control plane's modules, and the servers the tests start (PostgreSQL, Redis), come from the tree.
sys.path.insert(0, str(ROOT))
FLOOR_P99_MS = 100.0
GiB = 1 << 30
GPU_MEMORY_BYTES = 80 * GiB
REQUEST_TIMEOUT_S = 30.0
# At most this many agents register at once: registration is a burst of writes, not what is measured.
REGISTER_CONCURRENCY = 16
# Non-2xx answers printed in full; the rest are only counted.
ERRORS_SHOWN = 20
# The heartbeating phase is also reported per window of WINDOW_S seconds (at most MAX_WINDOWS of them).
WINDOW_S = 5.0
MAX_WINDOWS = 12
# Kinds of call in one cycle of operator_calls.
CALL_KINDS = 10
_TICKS = os.sysconf("SC_CLK_TCK")
_HTML_TITLE = re.compile(r"<title>(.*?)</title>", re.IGNORECASE | re.DOTALL)


@dataclass(frozen=True)
class Call:
    """One API call: ``name`` groups it in the report."""

    name: str
    method: str
    path: str
    body: dict[str, Any] | None = None


@dataclass(frozen=True)
class Sample:
    name: str
    sent_at: float  # time.perf_counter() when it was sent
    seconds: float
    status: int  # 0: no answer (transport error or timeout)
    detail: str = ""  # for a failure: the answer's start or the exception

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


@dataclass(frozen=True)
class Fleet:
    """What the database was prepared with: node names with their agent tokens, the operator's token."""

    agent_tokens: dict[str, str]
    operator_token: str


@dataclass
class Phase:
    """What one phase measured."""

    name: str
    seconds: float
    started: float = field(default_factory=time.perf_counter)
    operator: list[Sample] = field(default_factory=list)
    heartbeats: list[Sample] = field(default_factory=list)
    late_heartbeats: int = 0  # sent later than due because the agent's previous one had not returned
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0  # this process's: the load generator shares the machine's cores


# The database, prepared in this process through the control plane's own actions.


def setup_django(env: dict[str, str]) -> None:
    """Point this process's Django at the benchmark's data directory and database, and set it up."""
    os.environ.update(env)
    import django

    django.setup()


def prepare_database(nodes: int) -> Fleet:
    """Migrate, then create one agent token per node and an operator (with a token)."""
    from django.core.management import call_command
    from django.db import connections, transaction

    from controlplane.accounts import actions
    from controlplane.accounts.models import Role
    from controlplane.audit.records import Actor

    call_command("migrate", verbosity=0, interactive=False)
    actor = Actor.system("bench")
    with transaction.atomic():
        tokens = {name: actions.create_agent_token(actor, name)[1] for name in node_names(nodes)}
        operator = actions.create_user(actor, "bench-operator", Role.OPERATOR)
        _, operator_token = actions.create_person_token(actor, operator, "bench/controlplane_api.py")
    connections.close_all()
    return Fleet(tokens, operator_token)


def deploy_pipelines(nodes: int, gpus: int) -> list[int]:
    """A few models and pipelines over the registered fleet, their instances placed; returns pipeline ids.

    Replica counts grow with the fleet (about one GPU in eight is used), so that instance lists have
    pages to read whatever ``--nodes`` is.
    """
    from django.db import connections

    from controlplane.audit.records import Actor
    from controlplane.catalog import actions as catalog
    from controlplane.catalog.models import LanguageModel
    from controlplane.deployments import pipelines as pipeline_actions
    from controlplane.deployments import upkeep
    from controlplane.deployments.pipelines import GroupSpec

    actor = Actor.system("bench")
    shapes = [  # (name, memory need, GPUs per replica, share of the fleet's GPUs)
        ("llama-3-8b", 18 * GiB, 1, 0.05),
        ("qwen-2-5-32b", 70 * GiB, 2, 0.04),
        ("llama-3-70b", 150 * GiB, 4, 0.03),
        ("mistral-7b", 16 * GiB, 1, 0.01),
    ]
    ids = []
    for name, memory, per_replica, share in shapes:
        model = catalog.create_model(
            actor,
            name=name,
            source_kind=LanguageModel.SourceKind.HUGGING_FACE,
            source=f"bench/{name}",
            engine="mocker",
            memory_bytes=memory,
        )
        replicas = max(1, int(nodes * gpus * share / (per_replica if gpus else 1)))
        pipeline = pipeline_actions.deploy_pipeline(
            actor,
            name=name,
            model=model,
            groups=[GroupSpec(replicas=replicas, gpus_per_replica=per_replica if gpus else 0)],
        )
        ids.append(pipeline.pk)
    upkeep.place_pending_instances(actor)
    connections.close_all()
    return ids


def node_names(nodes: int) -> list[str]:
    return [f"gpu-{number:04d}" for number in range(nodes)]


# The simulated agents.


def inventory(name: str, number: int, gpus: int, rng: random.Random, *, registering: bool = False) -> dict[str, Any]:
    """A node's report as an agent sends it; GPU memory in use and utilisation move every time."""
    report: dict[str, Any] = {
        "address": f"10.{number // 250}.{number % 250}.10",
        "labels": {"zone": f"zone-{number % 4}", "rack": f"r{number // 16:03d}"},
        "cpu_count": 128,
        "memory_total_bytes": 1024 * GiB,
        "memory_available_bytes": rng.randrange(600, 1000) * GiB,
        "agent_version": "0.1.0",
        "gpus": [
            {
                "index": index,
                "name": "NVIDIA H100 80GB HBM3",
                "memory_total_bytes": GPU_MEMORY_BYTES,
                "memory_used_bytes": rng.randrange(0, GPU_MEMORY_BYTES, 1 << 20),
                "utilization_percent": rng.randrange(0, 101),
            }
            for index in range(gpus)
        ],
    }
    if registering:
        report["name"] = name
    return report


async def timed(client: httpx.AsyncClient, call: Call) -> Sample:
    """Send ``call``; its latency from sending to the end of the answer, and what went wrong if anything."""
    start = time.perf_counter()
    try:
        response = await client.request(call.method, call.path, json=call.body)
    except httpx.HTTPError as exc:
        return Sample(call.name, start, time.perf_counter() - start, 0, f"{type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - start
    detail = "" if response.is_success else answer_summary(response.text)
    return Sample(call.name, start, seconds, response.status_code, detail)


def answer_summary(text: str) -> str:
    """A failed answer in one short line: an HTML page's title (Django's 500 page), else the text's start."""
    title = _HTML_TITLE.search(text)
    return title.group(1).strip() if title else " ".join(text.split())[:200]


def agent_client(base_url: str, token: str) -> httpx.AsyncClient:
    # One connection per agent, kept alive between heartbeats, as one agent process would have.
    return httpx.AsyncClient(
        base_url=base_url,
        headers={"Authorization": f"Bearer {token}"},
        timeout=REQUEST_TIMEOUT_S,
        limits=httpx.Limits(max_connections=1),
    )


async def register_all(base_url: str, fleet: Fleet, gpus: int) -> list[Sample]:
    """Every agent registers its node (a few at a time); returns the failed registrations."""
    gate = asyncio.Semaphore(REGISTER_CONCURRENCY)

    async def register(number: int, name: str, token: str) -> Sample:
        body = inventory(name, number, gpus, random.Random(number), registering=True)
        async with gate, agent_client(base_url, token) as client:
            return await timed(client, Call("register", "POST", "/api/v1/agent/register/", body))

    samples = await asyncio.gather(
        *(register(number, name, token) for number, (name, token) in enumerate(fleet.agent_tokens.items()))
    )
    return [sample for sample in samples if not sample.ok]


async def heartbeat_loop(
    client: httpx.AsyncClient, name: str, number: int, gpus: int, first_due: float, interval: float, end: float
) -> tuple[list[Sample], int]:
    """One agent: a heartbeat at ``first_due`` and every ``interval`` after it until ``end`` (loop time).

    Like a real agent it waits for each answer before the next heartbeat; one that comes due while the
    previous is still out is sent late and counted. Returns the samples and the late count.
    """
    loop = asyncio.get_running_loop()
    rng = random.Random(number)
    samples: list[Sample] = []
    late = 0
    due = first_due
    while due < end:
        wait = due - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)  # pacing to a schedule, not waiting for an event
        call = Call("heartbeat", "POST", "/api/v1/agent/heartbeat/", inventory(name, number, gpus, rng))
        samples.append(await timed(client, call))
        due += interval
        if loop.time() > due:
            late += 1
    return samples, late


def operator_calls(node_ids: Sequence[int], pipeline_ids: Sequence[int], nodes: int) -> Iterator[Call]:
    """The operator's calls, cycled forever: mostly reads, one scale call in ten."""
    rng = random.Random(0)
    pages = max(1, (nodes + 49) // 50)
    cycle = 0
    while True:
        node = rng.choice(node_ids)
        pipeline = rng.choice(pipeline_ids)
        yield Call("nodes list", "GET", f"/api/v1/nodes/?page={rng.randrange(pages) + 1}")
        yield Call("node detail", "GET", f"/api/v1/nodes/{node}/")
        yield Call("pipelines list", "GET", "/api/v1/pipelines/")
        yield Call("instances list", "GET", "/api/v1/instances/")
        yield Call("audit list", "GET", "/api/v1/audit/")
        yield Call("nodes by label", "GET", f"/api/v1/nodes/?state=online&label=zone=zone-{cycle % 4}")
        yield Call("node's instances", "GET", f"/api/v1/instances/?node=gpu-{rng.randrange(nodes):04d}")
        yield Call("models list", "GET", "/api/v1/models/")
        yield Call("pipeline detail", "GET", f"/api/v1/pipelines/{pipeline}/")
        # Up and down by one around the deployed count: each call adds or stops an instance.
        replicas_now = 4 + cycle % 2
        yield Call("scale", "POST", f"/api/v1/pipelines/{pipeline_ids[-1]}/scale/", {"replicas": replicas_now})
        cycle += 1


async def operator_load(client: httpx.AsyncClient, calls: Iterator[Call], rate: float, seconds: float) -> list[Sample]:
    """Send the next call every ``1/rate`` s for ``seconds`` (open loop); returns every call's sample."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = []
    for sent in range(int(seconds * rate)):
        wait = start + sent / rate - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)  # pacing to a schedule, not waiting for an event
        tasks.append(asyncio.create_task(timed(client, next(calls))))
    return list(await asyncio.gather(*tasks))


def operator_client(base_url: str, token: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=REQUEST_TIMEOUT_S)


async def node_ids(base_url: str, token: str, nodes: int) -> list[int]:
    """The ids of the registered nodes, read through the API."""
    ids: list[int] = []
    async with operator_client(base_url, token) as client:
        for page in range(1, (nodes + 499) // 500 + 1):
            response = await client.get("/api/v1/nodes/", params={"page": page, "page_size": 500})
            response.raise_for_status()
            ids.extend(node["id"] for node in response.json()["results"])
    return ids


async def run_phase(
    name: str,
    server: ServerProcess,
    fleet: Fleet,
    calls: Iterator[Call],
    args: argparse.Namespace,
    *,
    seconds: float,
    heartbeats: bool,
) -> Phase:
    """The operator's calls for ``seconds``, with every agent heartbeating when ``heartbeats``."""
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as stack:
        operator = await stack.enter_async_context(operator_client(server.base_url, fleet.operator_token))
        # Every client exists before the clock starts: making 200 of them takes seconds.
        agents = [
            (number, node, await stack.enter_async_context(agent_client(server.base_url, token)))
            for number, (node, token) in enumerate(fleet.agent_tokens.items())
            if heartbeats
        ]
        if heartbeats and args.profile:
            await stack.enter_async_context(profiling(server.process.pid, args.profile, seconds))
        cpu_before = group_cpu_seconds(server.process.pid)
        client_before = time.process_time()
        phase = Phase(name, seconds)
        start = loop.time()
        spacing = args.interval / max(1, len(agents))
        end = start + seconds
        beats = [
            asyncio.create_task(
                heartbeat_loop(client, node, number, args.gpus, start + number * spacing, args.interval, end)
            )
            for number, node, client in agents
        ]
        phase.operator = await operator_load(operator, calls, args.rate, seconds)
        for samples, late in await asyncio.gather(*beats):
            phase.heartbeats.extend(samples)
            phase.late_heartbeats += late
        phase.server_cpu_s = group_cpu_seconds(server.process.pid) - cpu_before
        phase.client_cpu_s = time.process_time() - client_before
    return phase


_PROFILE_FORMATS = {".svg": "flamegraph", ".json": "speedscope"}


@contextlib.asynccontextmanager
async def profiling(pid: int, out: Path, seconds: float) -> AsyncIterator[None]:
    """Sample the server (and its worker processes) with py-spy for ``seconds`` into ``out``.

    The format follows the suffix: .svg a flame graph, .json speedscope, anything else py-spy's raw
    collapsed stacks (one line per stack, with its sample count). Raises SystemExit without py-spy.
    """
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("--profile: py-spy is not on PATH (pip install py-spy)")
    command = [
        py_spy, "record", "--pid", str(pid), "--subprocesses", "--duration", str(max(1, int(seconds))),
        "--rate", "200", "--format", _PROFILE_FORMATS.get(out.suffix, "raw"), "--output", str(out),
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.DEVNULL)
    try:
        yield
    finally:
        await process.wait()


def group_cpu_seconds(group: int) -> float:
    """User + system CPU seconds of every live process in process group ``group`` (uvicorn and its workers)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == group:
                total += int(fields[11]) + int(fields[12])
    return total / _TICKS


# Starting things.


def keep_alive_seconds(interval: float) -> int:
    """How long uvicorn keeps an idle connection: well past an agent's interval.

    uvicorn's default (5 s) equals the agents' default interval, so the server would close a connection
    just as its agent sends the next heartbeat on it (the agent sees a ReadError): a deployment with
    5 s heartbeats needs a longer keep-alive, and so does this benchmark.
    """
    return max(5, math.ceil(3 * interval))


@contextlib.contextmanager
def database(args: argparse.Namespace) -> Iterator[tuple[str, str | None]]:
    """Yields (a label for the report, DATABASE_URL or None for SQLite in the data directory)."""
    if args.postgres:
        from tests.controlplane import postgres

        if not postgres.available():
            raise SystemExit("--postgres: PostgreSQL 15 is not installed (make system-deps installs it)")
        with postgres.PostgresServer() as server:
            yield "PostgreSQL 15 (throwaway, fsync off)", server.url
    elif args.database_url:
        yield "PostgreSQL (--database-url)", args.database_url
    else:
        yield "SQLite (WAL)", None


@contextlib.contextmanager
def broker(directory: Path) -> Iterator[str]:
    """A redis-server on a free port, as Celery's broker (actions ask for a reconciler pass through it)."""
    from tests.infra import RedisServer

    server = RedisServer(directory / "redis")
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@contextlib.contextmanager
def control_plane(env: dict[str, str], workers: int, keep_alive: int, log_path: Path) -> Iterator[ServerProcess]:
    """uvicorn serving the control plane on a free port; yields it once it answers, stops it on exit."""
    port = free_port()
    command = [
        sys.executable, "-m", "uvicorn", "controlplane.asgi:application",
        "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers),
        "--log-level", "warning", "--no-access-log", "--timeout-keep-alive", str(keep_alive),
        "--http", "controlplane.http_protocol:HeadDeadlineProtocol",
    ]  # fmt: skip
    with running_server(command, port=port, ready_path="/admin/login/", log_path=log_path, env=env, cwd=ROOT) as server:
        yield server


# The report.


def latency_row(label: str, samples: Sequence[Sample]) -> str:
    seconds = [sample.seconds * 1000 for sample in samples]
    errors = sum(1 for sample in samples if not sample.ok)
    if not seconds:
        return f"{label:<28}{0:>7}"
    p50, p99 = percentile(seconds, 50), percentile(seconds, 99)
    return f"{label:<28}{len(seconds):>7}{p50:>9.1f}{p99:>9.1f}{max(seconds):>9.1f}{errors:>8}"


def summary(samples: Sequence[Sample]) -> dict[str, Any]:
    seconds = [sample.seconds * 1000 for sample in samples]
    if not seconds:
        return {"calls": 0}
    return {
        "calls": len(seconds),
        "p50_ms": round(percentile(seconds, 50), 2),
        "p99_ms": round(percentile(seconds, 99), 2),
        "max_ms": round(max(seconds), 2),
        "errors": sum(1 for sample in samples if not sample.ok),
    }


def print_windows(phase: Phase) -> None:
    """p99 per window of the phase: a stall (a checkpoint, a burst) shows where a whole-phase p99 hides it."""
    width = max(WINDOW_S, phase.seconds / MAX_WINDOWS)
    windows: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for sample in (*phase.operator, *phase.heartbeats):
        window = int((sample.sent_at - phase.started) // width)
        windows[window]["heartbeat" if sample.name == "heartbeat" else "operator"].append(sample.seconds * 1000)
    print(f"\np99 ms per {width:g} s, {phase.name}:  operator  heartbeats")
    for window in sorted(windows):
        cells = [windows[window].get(kind, []) for kind in ("operator", "heartbeat")]
        text = [f"{percentile(values, 99):9.1f}" if values else f"{'-':>9}" for values in cells]
        print(f"  {window * width:5.0f}-{(window + 1) * width:<5.0f}{'':15}{text[0]} {text[1]}")


def print_errors(phases: Sequence[Phase], registration: Sequence[Sample]) -> int:
    """Print every kind of failed call once, with how many there were and the slowest's time; returns the count."""
    kinds: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    failed = [("register", s) for s in registration]
    failed += [(phase.name, s) for phase in phases for s in (*phase.operator, *phase.heartbeats) if not s.ok]
    for phase_name, sample in failed:
        what = f"HTTP {sample.status}" if sample.status else "no answer"
        kinds[phase_name, sample.name, f"{what}: {sample.detail}"].append(sample.seconds)
    for (phase_name, name, what), seconds in sorted(kinds.items(), key=lambda item: -len(item[1]))[:ERRORS_SHOWN]:
        print(f"error ({phase_name}): {len(seconds)} x {name}: {what} (the slowest after {max(seconds):.1f} s)")
    if len(kinds) > ERRORS_SHOWN:
        print(f"... and {len(kinds) - ERRORS_SHOWN} more kinds of error")
    return len(failed)


def report(args: argparse.Namespace, label: str, baseline: Phase, load: Phase, registration: Sequence[Sample]) -> None:
    cores = os.cpu_count() or 1
    print(f"{'':<28}{'calls':>7}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'errors':>8}")
    print(latency_row("operator, no heartbeats", baseline.operator))
    print(latency_row("operator, heartbeating", load.operator))
    print(latency_row("heartbeats", load.heartbeats))
    for phase in (baseline, load):
        share = phase.server_cpu_s / phase.seconds
        client = phase.client_cpu_s / phase.seconds
        print(f"CPU, {phase.name}: server {share:.2f} cores, load generator {client:.2f} (of {cores})")
    if load.late_heartbeats:
        print(f"heartbeats sent late (the previous one had not returned): {load.late_heartbeats}")
    print("\nper call (p50 / p99 ms)        no heartbeats      heartbeating")
    by_name: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for phase in (baseline, load):
        for sample in phase.operator:
            by_name[sample.name][phase.name].append(sample.seconds * 1000)
    for name, phases in by_name.items():
        cells = []
        for phase in (baseline, load):
            values = phases.get(phase.name, [])
            cells.append(f"{percentile(values, 50):7.1f} /{percentile(values, 99):7.1f}" if values else "-")
        print(f"  {name:<28}{cells[0]:>17} {cells[1]:>17}")
    print_windows(load)
    errors = print_errors((baseline, load), registration)
    base_p99 = summary(baseline.operator).get("p99_ms", 0.0)
    load_p99 = summary(load.operator).get("p99_ms", 0.0)
    ratio = load_p99 / base_p99 if base_p99 else float("nan")
    verdict = "met" if load_p99 <= FLOOR_P99_MS and not errors else "NOT met"
    print(f"\noperator p99 heartbeating / no heartbeats: {ratio:.2f}x ({load_p99:.1f} / {base_p99:.1f} ms)")
    print(f"floor (operator p99 <= {FLOOR_P99_MS:.0f} ms under the heartbeats, no errors): {verdict}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {
        "database": label,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "database_url"},
        "registration_errors": len(registration),
        "baseline": {
            "operator": summary(baseline.operator),
            "server_cpu_s": baseline.server_cpu_s,
            "client_cpu_s": baseline.client_cpu_s,
        },
        "load": {
            "operator": summary(load.operator),
            "heartbeats": summary(load.heartbeats),
            "late_heartbeats": load.late_heartbeats,
            "server_cpu_s": load.server_cpu_s,
            "client_cpu_s": load.client_cpu_s,
        },
        "operator_p99_ratio": ratio,
        "per_call": {
            name: {phase: {"p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99)} for phase, v in p.items()}
            for name, p in by_name.items()
        },
        "floor_met": verdict == "met",
    }
    (RESULTS / "controlplane_api.json").write_text(json.dumps(result, indent=2) + "\n")


def positive(kind: type[int] | type[float]) -> Any:
    """An argparse type: a number of ``kind`` above 0."""
    return bounded(kind, above=0)


def bounded(
    kind: type[int] | type[float],
    *,
    above: float | None = None,
    at_least: float | None = None,
    at_most: float | None = None,
) -> Any:
    """An argparse type: a number of ``kind`` within the bounds given (None: no bound)."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if above is not None and value <= above:
            raise argparse.ArgumentTypeError(f"{text!r} is not above {above:g}")
        if at_least is not None and value < at_least:
            raise argparse.ArgumentTypeError(f"{text!r} is less than {at_least:g}")
        if at_most is not None and value > at_most:
            raise argparse.ArgumentTypeError(f"{text!r} is more than {at_most:g}")
        return value

    return parse


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=positive(float), default=60.0, help="seconds under heartbeat load")
    parser.add_argument("--baseline", type=positive(float), default=20.0, help="seconds of operator calls alone")
    parser.add_argument("--nodes", type=positive(int), default=200, help="simulated agents (one node each)")
    parser.add_argument("--interval", type=positive(float), default=5.0, help="seconds between an agent's heartbeats")
    parser.add_argument("--rate", type=positive(float), default=10.0, help="operator calls per second")
    parser.add_argument("--gpus", type=bounded(int, at_least=0, at_most=64), default=8, help="GPUs per node (0..64)")
    parser.add_argument("--workers", type=positive(int), default=1, help="uvicorn worker processes")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--postgres", action="store_true", help="start a throwaway PostgreSQL 15 and use it")
    where.add_argument("--database-url", help="postgresql://… of an empty database (default: SQLite)")
    parser.add_argument("--profile", type=Path, help="py-spy the server under load into this file (.svg, .json, .txt)")
    parser.add_argument("--log", type=Path, help="keep the server's log here (default: a temporary folder)")
    args = parser.parse_args()
    if args.database_url and not args.database_url.startswith(("postgres://", "postgresql://")):
        parser.error("--database-url: give a postgres:// or postgresql:// URL (SQLite is the default)")
    if args.duration < args.interval:
        parser.error(f"--duration ({args.duration:g} s) is shorter than --interval ({args.interval:g} s)")
    return args


async def measure(
    server: ServerProcess, fleet: Fleet, args: argparse.Namespace, began: float
) -> tuple[list[Sample], Phase, Phase]:
    """Register the agents, deploy pipelines, then measure without and with the heartbeats.

    Returns the failed registrations, the baseline phase and the loaded one.
    """
    registration = await register_all(server.base_url, fleet, args.gpus)
    # The ORM is synchronous: it runs in a thread of its own, outside this event loop.
    pipeline_ids = await asyncio.to_thread(deploy_pipelines, args.nodes, args.gpus)
    ids = await node_ids(server.base_url, fleet.operator_token, args.nodes)
    print(f"ready in {time.perf_counter() - began:.1f} s: {len(ids)} nodes, {len(pipeline_ids)} pipelines")
    calls = operator_calls(ids, pipeline_ids, args.nodes)
    print(
        f"operator: {args.rate:g} calls/s for {args.baseline:g} s alone, then {args.duration:g} s while"
        f" every node heartbeats every {args.interval:g} s ({args.nodes / args.interval:.0f}/s)\n"
    )
    # One of each call first, not counted: the first request of a kind pays for imports and caches.
    await run_phase("warm-up", server, fleet, calls, args, seconds=CALL_KINDS / args.rate, heartbeats=False)
    baseline = await run_phase("no heartbeats", server, fleet, calls, args, seconds=args.baseline, heartbeats=False)
    load = await run_phase("heartbeating", server, fleet, calls, args, seconds=args.duration, heartbeats=True)
    return registration, baseline, load


def main() -> None:
    args = parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="controlplane-bench-") as temp,
        database(args) as (label, url),
        broker(Path(temp)) as broker_url,
    ):
        env = {
            "DJANGO_SETTINGS_MODULE": "controlplane.settings",
            "FLOTILLA_DATA_DIR": str(Path(temp) / "data"),
            "FLOTILLA_SECRET_KEY": secrets.token_urlsafe(50),
            "FLOTILLA_BROKER_URL": broker_url,
        }
        if url:
            env["DATABASE_URL"] = url
        setup_django(env)
        began = time.perf_counter()
        fleet = prepare_database(args.nodes)
        print(f"control plane on {label}, {args.workers} uvicorn worker(s); {args.nodes} nodes x {args.gpus} GPUs")
        log_path = args.log or Path(temp) / "controlplane.log"
        with control_plane(env, args.workers, keep_alive_seconds(args.interval), log_path) as server:
            registration, baseline, load = uvloop.run(measure(server, fleet, args, began))
        report(args, label, baseline, load, registration)


if __name__ == "__main__":
    main()
