"""What hearing one NATS message costs a listener: nats-py's ``subscription.messages`` iterator against
``runtime.cluster.nats_connection.consume`` (a callback subscription).

Every router replica hears every worker's KV events and load reports and every other replica's
decisions, so this per-message cost is paid once per ingress process: through 4 ingresses, 4 times.
A publisher in another process sends ``--messages`` messages of ``--size`` bytes, ``--burst`` at a
time with a pause of a millisecond between bursts (as events arrive: a few at a time, not a flood);
the listener's own CPU time (``time.process_time``) from its subscription to the last message is
divided by the messages. The two ways alternate ``--repeat`` times on one nats-server, and the
medians and their ratio are printed.

    .venv/bin/python bench/nats_consume.py [--messages 20000] [--size 600] [--burst 4] [--repeat 5]
"""

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import uvloop
from _common import free_port
from nats.aio.msg import Msg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.cluster.nats_connection import connect_nats, consume, flush  # noqa: E402

SUBJECT = "bench.consume"


async def publish(url: str, messages: int, size: int, burst: int) -> None:
    nc = await connect_nats(url, name="publisher")
    payload = b"x" * size
    for number in range(messages):
        await nc.publish(SUBJECT, payload)
        if number % burst == burst - 1:
            await asyncio.sleep(0.001)
    await flush(nc)
    await nc.close()


async def listen(url: str, way: str, messages: int, size: int, burst: int) -> float:
    """µs of this process's CPU per message heard ``way`` ("iterator" or "consume")."""
    nc = await connect_nats(url, name="listener")
    heard = 0
    done = asyncio.Event()

    def handle(message: Msg) -> None:
        nonlocal heard
        heard += 1
        if heard == messages:
            done.set()

    if way == "iterator":
        subscription = await nc.subscribe(SUBJECT)

        async def iterate() -> None:
            async for message in subscription.messages:
                handle(message)

        task = asyncio.create_task(iterate())
    else:
        subscribed = asyncio.Event()
        task = asyncio.create_task(consume(nc, SUBJECT, handle, subscribed=subscribed))
        await subscribed.wait()
    await flush(nc)
    started = time.process_time()
    publisher = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--publish", url, "--messages", str(messages), "--size", str(size),
        "--burst", str(burst),
    )  # fmt: skip
    await asyncio.wait_for(done.wait(), 120)
    spent = time.process_time() - started
    if await publisher.wait() != 0:
        raise RuntimeError("the publisher failed")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await nc.close()
    return spent / messages * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20000, help="messages per measurement (default 20000)")
    parser.add_argument("--size", type=int, default=600, help="bytes per message (default 600: a KV event batch)")
    parser.add_argument("--burst", type=int, default=4, help="messages sent between 1 ms pauses (default 4)")
    parser.add_argument("--repeat", type=int, default=5, help="measurements of each way (default 5)")
    parser.add_argument("--publish", metavar="URL", help=argparse.SUPPRESS)  # the publisher's own process
    args = parser.parse_args()
    for name in ("messages", "size", "burst", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.publish:
        uvloop.run(publish(args.publish, args.messages, args.size, args.burst))
        return
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="nats-consume-") as directory:
        server = subprocess.Popen(
            ["nats-server", "-a", "127.0.0.1", "-p", str(port), "-l", str(Path(directory) / "nats.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            url = f"nats://127.0.0.1:{port}"
            runs: dict[str, list[float]] = {"iterator": [], "consume": []}
            for _ in range(args.repeat):
                for way, spent in runs.items():
                    spent.append(uvloop.run(listen(url, way, args.messages, args.size, args.burst)))
        finally:
            server.terminate()
            server.wait()
    iterator, consumed = (statistics.median(runs[way]) for way in ("iterator", "consume"))
    print(
        f"{args.messages} messages of {args.size} bytes, {args.burst} per ms; "
        f"listener CPU per message, median of {args.repeat}:"
    )
    print(f"  subscription.messages (nats-py's iterator): {iterator:.1f} µs")
    print(f"  consume (a callback subscription):          {consumed:.1f} µs")
    print(f"  consume / iterator: {consumed / iterator:.2f}x")


if __name__ == "__main__":
    main()
