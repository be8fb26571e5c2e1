"""The serving path's own latency: time to first token of one request at a time, Flotilla against Dynamo.

Each stack (bench/stacks.py) is an ingress and ``--workers`` mocker workers at speed-up 1000, so the
engine's simulated time is ~nothing and what is left is the path: HTTP, pre-processing, routing, the
request plane to the worker, the worker's own bookkeeping, and back. Requests are streamed token-id
``/v1/completions`` (``max_tokens`` 4, ``ignore_eos``) of ``--short`` and ``--long`` prompt tokens, fresh
random ids each (no cache hits), sent one after the other on one keep-alive connection; the first
``--warmup`` of each size are not counted. The stacks take turns for ``--rounds`` rounds, each on a
fresh stack, and the client is this process.

    .venv/bin/python bench/idle_latency.py [--requests 150] [--rounds 2] [--router kv] [--short 64] [--long 4500]
        [--stacks flotilla,dynamo]

Prints TTFT p50/p90 per stack and prompt size, and the ratio Flotilla/Dynamo (``--stacks flotilla``
runs Flotilla's side alone, without the ratio: where Dynamo is not installed). It explains where a TTFT
gap under load does *not* come from: a path that is slower one request at a time.
"""

import argparse
import asyncio
import random
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import uvloop
from _common import percentile
from stacks import ROUTER_MODES, STACK_NAMES, Stack, dynamo_stack, flotilla_stack, stack_names
from trace_replay import http_request, read_stream

MOCKER_SETTINGS = {"speedup_ratio": 1000.0, "block_size": 64, "num_gpu_blocks": 2048}
VOCABULARY = (100, 40000)  # ordinary token ids of SmolLM2's vocabulary


async def first_token_times(stack: Stack, tokens: int, requests: int, seed: int) -> list[float]:
    """Seconds to the first chunk with text, of ``requests`` sequential requests of ``tokens`` fresh ids."""
    rng = random.Random(seed)
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.port)
    times = []
    try:
        for _ in range(requests):
            body: dict[str, Any] = {
                "model": stack.model,
                "prompt": [rng.randrange(*VOCABULARY) for _ in range(tokens)],
                "max_tokens": 4,
                "stream": True,
                "ignore_eos": True,
                **stack.worker_fields,
            }
            result = await read_stream(
                reader, writer, http_request(stack.port, "/v1/completions", body, keep_alive=True)
            )
            if result.error is not None or not result.token_times:
                raise RuntimeError(f"{stack.name}: a request failed: {result.error or 'no text'}")
            times.append(result.token_times[0] - result.sent)
    finally:
        writer.close()
    return times


def stacks(args: argparse.Namespace) -> Iterator[tuple[str, Callable[[], AbstractContextManager[Stack]]]]:
    """The stacks in turn, alternating which goes first, ``--rounds`` times."""
    makers = {
        "flotilla": lambda: flotilla_stack(
            workers=args.workers, mocker_settings=MOCKER_SETTINGS, router_mode=args.router
        ),
        "dynamo": lambda: dynamo_stack(workers=args.workers, mocker_settings=MOCKER_SETTINGS, router_mode=args.router),
    }
    for round_number in range(args.rounds):
        order = args.stacks if round_number % 2 == 0 else args.stacks[::-1]
        for name in order:
            yield name, makers[name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=150, help="requests per prompt size per round")
    parser.add_argument("--warmup", type=int, default=20, help="first requests of each size not counted")
    parser.add_argument("--rounds", type=int, default=2, help="fresh stacks per side, alternating")
    parser.add_argument("--workers", type=int, default=2, help="mocker workers per stack")
    parser.add_argument("--router", choices=ROUTER_MODES, default="kv", help="both stacks' routing")
    parser.add_argument("--short", type=int, default=64, help="tokens of the short prompts")
    parser.add_argument("--long", type=int, default=4500, help="tokens of the long prompts")
    parser.add_argument(
        "--stacks", type=stack_names, default=list(STACK_NAMES), help="e.g. flotilla (default: flotilla,dynamo)"
    )
    args = parser.parse_args()
    if args.requests <= args.warmup:
        parser.error("--requests must be more than --warmup")

    ttfts: dict[tuple[str, int], list[float]] = defaultdict(list)
    for name, make in stacks(args):
        with make() as stack:
            for tokens in (args.short, args.long):
                times = uvloop.run(first_token_times(stack, tokens, args.requests, seed=tokens))
                ttfts[name, tokens] += times[args.warmup :]
    print(f"one request at a time, {args.workers} mockers at speed-up 1000, {args.router} routing:")
    print(f"{'stack':<10}{'prompt tokens':>14}{'TTFT p50 ms':>13}{'p90 ms':>9}{'n':>6}")
    medians = {}
    for (name, tokens), times in sorted(ttfts.items()):
        medians[name, tokens] = statistics.median(times) * 1000
        p90 = percentile(times, 90) * 1000
        print(f"{name:<10}{tokens:>14}{medians[name, tokens]:>13.2f}{p90:>9.2f}{len(times):>6}")
    if len(args.stacks) < len(STACK_NAMES):
        return
    for tokens in (args.short, args.long):
        ratio = medians["flotilla", tokens] / medians["dynamo", tokens]
        print(f"Flotilla / Dynamo TTFT p50 at {tokens} tokens: {ratio:.2f}")


if __name__ == "__main__":
    main()
