"""What a request costs the mocker worker in CPU: the engine's step loop and the worker's encoding.

Runs the mocker engine in this process (no NATS: what the request plane adds is measured by
bench/network_path.py) and sends it requests of ``--prompt`` tokens for ``--tokens`` tokens each,
``--concurrency`` at a time, at ``--speedup`` (1000 by default), reading each stream as a worker
does: every output encoded as msgpack (launcher/inputs/dyn.py's handler). Prints the process CPU time
per request and per output token, in microseconds. The target: well under 300 µs for a 32-token
request at speedup 1000.

    .venv/bin/python bench/mocker_cost.py [--requests 4000] [--concurrency 32] [--tokens 32] [--dp 1]
"""

import argparse
import asyncio
import itertools
import sys
import time
from pathlib import Path

import msgspec
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engines.mocker.config import MockerConfig  # noqa: E402
from engines.mocker.engine import MockerEngine  # noqa: E402
from launcher.inputs.dyn import engine_handler  # noqa: E402
from runtime.engine import RequestContext  # noqa: E402
from runtime.kv.events import KvEvent  # noqa: E402
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions  # noqa: E402


class _Sink:
    """Counts KV events as the worker's publisher would take them (batching is not measured here)."""

    def __init__(self) -> None:
        self.events = 0

    def publish(self, dp_rank: int, events: list[KvEvent]) -> None:
        self.events += len(events)


async def run(arguments: argparse.Namespace) -> None:
    config = MockerConfig(speedup_ratio=arguments.speedup, dp_size=arguments.dp)
    engine = MockerEngine(config, vocab_size=49152)
    sink = _Sink()
    engine.attach_kv_events(sink)
    await engine.start()
    handler = engine_handler(engine)
    encode = msgspec.msgpack.Encoder().encode
    numbers = itertools.count()
    # A shared system prompt and a per-request tail, as chat traffic has.
    shared = list(range(1000, 1000 + arguments.prompt // 2))
    tokens_out = 0

    async def client() -> None:
        nonlocal tokens_out
        while (number := next(numbers)) < arguments.requests:
            tail = [5000 + (number * 7919 + offset) % 40000 for offset in range(arguments.prompt - len(shared))]
            request = PreprocessedRequest(
                request_id=f"bench-{number}",
                model="mocker",
                token_ids=shared + tail,
                sampling=SamplingOptions(),
                stop_conditions=StopConditions(max_tokens=arguments.tokens),
            )
            payload = msgspec.Raw(encode(request))
            async for frame in handler(payload, RequestContext(request.request_id)):
                tokens_out += len(frame) > 0
        return None

    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client() for _ in range(arguments.concurrency)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    await engine.close()
    total_tokens = arguments.requests * arguments.tokens
    print(
        f"{arguments.requests} requests x {arguments.tokens} tokens (prompt {arguments.prompt}), "
        f"concurrency {arguments.concurrency}, speedup {arguments.speedup:g}, dp {arguments.dp}"
    )
    print(f"  wall {wall:.2f} s, {arguments.requests / wall:.0f} req/s, CPU {cpu:.2f} s")
    print(f"  CPU per request: {cpu / arguments.requests * 1e6:.0f} µs")
    print(f"  CPU per output token: {cpu / total_tokens * 1e6:.1f} µs ({tokens_out} outputs encoded)")
    print(f"  KV events: {sink.events}, prefix hit rate: {engine.load()[0].prefix_hit_rate}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--speedup", type=float, default=1000.0)
    parser.add_argument("--dp", type=int, default=1, help="dp ranks")
    uvloop.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
