"""A worker's NATS connection that drops for half a second under many streams: the errors its clients see.

Starts nats-server on a free loopback port, a TCP relay in front of it (a child process) and a mocker
worker (a child process: an ``EndpointServer`` over the mocker engine, real time by default, room for
every stream at once) that reaches NATS only through the relay. An ingress in this process (a
``RequestClient`` built as the gateway builds it, from the ``FLOTILLA_STREAM_*`` settings) opens
``--streams`` streams of ``--max-tokens`` tokens. Once every stream has its first tokens and has streamed
for ``--settle`` s, the relay resets every connection and refuses new ones for ``--blip`` s: the worker
is cut off from NATS, then reconnects (nats-py's own reconnection, every 0.5 s). Each stream is read to
its end, and the worker reports the tokens it generated once its last request has ended.

``--repeat`` blips per setting, alternated, each with a fresh worker: the ingress's ``gone_after`` at 0
(as ``FLOTILLA_STREAM_GONE_AFTER_S=0``: the first probe answered "no responders" cuts the worker's
streams, the behaviour before the probe fix), and at its setting (``FLOTILLA_STREAM_GONE_AFTER_S``, 1 s by
default: only such answers back to back for that long do). The frames the reset loses on their way are
sent again by the worker once it has reconnected, whatever the setting (that has no switch: compare with
the tree before it). At the default ``--migration-limit 0`` every broken stream is an error to its client.

    .venv/bin/python bench/nats_blip.py [--streams 500] [--max-tokens 300] [--blip 0.5] [--settle 2]

Prints, per round: the client errors (by kind), the streams completed, the tokens the clients received
against what they asked for, the tokens the worker generated (those past what was received went to
nobody), and when the worker was back on NATS after the cut.
"""

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import uvloop
from _common import free_port, nats_server

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engines.mocker.config import MockerConfig  # noqa: E402
from engines.mocker.engine import MockerEngine  # noqa: E402
from runtime.cluster.nats_connection import connect_nats  # noqa: E402
from runtime.engine import RequestContext  # noqa: E402
from runtime.protocol import EngineOutput, PreprocessedRequest, SamplingOptions, StopConditions  # noqa: E402
from runtime.request_plane import EndpointServer, RequestClient, StreamBroken  # noqa: E402
from runtime.settings import (  # noqa: E402
    stream_ack_deadline_seconds,
    stream_gone_after_seconds,
    stream_progress_deadline_seconds,
    stream_silence_seconds,
)

SUBJECT = "bench.blip.generate.1"
PROMPT = 64
BLOCK = 64


# -- the relay (a child process) ---------------------------------------------------------------------------


class Relay:
    """A TCP relay to nats-server; SIGUSR1 resets every connection and refuses new ones for ``blip_s``."""

    def __init__(self, upstream_port: int, blip_s: float) -> None:
        self.upstream_port = upstream_port
        self.blip_s = blip_s
        self._writers: set[asyncio.StreamWriter] = set()
        self._refusing = False

    async def serve(self, port: int) -> None:
        server = await asyncio.start_server(self._relay, "127.0.0.1", port)
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, lambda: asyncio.ensure_future(self._blip()))
        print("ready", flush=True)
        async with server:
            await server.serve_forever()

    async def _blip(self) -> None:
        self._refusing = True
        for writer in list(self._writers):
            writer.transport.abort()  # a reset, as a cable pulled out looks once noticed
        self._writers.clear()
        await asyncio.sleep(self.blip_s)
        self._refusing = False

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._writers |= {writer, up_writer}

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


# -- the worker (a child process) ----------------------------------------------------------------------------


class Counted:
    """The mocker engine behind a bytes handler that counts the tokens generated; says 'done' with the
    counts once ``streams`` requests have ended."""

    def __init__(self, engine: MockerEngine, streams: int) -> None:
        self.engine = engine
        self.streams = streams
        self.tokens = 0
        self.ended = 0
        self.aborted = 0
        self._decode = msgspec.msgpack.Decoder(PreprocessedRequest).decode
        self._encode = msgspec.msgpack.Encoder().encode

    async def handler(self, payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
        try:
            async for output in self.engine.generate(self._decode(payload), context):
                self.tokens += len(output.token_ids)
                yield self._encode(output)
        finally:
            self.ended += 1
            self.aborted += context.stopped
            if self.ended == self.streams:
                counts = {"tokens": self.tokens, "ended": self.ended, "aborted": self.aborted}
                print("done", json.dumps(counts), flush=True)


async def worker(arguments: argparse.Namespace) -> None:
    streams, max_tokens = arguments.streams, arguments.max_tokens
    blocks = streams * (-(-(PROMPT + max_tokens) // BLOCK) + 1)
    config = MockerConfig(
        speedup_ratio=arguments.speedup, max_num_seqs=streams, num_gpu_blocks=blocks, block_size=BLOCK
    )
    engine = MockerEngine(config, vocab_size=49152)
    await engine.start()
    counted = Counted(engine, streams)

    async def on_event(kind: str) -> None:
        print(kind, time.monotonic(), flush=True)  # CLOCK_MONOTONIC: the same clock as the parent's

    nc = await connect_nats(arguments.serve, name="bench worker", on_event=on_event)
    server = EndpointServer(nc, SUBJECT, counted.handler, ack_deadline=stream_ack_deadline_seconds())
    await server.start()
    print("ready", flush=True)
    await asyncio.Event().wait()


# -- the ingress (this process) ------------------------------------------------------------------------------


def request(number: int, max_tokens: int) -> bytes:
    prompt = [1000 + (number * PROMPT + offset) % 40000 for offset in range(PROMPT)]  # no shared prefix
    return msgspec.msgpack.encode(
        PreprocessedRequest(
            request_id=f"b{number}",
            model="mocker",
            token_ids=prompt,
            sampling=SamplingOptions(),
            stop_conditions=StopConditions(max_tokens=max_tokens),
        )
    )


@dataclass
class Round:
    """What one round saw."""

    gone_after: float
    errors: Counter[str] = field(default_factory=Counter)
    example: dict[str, str] = field(default_factory=dict)  # the first message of each kind of error
    completed: int = 0
    received: int = 0
    generated: int | None = None
    worker_aborted: int | None = None
    back_after: float | None = None


async def _child(arguments: list[str]) -> asyncio.subprocess.Process:
    child = await asyncio.create_subprocess_exec(sys.executable, __file__, *arguments, stdout=subprocess.PIPE)
    assert child.stdout is not None
    line = await asyncio.wait_for(child.stdout.readline(), 120)
    if line.strip() != b"ready":
        raise SystemExit(f"a child process said {line!r} instead of 'ready'")
    return child


async def one_round(
    arguments: argparse.Namespace, nats_url: str, relay_url: str, relay: int, gone_after: float
) -> Round:
    result = Round(gone_after)
    child = await _child(
        ["--serve", relay_url, "--streams", str(arguments.streams), "--max-tokens", str(arguments.max_tokens),
         "--speedup", str(arguments.speedup)]
    )  # fmt: skip
    assert child.stdout is not None
    done: asyncio.Future[dict[str, int]] = asyncio.get_running_loop().create_future()
    cut_at = 0.0

    async def worker_says() -> None:
        assert child.stdout is not None
        while line := (await child.stdout.readline()).decode():
            word, _, rest = line.strip().partition(" ")
            if word == "reconnected" and result.back_after is None and cut_at:
                result.back_after = float(rest) - cut_at
            elif word == "done" and not done.done():
                done.set_result(json.loads(rest))

    listening = asyncio.create_task(worker_says())
    nc = await connect_nats(nats_url, name="bench ingress")
    client = RequestClient(
        nc,
        silence_timeout=stream_silence_seconds(),
        gone_after=gone_after,
        progress_deadline=stream_progress_deadline_seconds(),
    )
    await client.start()
    decode = msgspec.msgpack.Decoder(EngineOutput).decode
    started = 0
    all_started = asyncio.Event()

    async def one(number: int) -> None:
        nonlocal started
        first = True
        try:
            async for frame in client.call(SUBJECT, f"b{number}", request(number, arguments.max_tokens)):
                result.received += sum(len(decode(payload).token_ids) for payload in frame)
                if first:
                    first = False
                    started += 1
                    if started == arguments.streams:
                        all_started.set()
            result.completed += 1
        except Exception as exc:  # every kind of failure is a client error here: counted by kind
            why = f"{type(exc).__name__} ({exc.cause})" if isinstance(exc, StreamBroken) else type(exc).__name__
            result.errors[why] += 1
            result.example.setdefault(why, str(exc))
            if first:
                started += 1
                if started == arguments.streams:
                    all_started.set()

    readers = [asyncio.create_task(one(number)) for number in range(arguments.streams)]
    await asyncio.wait_for(all_started.wait(), 300)
    await asyncio.sleep(arguments.settle)
    if all(reader.done() for reader in readers):
        raise SystemExit("every stream ended before the blip: raise --max-tokens")
    cut_at = time.monotonic()
    os.kill(relay, signal.SIGUSR1)
    await asyncio.gather(*readers)
    try:
        counts = await asyncio.wait_for(asyncio.shield(done), stream_ack_deadline_seconds() * 4 + 60)
        result.generated, result.worker_aborted = counts["tokens"], counts["aborted"]
    except TimeoutError:
        pass
    await client.close()
    await nc.close()
    child.kill()
    await child.wait()
    listening.cancel()
    return result


def report(arguments: argparse.Namespace, result: Round) -> None:
    asked = arguments.streams * arguments.max_tokens
    kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(result.errors.items())) or "none"
    print(f"  gone_after {result.gone_after:g} s:")
    print(f"    client errors: {sum(result.errors.values())} of {arguments.streams} ({kinds})")
    for kind, message in sorted(result.example.items()):
        print(f"      e.g. {kind}: {message}")
    print(f"    streams completed: {result.completed} of {arguments.streams}")
    print(f"    tokens received: {result.received} of {asked} asked ({result.received / asked:.3f})")
    if result.generated is not None:
        nobody = result.generated - result.received
        print(
            f"    tokens the worker generated: {result.generated} ({nobody} for nobody; "
            f"{result.worker_aborted} stream(s) stopped early on the worker)"
        )
    else:
        print("    the worker had not ended every stream in time: its tokens are unknown")
    back = "never seen" if result.back_after is None else f"{result.back_after:.2f} s after the cut"
    print(f"    worker back on NATS: {back}")


async def run(arguments: argparse.Namespace) -> None:
    settings = (0.0, stream_gone_after_seconds())
    rounds: list[Round] = []
    with tempfile.TemporaryDirectory(prefix="blip-") as directory, nats_server(Path(directory)) as nats_port:
        relay_port = free_port()
        relay = await _child(["--relay", str(nats_port), "--port", str(relay_port), "--blip", str(arguments.blip)])
        try:
            nats_url, relay_url = f"nats://127.0.0.1:{nats_port}", f"nats://127.0.0.1:{relay_port}"
            for _ in range(arguments.repeat):
                for gone_after in settings:  # alternated, so that both meet the same load on the machine
                    rounds.append(await one_round(arguments, nats_url, relay_url, relay.pid, gone_after))
        finally:
            relay.kill()
            await relay.wait()
    print(
        f"{arguments.streams} streams x {arguments.max_tokens} tokens, mocker speedup {arguments.speedup:g}, the "
        f"worker's NATS connection cut for {arguments.blip:g} s after {arguments.settle:g} s of streaming, "
        f"{arguments.repeat} blip(s) per setting"
    )
    for result in rounds:
        report(arguments, result)
    print("client errors per blip:")
    for gone_after in settings:
        label = "the probe fix off, FLOTILLA_STREAM_GONE_AFTER_S=0" if gone_after == 0 else "the probe fix on"
        errors = [sum(result.errors.values()) for result in rounds if result.gone_after == gone_after]
        clean = sum(count == 0 for count in errors)
        print(
            f"  gone_after {gone_after:g} s ({label}): {', '.join(map(str, errors))} of {arguments.streams} "
            f"(no error in {clean} of {len(errors)} blips)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--blip", type=float, default=0.5, help="seconds the worker's connection is down")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds of streaming before the blip")
    parser.add_argument("--speedup", type=float, default=1.0, help="the mocker's speed-up over real time")
    parser.add_argument("--repeat", type=int, default=3, help="blips per setting (each with a fresh worker)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the worker: NATS URL (the relay's)
    parser.add_argument("--relay", type=int, help=argparse.SUPPRESS)  # the relay: nats-server's port
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)  # the relay's own port
    arguments = parser.parse_args()
    if arguments.relay:
        uvloop.run(Relay(arguments.relay, arguments.blip).serve(arguments.port))
    elif arguments.serve:
        uvloop.run(worker(arguments))
    else:
        uvloop.run(run(arguments))


if __name__ == "__main__":
    main()
