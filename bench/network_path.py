"""The network path against the single process: what etcd + NATS + separate workers cost.

Runs, one after the other, (a) ``flotilla run in=http out=ENGINE`` (one process) and (b) an ingress
``flotilla run in=http out=dyn`` with ``--workers`` workers ``flotilla run in=dyn://bench out=ENGINE`` in
other processes, on etcd and NATS started here on free loopback ports; the echo engines run with zero
delay unless ``--delay-ms`` says otherwise. Each is driven by the same closed-loop load
(bench/loadgen.py). Each server's own CPU time is read from /proc: for (b) that is the ingress alone,
the workers' CPU is not counted.

    .venv/bin/python bench/network_path.py [--engine echo_core] [--workers 2] [--tokens 32]
        [--seconds 6] [--concurrency 32] [--rounds 2] [--delay-ms 0]

``--tokens`` is the answer's length: echo_full echoes a prompt of that many characters; echo_core
echoes the templated prompt (a short chat message) cut at ``max_tokens``. Prints requests/s, TTFT p50/p99 and CPU per
request and per token for both, and the ratio network/single. Floors: network / single >= 0.60
requests/s (issue 3); ingress CPU <= 0.35 ms per 32-token chat request at concurrency 32 with two
echo_core workers (issue 6).
"""

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvloop
from _common import RESULTS_DIR, cpu_seconds, free_port, percentile, running_server
from loadgen import chat_request, closed_loop

ROOT = Path(__file__).resolve().parent.parent
MODEL = "echo"


#: Tries at etcd and NATS on fresh ports: a port free_port() found may be taken before the server binds it.
_INFRASTRUCTURE_TRIES = 3


class _ServerEnded(RuntimeError):
    """A server exited before its port opened (its port taken meanwhile, most often): tried again elsewhere."""


@contextlib.contextmanager
def infrastructure(directory: Path) -> Iterator[dict[str, str]]:
    """etcd and NATS (JetStream) on free loopback ports; yields the environment that points at them.

    A server that exits at start is started again on other ports (up to ``_INFRASTRUCTURE_TRIES`` times): on a
    busy machine another process may take a port between ``free_port()`` and the server's bind. Raises
    RuntimeError with the server's log when none starts."""
    for attempt in range(_INFRASTRUCTURE_TRIES):
        suffix = f"-{attempt}" if attempt else ""
        with contextlib.ExitStack() as running:
            try:
                env = _start_infrastructure(directory, suffix, running)
            except _ServerEnded as exc:
                if attempt + 1 == _INFRASTRUCTURE_TRIES:
                    raise RuntimeError(f"{exc} ({_INFRASTRUCTURE_TRIES} tries on fresh ports)") from None
                continue
            yield env
            return


def _start_infrastructure(directory: Path, suffix: str, running: contextlib.ExitStack) -> dict[str, str]:
    """Start etcd and NATS (data folders named with ``suffix``), stopped by ``running``; their environment once
    both accept connections. Raises _ServerEnded, or RuntimeError when one neither starts nor exits in 20 s."""
    etcd_port, peer_port, nats_port = free_port(), free_port(), free_port()
    etcd_log, nats_log = directory / "etcd.log", directory / "nats.log"
    etcd = [
        "etcd", "--data-dir", str(directory / f"etcd{suffix}"),
        "--listen-client-urls", f"http://127.0.0.1:{etcd_port}", "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
        "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
        "--initial-cluster", f"default=http://127.0.0.1:{peer_port}",
    ]  # fmt: skip
    nats = ["nats-server", "-js", "-a", "127.0.0.1", "-p", str(nats_port), "-sd", str(directory / f"nats{suffix}")]
    nats += ["-l", str(nats_log)]
    started = []
    for command, port, log in ((etcd, etcd_port, etcd_log), (nats, nats_port, nats_log)):
        with log.open("ab") as stderr:
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        running.callback(_stopped, process)
        started.append((command[0], process, port, log))
    for name, process, port, log in started:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if process.poll() is not None:
                tail = log.read_text(errors="replace")[-1500:]
                raise _ServerEnded(f"{name} exited with {process.returncode} before port {port} opened:\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"port {port} never opened (is etcd/nats-server installed? `make system-deps`)")
            time.sleep(0.05)
    return {"ETCD_ENDPOINTS": f"http://127.0.0.1:{etcd_port}", "NATS_SERVER": f"nats://127.0.0.1:{nats_port}"}


def _stopped(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    process.wait()


def flotilla(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher.cli", "run", *args]


@dataclass
class Run:
    """One measured run: requests completed, wall seconds, TTFTs, and the server process's CPU seconds."""

    requests: int = 0
    seconds: float = 0.0
    cpu: float = 0.0
    ttfts: list[float] = field(default_factory=list)

    def add(self, other: "Run") -> None:
        self.requests += other.requests
        self.seconds += other.seconds
        self.cpu += other.cpu
        self.ttfts += other.ttfts


def request_bytes(port: int, args: argparse.Namespace) -> bytes:
    if args.engine == "echo_full":
        return chat_request(port, MODEL, ("abcdefghijklmnopqrstuvwxyz" * 100)[: args.tokens])
    # The default model's template adds ~30 tokens (its system prompt) around the message, one per
    # "hello": the echo is cut at `tokens`. A short message keeps tokenizing (~0.1 ms here) a small share.
    return chat_request(port, MODEL, " ".join(["hello"] * max(2, args.tokens - 26)), max_tokens=args.tokens)


def measure(port: int, pid: int, args: argparse.Namespace) -> Run:
    request = request_bytes(port, args)
    uvloop.run(closed_loop(port, request, 0.5, args.concurrency))  # warm-up, not counted
    cpu_before = cpu_seconds(pid)
    result = uvloop.run(closed_loop(port, request, args.seconds, args.concurrency))
    return Run(result.requests, result.seconds, cpu_seconds(pid) - cpu_before, result.ttfts)


def single_process(directory: Path, env: dict[str, str], args: argparse.Namespace) -> Run:
    port = free_port()
    command = flotilla("in=http", f"out={args.engine}", "--model-name", MODEL, "--http-port", str(port))
    with running_server(
        command, port=port, ready_path="/live", log_path=directory / "single.log", env=env, cwd=ROOT
    ) as server:
        return measure(port, server.process.pid, args)


def network(directory: Path, env: dict[str, str], args: argparse.Namespace) -> Run:
    port = free_port()
    workers: list[subprocess.Popen[bytes]] = []
    try:
        for number in range(args.workers):
            command = flotilla("in=dyn://bench", f"out={args.engine}", "--model-name", MODEL)
            with (directory / f"worker-{number}.log").open("wb") as log:
                worker = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **env}, stdout=log, stderr=log)
            workers.append(worker)
        ingress = flotilla("in=http", "out=dyn", "--http-port", str(port))
        with running_server(
            ingress, port=port, ready_path="/live", log_path=directory / "ingress.log", env=env, cwd=ROOT
        ) as server:
            wait_for_instances(port, directory, workers)
            return measure(port, server.process.pid, args)
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait()


def wait_for_instances(port: int, directory: Path, workers: list[subprocess.Popen[bytes]]) -> None:
    """Wait until the ingress serves the model and every worker has printed its banner (it is registered)."""
    deadline = time.monotonic() + 60
    logs = [directory / f"worker-{number}.log" for number in range(len(workers))]
    while not (
        httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        and all("Flotilla worker" in log.read_text(errors="replace") for log in logs)
    ):
        if time.monotonic() > deadline or any(worker.poll() is not None for worker in workers):
            raise RuntimeError("a worker never registered:\n" + "\n".join(log.read_text() for log in logs))
        time.sleep(0.1)  # polling other processes: there is no event to await
    time.sleep(0.5)  # the ingress learns of the last instance through an etcd watch: let it arrive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["echo_core", "echo_full"], default="echo_core", help="the engine")
    parser.add_argument("--workers", type=int, default=2, help="worker processes behind the ingress")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--seconds", type=float, default=6.0, help="measured time per run")
    parser.add_argument("--concurrency", type=int, default=32, help="connections in flight")
    parser.add_argument("--rounds", type=int, default=2, help="alternate the two paths this many times")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="the echo engines' delay between tokens")
    args = parser.parse_args()
    results = {"single process": Run(), "network": Run()}
    with tempfile.TemporaryDirectory() as temp:
        directory = Path(temp)
        with infrastructure(directory) as env:
            env = {**env, "FLOTILLA_TOKEN_ECHO_DELAY_MS": str(args.delay_ms), "FLOTILLA_LOG": "warning"}
            for _ in range(args.rounds):
                results["single process"].add(single_process(directory, env, args))
                results["network"].add(network(directory, env, args))

    summary: dict[str, dict[str, float]] = {}
    print(
        f"{args.engine}, {args.tokens} tokens per answer, concurrency {args.concurrency}, "
        f"{args.workers} worker(s) on the network path, {args.delay_ms:g} ms per token, "
        f"{args.rounds} rounds of {args.seconds:g} s"
    )
    print(f"{'path':16}{'requests/s':>12}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'CPU ms/req':>12}{'CPU µs/tok':>12}")
    for name, run in results.items():
        summary[name] = row = {
            "rps": run.requests / run.seconds,
            "ttft_p50_ms": percentile(run.ttfts, 50) * 1000,
            "ttft_p99_ms": percentile(run.ttfts, 99) * 1000,
            "cpu_ms_per_request": run.cpu / run.requests * 1000,
            "cpu_us_per_token": run.cpu / (run.requests * args.tokens) * 1e6,
        }
        print(
            f"{name:16}{row['rps']:12.1f}{row['ttft_p50_ms']:13.2f}{row['ttft_p99_ms']:13.2f}"
            f"{row['cpu_ms_per_request']:12.3f}{row['cpu_us_per_token']:12.2f}"
        )
    ratio = summary["network"]["rps"] / summary["single process"]["rps"]
    print(f"network / single process: {ratio:.2f}x requests/s (floor 0.60: {'met' if ratio >= 0.6 else 'NOT met'})")
    ingress_ms = summary["network"]["cpu_ms_per_request"]
    print(f"ingress CPU per request: {ingress_ms:.3f} ms (floor 0.35 ms for 32 echo_core tokens at concurrency 32)")
    out = RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    (out / "network_path.json").write_text(
        json.dumps({"args": vars(args), "summary": summary, "ratio": ratio}, indent=2)
    )


if __name__ == "__main__":
    main()
