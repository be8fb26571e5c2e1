"""Gateway overhead: what `flotilla run in=http out=echo_full` costs per request and per streamed token.

Runs the Flotilla gateway (echo_full engine, zero delay) and a bare ASGI relay (bench/bare_relay.py:
same exchange, nothing else) under the same uvicorn settings, one at a time, and drives each with
the same closed-loop load: N connections with keep-alive, each sending streamed chat requests back
to back for a fixed time. It reads the server process's CPU time from /proc, so the CPU figures do
not depend on the load generator. Two prompt lengths (1 and 257 characters = tokens) separate the
per-request cost from the per-token cost.

    .venv/bin/python bench/gateway_overhead.py [--seconds 6] [--concurrency 32] [--rounds 2]

Prints requests/s, CPU µs per request and per streamed token for both servers, and their ratios.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import uvloop
from _common import RESULTS_DIR
from loadgen import chat_request, closed_loop

from runtime.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")
SHORT, LONG = 1, 257


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def start(kind: str, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "FLOTILLA_TOKEN_ECHO_DELAY_MS": "0", "FLOTILLA_LOG": "warning"}
    if kind == "flotilla":
        command = [
            sys.executable,
            "-m",
            "launcher.cli",
            "run",
            "in=http",
            "out=echo_full",
            "--model-name",
            "echo",
            "--http-port",
            str(port),
        ]
    else:
        command = [
            sys.executable,
            "-m",
            "uvicorn",
            "bench.bare_relay:app",
            "--port",
            str(port),
            "--loop",
            "uvloop",
            "--http",
            "httptools",
            "--no-access-log",
            "--log-level",
            "warning",
        ]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/live", timeout=1).read()
            return process
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"{kind} server exited with {process.returncode}") from None
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"{kind} server did not start")


def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@dataclass
class Measure:
    requests: int
    seconds: float
    cpu: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def cpu_us_per_request(self) -> float:
        return self.cpu / self.requests * 1e6


def measure(process: subprocess.Popen[bytes], port: int, prompt: str, seconds: float, concurrency: int) -> Measure:
    request = chat_request(port, "echo", prompt)
    uvloop.run(closed_loop(port, request, 0.5, concurrency))  # warm-up, not counted
    cpu_before, wall_before = cpu_seconds(process.pid), time.perf_counter()
    result = uvloop.run(closed_loop(port, request, seconds, concurrency))
    return Measure(result.requests, time.perf_counter() - wall_before, cpu_seconds(process.pid) - cpu_before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=6.0, help="measured time per workload")
    parser.add_argument("--concurrency", type=int, default=32, help="connections in flight")
    parser.add_argument("--rounds", type=int, default=2, help="alternate the servers this many times")
    args = parser.parse_args()

    results: dict[str, dict[int, list[Measure]]] = {
        "bare": {SHORT: [], LONG: []},
        "flotilla": {SHORT: [], LONG: []},
    }
    for _ in range(args.rounds):
        for kind in ("bare", "flotilla"):
            port = free_port()
            process = start(kind, port)
            try:
                for tokens in (SHORT, LONG):
                    results[kind][tokens].append(measure(process, port, "x" * tokens, args.seconds, args.concurrency))
            finally:
                stop(process)

    def total(kind: str, tokens: int) -> Measure:
        runs = results[kind][tokens]
        return Measure(sum(r.requests for r in runs), sum(r.seconds for r in runs), sum(r.cpu for r in runs))

    summary: dict[str, dict[str, float]] = {}
    for kind in ("bare", "flotilla"):
        short, long = total(kind, SHORT), total(kind, LONG)
        per_token = (long.cpu_us_per_request - short.cpu_us_per_request) / (LONG - SHORT)
        summary[kind] = {
            "rps_1_token": short.rps,
            "rps_257_tokens": long.rps,
            "cpu_us_per_request": short.cpu_us_per_request - per_token,
            "cpu_us_per_token": per_token,
        }
    bare, ours = summary["bare"], summary["flotilla"]
    print(f"concurrency {args.concurrency}, {args.rounds} rounds of {args.seconds:g} s per workload")
    print(f"{'':28}{'bare relay':>12}{'flotilla':>12}{'ratio':>8}")
    for key, label in (
        ("rps_1_token", "requests/s, 1 token"),
        ("rps_257_tokens", "requests/s, 257 tokens"),
        ("cpu_us_per_request", "CPU µs per request"),
        ("cpu_us_per_token", "CPU µs per streamed token"),
    ):
        print(f"{label:28}{bare[key]:12.1f}{ours[key]:12.1f}{ours[key] / bare[key]:8.2f}")
    extra_request = ours["cpu_us_per_request"] - bare["cpu_us_per_request"]
    extra_token = ours["cpu_us_per_token"] - bare["cpu_us_per_token"]
    print(f"gateway CPU above the bare relay: {extra_request:.1f} µs/request, {extra_token:.2f} µs/token")
    per_request, per_token = ours["cpu_us_per_request"], ours["cpu_us_per_token"]
    print(
        f"floors: CPU per request {per_request:.0f} µs <= 250: {'met' if per_request <= 250 else 'NOT met'}; "
        f"CPU per token {per_token:.1f} µs <= 15: {'met' if per_token <= 15 else 'NOT met'}"
    )
    out = RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    raw = {kind: {str(t): [asdict(m) for m in runs] for t, runs in per.items()} for kind, per in results.items()}
    (out / "gateway_overhead.json").write_text(json.dumps({"summary": summary, "raw": raw}, indent=2))


if __name__ == "__main__":
    main()
