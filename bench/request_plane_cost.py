"""The request plane's CPU per streamed token, against the same streams consumed in one process.

An engine step hands one token to every running request at once (as the mocker's and vLLM's do):
here a clock wakes ``--streams`` streams every ``--step-ms``, each yielding one token per step for
``--tokens`` steps. The baseline consumes those streams directly, in-process (what a one-process
``flotilla run`` does before its HTTP layer); the request plane serves them with an ``EndpointServer``
and reads them with a ``RequestClient`` over a nats-server started here on a free loopback port, both
in this process, so the CPU counted (this process's) is the worker's side and the ingress's side of
the request plane together. The two take turns for ``--rounds`` rounds.

    .venv/bin/python bench/request_plane_cost.py [--streams 128] [--tokens 1000] [--step-ms 2] [--rounds 3]

Prints the CPU per token of each, their ratio, and the request plane's own CPU per token (the
difference). To compare two versions of the request plane, run it on each: the baseline in each run
says how fast the machine was meanwhile.
"""

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec
import uvloop
from network_path import infrastructure

from runtime.cluster.nats_connection import connect_nats
from runtime.engine import RequestContext
from runtime.request_plane import EndpointServer, RequestClient

SUBJECT = "bench.request_plane.generate.1"
encode = msgspec.msgpack.encode


class StepClock:
    """Wakes every stream waiting for the next step, every ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._next: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.seconds)
            step, self._next = self._next, loop.create_future()
            step.set_result(None)

    def next_step(self) -> Awaitable[None]:
        # Awaited by every stream at once: nothing cancels them here, so the future needs no shield.
        return self._next


def stream_of(clock: StepClock, tokens: int) -> Callable[[msgspec.Raw, RequestContext], AsyncIterator[bytes]]:
    async def handler(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
        for number in range(tokens):
            await clock.next_step()
            yield encode([number])

    return handler


async def direct(streams: int, tokens: int, step_s: float) -> float:
    """CPU seconds to consume the streams in this process."""
    clock = StepClock(step_s)
    ticking = asyncio.create_task(clock.run())
    handler = stream_of(clock, tokens)

    async def consume(number: int) -> None:
        taken = [payload async for payload in handler(msgspec.Raw(encode(None)), RequestContext(f"d{number}"))]
        assert len(taken) == tokens

    started = time.process_time()
    await asyncio.gather(*(consume(number) for number in range(streams)))
    cpu = time.process_time() - started
    ticking.cancel()
    return cpu


async def over_nats(url: str, streams: int, tokens: int, step_s: float) -> float:
    """CPU seconds to serve and read the streams through the request plane."""
    clock = StepClock(step_s)
    ticking = asyncio.create_task(clock.run())
    worker, ingress = await connect_nats(url, name="bench worker"), await connect_nats(url, name="bench ingress")
    server = EndpointServer(worker, SUBJECT, stream_of(clock, tokens))
    await server.start()
    client = RequestClient(ingress)
    await client.start()

    async def consume(number: int) -> None:
        taken = 0
        async for payloads in client.call(SUBJECT, f"n{number}", encode(None)):
            taken += len(payloads)
        assert taken == tokens, f"{taken} of {tokens} tokens"

    try:
        await consume(-1)  # warm: subscriptions, first allocations
        started = time.process_time()
        await asyncio.gather(*(consume(number) for number in range(streams)))
        return time.process_time() - started
    finally:
        ticking.cancel()
        await server.close()
        await client.close()
        await worker.close()
        await ingress.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=128, help="streams at once")
    parser.add_argument("--tokens", type=int, default=1000, help="tokens per stream, one per step")
    parser.add_argument("--step-ms", type=float, default=2.0, help="time between two engine steps")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running both")
    args = parser.parse_args()
    if args.streams < 1 or args.tokens < 1 or args.rounds < 1 or args.step_ms <= 0:
        parser.error("--streams, --tokens and --rounds must be at least 1, --step-ms above 0")
    step_s, count = args.step_ms / 1000, args.streams * args.tokens
    baseline: list[float] = []
    plane: list[float] = []
    with tempfile.TemporaryDirectory(prefix="request-plane-") as temp, infrastructure(Path(temp)) as env:
        for round_number in range(args.rounds):
            baseline.append(uvloop.run(direct(args.streams, args.tokens, step_s)) / count * 1e6)
            plane.append(uvloop.run(over_nats(env["NATS_SERVER"], args.streams, args.tokens, step_s)) / count * 1e6)
            print(
                f"round {round_number + 1}/{args.rounds}: direct {baseline[-1]:.2f}, request plane {plane[-1]:.2f} µs"
            )
    direct_us, plane_us = statistics.median(baseline), statistics.median(plane)
    print(f"{args.streams} streams x {args.tokens} tokens, a step every {args.step_ms:g} ms; CPU per token (median):")
    print(f"  in one process   {direct_us:7.2f} µs")
    print(f"  request plane    {plane_us:7.2f} µs  ({plane_us / direct_us:.2f}x the one process)")
    print(f"  the request plane's own: {plane_us - direct_us:.2f} µs per token")


if __name__ == "__main__":
    main()
