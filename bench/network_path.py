"""The network path against the single process: what etcd + NATS + a separate worker cost.

Runs, one after the other, (a) ``flotilla run in=http out=echo_full`` (one process) and (b) an
ingress ``flotilla run in=http out=dyn`` with a worker ``flotilla run in=dyn://bench out=echo_full``
in another process, on etcd and NATS started here on free loopback ports; both echo with zero
delay. Each is driven by the same closed-loop load (bench/loadgen.py).

    .venv/bin/python bench/network_path.py [--seconds 6] [--concurrency 32] [--prompt-tokens 16] [--rounds 2]

Prints requests/s and TTFT p50/p99 for both, and the ratio network/single (floor: >= 0.60).
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
from pathlib import Path

import httpx
import uvloop
from _common import free_port, percentile, running_server
from loadgen import LoadResult, chat_request, closed_loop

ROOT = Path(__file__).resolve().parent.parent
MODEL = "echo"


@contextlib.contextmanager
def infrastructure(directory: Path) -> Iterator[dict[str, str]]:
    """etcd and NATS (JetStream) on free loopback ports; yields the environment that points at them."""
    etcd_port, peer_port, nats_port = free_port(), free_port(), free_port()
    processes = [
        subprocess.Popen(
            ["etcd", "--data-dir", str(directory / "etcd"), "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
             "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
             "--initial-cluster", f"default=http://127.0.0.1:{peer_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            ["nats-server", "-js", "-a", "127.0.0.1", "-p", str(nats_port), "-sd", str(directory / "nats")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ),
    ]  # fmt: skip
    try:
        for port in (etcd_port, nats_port):
            deadline = time.monotonic() + 20
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"port {port} never opened (is etcd/nats-server installed? `make system-deps`)")
                time.sleep(0.05)
        yield {
            "ETCD_ENDPOINTS": f"http://127.0.0.1:{etcd_port}",
            "NATS_SERVER": f"nats://127.0.0.1:{nats_port}",
        }
    finally:
        for process in processes:
            process.terminate()
            process.wait()


def flotilla(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher.cli", "run", *args]


def measure(port: int, prompt: str, seconds: float, concurrency: int) -> LoadResult:
    request = chat_request(port, MODEL, prompt)
    uvloop.run(closed_loop(port, request, 0.5, concurrency))  # warm-up, not counted
    return uvloop.run(closed_loop(port, request, seconds, concurrency))


def single_process(directory: Path, env: dict[str, str], prompt: str, args: argparse.Namespace) -> LoadResult:
    port = free_port()
    command = flotilla("in=http", "out=echo_full", "--model-name", MODEL, "--http-port", str(port))
    with running_server(command, port=port, ready_path="/live", log_path=directory / "single.log", env=env, cwd=ROOT):
        return measure(port, prompt, args.seconds, args.concurrency)


def network(directory: Path, env: dict[str, str], prompt: str, args: argparse.Namespace) -> LoadResult:
    port = free_port()
    worker_log = (directory / "worker.log").open("wb")
    worker = subprocess.Popen(
        flotilla("in=dyn://bench", "out=echo_full", "--model-name", MODEL),
        cwd=ROOT, env={**os.environ, **env}, stdout=worker_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        ingress = flotilla("in=http", "out=dyn", "--http-port", str(port))
        with running_server(
            ingress, port=port, ready_path="/live", log_path=directory / "ingress.log", env=env, cwd=ROOT
        ):
            deadline = time.monotonic() + 60
            while httpx.get(f"http://127.0.0.1:{port}/health").status_code != 200:
                if time.monotonic() > deadline or worker.poll() is not None:
                    raise RuntimeError("the worker's model never appeared:\n" + (directory / "worker.log").read_text())
                time.sleep(0.1)
            return measure(port, prompt, args.seconds, args.concurrency)
    finally:
        worker.terminate()
        worker.wait()
        worker_log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=6.0, help="measured time per run")
    parser.add_argument("--concurrency", type=int, default=32, help="connections in flight")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="echoed characters (= tokens) per request")
    parser.add_argument("--rounds", type=int, default=2, help="alternate the two paths this many times")
    args = parser.parse_args()
    prompt = ("abcdefghijklmnopqrstuvwxyz" * 100)[: args.prompt_tokens]
    results: dict[str, list[LoadResult]] = {"single process": [], "network": []}
    with tempfile.TemporaryDirectory() as temp:
        directory = Path(temp)
        with infrastructure(directory) as env:
            env = {**env, "FLOTILLA_TOKEN_ECHO_DELAY_MS": "0", "FLOTILLA_LOG": "warning"}
            for _ in range(args.rounds):
                results["single process"].append(single_process(directory, env, prompt, args))
                results["network"].append(network(directory, env, prompt, args))

    summary: dict[str, dict[str, float]] = {}
    print(f"echo_full, {args.prompt_tokens} tokens per answer, concurrency {args.concurrency}, {args.rounds} rounds")
    print(f"{'path':16}{'requests/s':>12}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}")
    for name, runs in results.items():
        requests, seconds = sum(r.requests for r in runs), sum(r.seconds for r in runs)
        ttfts = [t for r in runs for t in r.ttfts]
        summary[name] = {
            "rps": requests / seconds,
            "ttft_p50_ms": percentile(ttfts, 50) * 1000,
            "ttft_p99_ms": percentile(ttfts, 99) * 1000,
        }
        row = summary[name]
        print(f"{name:16}{row['rps']:12.1f}{row['ttft_p50_ms']:13.2f}{row['ttft_p99_ms']:13.2f}")
    ratio = summary["network"]["rps"] / summary["single process"]["rps"]
    print(f"network / single process: {ratio:.2f}x requests/s (floor 0.60: {'met' if ratio >= 0.6 else 'NOT met'})")
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "network_path.json").write_text(
        json.dumps({"args": vars(args), "summary": summary, "ratio": ratio}, indent=2)
    )


if __name__ == "__main__":
    main()
