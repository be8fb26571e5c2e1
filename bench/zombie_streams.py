"""Zombie streams: an ingress SIGKILLed with many streams in flight, and the tokens its workers generate for nobody.

Starts nats-server on a free loopback port and a mocker worker in this process (an ``EndpointServer``
over the mocker engine, real time by default: ``--speedup 1``, room for every stream at once), then an
ingress in a child process (a ``RequestClient`` that opens ``--streams`` streams of ``--max-tokens``
tokens and reads them). Once every stream has its first tokens and has streamed for ``--settle`` s,
the child is SIGKILLed: no Stop, no ack, its socket gone, as an ingress that crashes or is OOM-killed.
The worker counts the tokens each request generates from then on, and when each one stops.

    .venv/bin/python bench/zombie_streams.py [--streams 1000] [--max-tokens 2000] [--deadline 5] [--speedup 1]

Prints the tokens generated for nobody after the kill, against what the same streams still had to
generate to ``max_tokens`` at the kill (the baseline, from the same run: what a worker without the ack
deadline generated, since only a Stop ended a stream early), and the time from the kill until the
worker had stopped every stream, against the deadline (``--deadline``, FLOTILLA_STREAM_ACK_DEADLINE_S).
A stream's deadline counts from when its window filled with no word from the client (no ack, no
probe naming it), so the last stream stops a little after the deadline: the window's fill plus up
to a quarter of the deadline (the worker checks four times per deadline).
"""

import argparse
import asyncio
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

from engines.mocker.config import MockerConfig  # noqa: E402
from engines.mocker.engine import MockerEngine  # noqa: E402
from runtime.cluster.nats_connection import connect_nats  # noqa: E402
from runtime.engine import RequestContext  # noqa: E402
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions  # noqa: E402
from runtime.request_plane import EndpointServer, RequestClient  # noqa: E402

SUBJECT = "bench.zombies.generate.1"
PROMPT = 64
BLOCK = 64


class Counted:
    """The mocker engine behind a bytes handler that counts each request's tokens and notes how it ended."""

    def __init__(self, engine: MockerEngine, streams: int) -> None:
        self.engine = engine
        self.tokens: dict[str, int] = {}
        self.ended_at: dict[str, float] = {}
        self.aborted: dict[str, bool] = {}
        self.streams = streams
        self.all_ended = asyncio.Event()
        self._decode = msgspec.msgpack.Decoder(PreprocessedRequest).decode
        self._encode = msgspec.msgpack.Encoder().encode

    async def handler(self, payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
        request_id = context.request_id
        self.tokens[request_id] = 0
        try:
            async for output in self.engine.generate(self._decode(payload), context):
                self.tokens[request_id] += len(output.token_ids)
                yield self._encode(output)
        finally:
            self.ended_at[request_id] = time.monotonic()
            self.aborted[request_id] = context.stopped
            if len(self.ended_at) == self.streams:
                self.all_ended.set()


def request(number: int, max_tokens: int) -> bytes:
    prompt = [1000 + (number * PROMPT + offset) % 40000 for offset in range(PROMPT)]  # no shared prefix
    return msgspec.msgpack.encode(
        PreprocessedRequest(
            request_id=f"z{number}",
            model="mocker",
            token_ids=prompt,
            sampling=SamplingOptions(),
            stop_conditions=StopConditions(max_tokens=max_tokens),
        )
    )


async def ingress(arguments: argparse.Namespace) -> None:
    """The child: open every stream, say 'ready' once each has its first tokens, read until killed."""
    nc = await connect_nats(arguments.client, name="bench ingress")
    client = RequestClient(nc)
    await client.start()
    started = 0

    async def one(number: int) -> None:
        nonlocal started
        stream = client.call(SUBJECT, f"z{number}", request(number, arguments.max_tokens))
        await anext(stream)
        started += 1
        if started == arguments.streams:
            print("ready", flush=True)
        async for _ in stream:
            pass

    await asyncio.gather(*(one(number) for number in range(arguments.streams)))
    print("finished before the kill: raise --max-tokens", flush=True)


async def run(arguments: argparse.Namespace) -> None:
    streams, max_tokens, deadline = arguments.streams, arguments.max_tokens, arguments.deadline
    blocks = streams * (-(-(PROMPT + max_tokens) // BLOCK) + 1)
    config = MockerConfig(
        speedup_ratio=arguments.speedup, max_num_seqs=streams, num_gpu_blocks=blocks, block_size=BLOCK
    )
    engine = MockerEngine(config, vocab_size=49152)
    await engine.start()
    counted = Counted(engine, streams)
    with tempfile.TemporaryDirectory(prefix="zombies-") as directory, nats_server(Path(directory)) as nats_port:
        url = f"nats://127.0.0.1:{nats_port}"
        worker = await connect_nats(url, name="bench worker")
        server = EndpointServer(worker, SUBJECT, counted.handler, ack_deadline=deadline)
        await server.start()
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--client",
            url,
            "--streams",
            str(streams),
            "--max-tokens",
            str(max_tokens),
            stdout=subprocess.PIPE,
        )
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), 600)
        if line.strip() != b"ready":
            raise SystemExit(f"the ingress said {line!r}")
        await asyncio.sleep(arguments.settle)
        at_kill = dict(counted.tokens)
        killed = time.monotonic()
        child.send_signal(signal.SIGKILL)
        await child.wait()
        try:
            await asyncio.wait_for(counted.all_ended.wait(), deadline * 4 + 60)
        except TimeoutError:
            print(
                f"  {streams - len(counted.ended_at)} stream(s) still generating {deadline * 4 + 60:g} s after the kill"
            )
        await server.close()
        await worker.close()
    await engine.close()

    ended = [request_id for request_id in at_kill if counted.ended_at.get(request_id, 0) > killed]
    after = sum(counted.tokens[request_id] - at_kill[request_id] for request_id in at_kill)
    baseline = sum(max_tokens - tokens for tokens in at_kill.values())
    stops = [counted.ended_at[request_id] - killed for request_id in ended]
    aborted = sum(counted.aborted[request_id] for request_id in ended)
    print(
        f"{streams} streams x {max_tokens} tokens, mocker speedup {arguments.speedup:g}, "
        f"ack deadline {deadline:g} s, ingress SIGKILLed after {arguments.settle:g} s of streaming"
    )
    before = sum(at_kill.values())
    print(f"  generated before the kill: {before} tokens ({before / streams:.0f} per stream)")
    print(
        f"  generated for nobody after the kill: {after} tokens ({after / streams:.0f} per stream), "
        f"vs {baseline} still to come to max_tokens (without the deadline): {after / baseline:.3f} of it"
    )
    if stops:
        print(
            f"  streams stopped after the kill: {len(stops)} of {streams} ({aborted} aborted, the rest finished), "
            f"p50 {percentile(stops, 50):.2f} s, last {max(stops):.2f} s = {max(stops) / deadline:.2f} x the deadline"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--deadline", type=float, default=5.0, help="the worker's ack deadline (seconds)")
    parser.add_argument("--speedup", type=float, default=1.0, help="the mocker's speed-up over real time")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds of streaming before the kill")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # the child: NATS URL
    arguments = parser.parse_args()
    uvloop.run(ingress(arguments) if arguments.client else run(arguments))


if __name__ == "__main__":
    main()
