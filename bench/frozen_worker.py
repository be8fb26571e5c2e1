"""A worker that stops answering with its connection open: how long until its client's streams fail over.

Starts nats-server on a free loopback port and a worker in a child process (an ``EndpointServer`` whose
handler yields a token every 20 ms per stream, heartbeats at the default 1 s), and opens ``--streams``
streams to it from a ``RequestClient`` in this process (silence timeout 5 s and progress deadline 60 s
by default, as an ingress has them). Once every stream has streamed for a second, the worker is
faulted:

* ``--fault stop``: SIGSTOP, a frozen process (its socket open, nothing read or sent), as a hung
  host or a process stopped by a debugger; found by the silence timeout and its confirming probe.
* ``--fault stuck``: its engine stops producing (the handlers wait for ever) while its event loop runs
  on and heartbeats keep coming; found only by the progress deadline.

Prints when each stream broke after the fault (p50 and last), and how.

    .venv/bin/python bench/frozen_worker.py [--fault stop|stuck] [--streams 100] [--silence 5] [--deadline 60]
"""

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import uvloop
from _common import nats_server, percentile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.cluster.nats_connection import connect_nats  # noqa: E402
from runtime.engine import RequestContext  # noqa: E402
from runtime.request_plane import EndpointServer, RequestClient, StreamBroken  # noqa: E402

SUBJECT = "bench.frozen.generate.1"


async def serve(url: str) -> None:
    """The worker (child process): a token every 20 ms per stream; SIGUSR1 makes its engine stuck."""
    stuck = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, stuck.set)

    async def handler(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
        for number in range(1_000_000):
            if stuck.is_set():
                await asyncio.Event().wait()
            await asyncio.sleep(0.02)
            yield msgspec.msgpack.encode(number)

    nc = await connect_nats(url, name="frozen worker")
    server = EndpointServer(nc, SUBJECT, handler)
    await server.start()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def measure(args: argparse.Namespace, url: str, worker: "subprocess.Popen[str]") -> None:
    try:
        nc = await connect_nats(url, name="ingress")
        client = RequestClient(nc, silence_timeout=args.silence, progress_deadline=args.deadline)
        await client.start()
        broke: list[tuple[float, str]] = []
        faulted = asyncio.get_running_loop().create_future()

        async def read(number: int) -> None:
            try:
                async for _ in client.call(SUBJECT, f"r{number}", b"\x00"):
                    pass
            except StreamBroken as exc:
                broke.append((time.monotonic() - await faulted, type(exc).__name__))

        readers = [asyncio.create_task(read(number)) for number in range(args.streams)]
        await asyncio.sleep(1.0)
        os.kill(worker.pid, signal.SIGSTOP if args.fault == "stop" else signal.SIGUSR1)
        faulted.set_result(time.monotonic())
        _, pending = await asyncio.wait(readers, timeout=args.give_up)
        for task in pending:
            task.cancel()
        times = sorted(seconds for seconds, _ in broke)
        kinds = sorted({kind for _, kind in broke})
        print(
            f"{args.streams} streams, fault {args.fault}, silence timeout {args.silence:g} s, "
            f"progress deadline {args.deadline:g} s"
        )
        if times:
            print(
                f"  broken: {len(times)} of {args.streams} ({', '.join(kinds)}), "
                f"p50 {percentile(times, 50):.2f} s, last {times[-1]:.2f} s after the fault"
            )
        if pending:
            print(f"  still waiting after {args.give_up:g} s: {len(pending)}")
        await client.close()
        await nc.close()
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        worker.kill()
        worker.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", choices=("stop", "stuck"), default="stop")
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--silence", type=float, default=5.0, help="FLOTILLA_STREAM_SILENCE_S (default 5)")
    parser.add_argument("--deadline", type=float, default=60.0, help="FLOTILLA_STREAM_PROGRESS_DEADLINE_S (default 60)")
    parser.add_argument("--give-up", type=float, default=120.0, help="seconds to wait for the verdicts")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        uvloop.run(serve(args.serve))
        return
    with tempfile.TemporaryDirectory() as directory, nats_server(Path(directory)) as nats_port:
        url = f"nats://127.0.0.1:{nats_port}"
        worker = subprocess.Popen(
            [sys.executable, __file__, "--serve", url], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
        uvloop.run(measure(args, url, worker))


if __name__ == "__main__":
    main()
