"""What API keys and their limits cost the ingress: CPU per request with keys off and on, measured in turns.

Starts etcd, NATS and redis-server on free loopback ports and ``--workers`` echo workers, then runs the
ingress ``flotilla run in=http out=dyn`` in turns (a) without API keys and (b) with
``--api-keys-secret-file`` and ``--quota-redis``: its requests carry a key with requests-per-minute,
tokens-per-minute and monthly limits (set high enough never to refuse), among ``--keys`` other published
keys, so every request is checked, charged and counted for usage. The load is bench/loadgen.py's closed
loop; the CPU is the ingress process's own (/proc). In (c), the same as (b) while 1,000 keys are added
and then revoked in etcd: serving must not pause (TTFT p99 and the longest wait are printed).

    .venv/bin/python bench/api_keys_cost.py [--workers 2] [--tokens 32] [--seconds 6] [--concurrency 32]
        [--rounds 5] [--keys 1000]

Floor (issue 25): ingress CPU per request with keys and limits on <= 1.10 x with them off.
"""

import argparse
import base64
import contextlib
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import uvloop
from _common import RESULTS_DIR, cpu_seconds, free_port, percentile, running_server
from loadgen import closed_loop
from network_path import MODEL, Run, flotilla, infrastructure, request_bytes, wait_for_instances

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.fleet_contract.api_keys import KeyRecord, etcd_key, key_hash, new_key, sign  # noqa: E402

SECRET = b"b" * 64
FLOOR = 1.10


@contextlib.contextmanager
def redis_server(directory: Path) -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(directory)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout.strip() != b"PONG":
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not answer (is it installed? `make system-deps`)")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait()


def put(etcd: str, key: str, value: bytes, client: httpx.Client | None = None) -> None:
    body = {"key": base64.b64encode(key.encode()).decode(), "value": base64.b64encode(value).decode()}
    (client or httpx).post(etcd + "/v3/kv/put", json=body, timeout=10).raise_for_status()


def publish(etcd: str, secret: str, key_id: int, client: httpx.Client | None = None, **fields: object) -> None:
    record = KeyRecord(key_id=key_id, name=f"key-{key_id}", owner="bench", **fields)  # type: ignore[arg-type]
    put(etcd, etcd_key(key_hash(secret)), sign(record, key_hash(secret), SECRET), client)


def with_key(request: bytes, secret: str) -> bytes:
    return request.replace(b"\r\nContent-Type:", f"\r\nAuthorization: Bearer {secret}\r\nContent-Type:".encode(), 1)


def churn(etcd: str, count: int) -> None:
    """Add ``count`` keys, then revoke them all, as fast as etcd takes them (over one connection)."""
    secrets = [new_key() for _ in range(count)]
    with httpx.Client() as client:
        for number, secret in enumerate(secrets):
            publish(etcd, secret, 10_000 + number, client, version=1)
        for number, secret in enumerate(secrets):
            publish(etcd, secret, 10_000 + number, client, version=2, revoked=True)


def run_ingress(
    directory: Path,
    env: dict[str, str],
    args: argparse.Namespace,
    workers: list[subprocess.Popen[bytes]],
    *,
    keyed: str | None,
    churning: bool,
) -> Run:
    """One measured run of a fresh ingress: with the key ``keyed`` on its requests (None: keys off)."""
    port = free_port()
    extra = ["--api-keys-secret-file", str(directory / "secret"), "--quota-redis", env["REDIS"]] if keyed else []
    command = flotilla("in=http", "out=dyn", "--http-port", str(port), *extra)
    with running_server(
        command, port=port, ready_path="/live", log_path=directory / "ingress.log", env=env, cwd=ROOT
    ) as server:
        wait_for_instances(port, directory, workers)
        request = request_bytes(port, args)
        if keyed:
            request = with_key(request, keyed)
        uvloop.run(closed_loop(port, request, 0.5, args.concurrency))  # warm-up, not counted
        if churning:
            # In a process of its own: a thread here would take the load generator's interpreter from it.
            churner = multiprocessing.Process(target=churn, args=(env["ETCD_ENDPOINTS"], args.keys))
            churner.start()
        cpu_before = cpu_seconds(server.process.pid)
        result = uvloop.run(closed_loop(port, request, args.seconds, args.concurrency))
        run = Run(result.requests, result.seconds, cpu_seconds(server.process.pid) - cpu_before, result.ttfts)
        if churning:
            churner.join()
            if churner.exitcode != 0:
                raise RuntimeError(f"the key churn failed (exit code {churner.exitcode}); see its traceback above")
        return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="echo_core workers behind the ingress")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--seconds", type=float, default=6.0, help="measured time per run")
    parser.add_argument("--concurrency", type=int, default=32, help="connections in flight")
    parser.add_argument("--rounds", type=int, default=5, help="alternate the runs this many times")
    parser.add_argument("--keys", type=int, default=1000, help="other keys published, and churned in (c)")
    args = parser.parse_args()
    args.engine = "echo_core"
    names = ("keys off", "keys + limits on", f"on, {args.keys:,} keys churned")
    results = {name: Run() for name in names}
    ratios: list[float] = []  # each round's on / off, the two runs taken back to back
    with tempfile.TemporaryDirectory() as temp:
        directory = Path(temp)
        (directory / "secret").write_bytes(SECRET)
        with infrastructure(directory) as env, redis_server(directory) as redis_url:
            env = {**env, "FLOTILLA_LOG": "warning", "FLOTILLA_TOKEN_ECHO_DELAY_MS": "0", "REDIS": redis_url}
            etcd = env["ETCD_ENDPOINTS"]
            secret = new_key()
            publish(etcd, secret, 1, requests_per_minute=10**8, tokens_per_minute=10**9, monthly_token_budget=10**15)
            for number in range(args.keys):
                publish(etcd, new_key(), 100 + number, requests_per_minute=600)
            workers = []
            try:
                for number in range(args.workers):
                    command = flotilla("in=dyn://bench", "out=echo_core", "--model-name", MODEL)
                    with (directory / f"worker-{number}.log").open("wb") as log:
                        workers.append(
                            subprocess.Popen(command, cwd=ROOT, env={**os.environ, **env}, stdout=log, stderr=log)
                        )
                for _ in range(args.rounds):
                    off = run_ingress(directory, env, args, workers, keyed=None, churning=False)
                    on = run_ingress(directory, env, args, workers, keyed=secret, churning=False)
                    results[names[0]].add(off)
                    results[names[1]].add(on)
                    results[names[2]].add(run_ingress(directory, env, args, workers, keyed=secret, churning=True))
                    ratios.append((on.cpu / on.requests) / (off.cpu / off.requests))
            finally:
                for worker in workers:
                    worker.terminate()
                    worker.wait()

    print(
        f"echo_core, {args.tokens} tokens per answer, concurrency {args.concurrency}, {args.workers} worker(s), "
        f"{args.keys} other keys, {args.rounds} rounds of {args.seconds:g} s"
    )
    print(f"{'ingress':26}{'requests/s':>12}{'CPU ms/req':>12}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'max ms':>9}")
    summary = {}
    for name, run in results.items():
        summary[name] = row = {
            "rps": run.requests / run.seconds,
            "cpu_ms_per_request": run.cpu / run.requests * 1000,
            "ttft_p50_ms": percentile(run.ttfts, 50) * 1000,
            "ttft_p99_ms": percentile(run.ttfts, 99) * 1000,
            "ttft_max_ms": max(run.ttfts) * 1000,
        }
        print(
            f"{name:26}{row['rps']:12.1f}{row['cpu_ms_per_request']:12.3f}{row['ttft_p50_ms']:13.2f}"
            f"{row['ttft_p99_ms']:13.2f}{row['ttft_max_ms']:9.1f}"
        )
    ratio = statistics.median(ratios)
    print("each round's CPU per request on / off: " + ", ".join(f"{value:.3f}" for value in ratios))
    verdict = "met" if ratio <= FLOOR else "NOT met"
    print(f"CPU per request, keys + limits on / off, median of the rounds: {ratio:.3f}x (floor {FLOOR}: {verdict})")
    out = RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    report = {"args": vars(args), "summary": summary, "ratio": ratio}
    (out / "api_keys_cost.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
