"""Bursts on one worker: time to first token of N distinct prompts sent at once, Flotilla against Dynamo.

Each stack (bench/stacks.py) has one mocker worker at speed-up 1 (real simulated time: a 3000-token
prefill takes ~66 ms), round-robin routing. For each burst size in ``--sizes`` it sends that many
distinct ``--tokens``-token prompts at once (one connection each, opened beforehand), ``--rounds``
times with fresh prompts, and prints each burst's TTFTs in order. Next to them it prints what the
mocker's own model gives for the same burst in this process, with no HTTP, routing or request plane:
that is the floor a stack can reach, and the difference is what its serving path adds when requests
arrive together.

    .venv/bin/python bench/burst_ttft.py [--sizes 1,2,4,8] [--tokens 3000] [--rounds 2] [--stacks flotilla,dynamo]

(``--stacks flotilla``: Flotilla's side alone, where Dynamo is not installed.)

A diagnostic for issue 7: one request at a time the two paths differ by a few milliseconds
(bench/idle_latency.py), yet Flotilla's TTFT under the replayed trace is ~8% above Dynamo's.
"""

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

import uvloop
from stacks import STACK_NAMES, Stack, dynamo_stack, flotilla_stack, stack_names
from trace_replay import http_request, read_stream

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engines.mocker.config import MockerConfig
from engines.mocker.engine import MockerEngine
from runtime.engine import RequestContext
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions

MOCKER_SETTINGS: dict[str, Any] = {"speedup_ratio": 1.0, "block_size": 64, "num_gpu_blocks": 2048}
VOCABULARY = (100, 40000)
MAX_TOKENS = 32


def prompts(count: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*VOCABULARY) for _ in range(tokens)] for _ in range(count)]


async def stack_burst(stack: Stack, batch: list[list[int]]) -> list[float]:
    """TTFT of each prompt of ``batch``, all sent at once, on connections opened beforehand (sorted)."""
    connections = [await asyncio.open_connection("127.0.0.1", stack.port) for _ in batch]
    requests = []
    for prompt in batch:
        body: dict[str, Any] = {"model": stack.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True}
        requests.append(http_request(stack.port, "/v1/completions", body | {"ignore_eos": True}, keep_alive=True))
    try:
        results = await asyncio.gather(
            *(
                read_stream(reader, writer, request)
                for (reader, writer), request in zip(connections, requests, strict=True)
            )
        )
    finally:
        for _, writer in connections:
            writer.close()
    for result in results:
        if result.error is not None or not result.token_times:
            raise RuntimeError(f"{stack.name}: a request failed: {result.error or 'no text'}")
    return sorted(result.token_times[0] - result.sent for result in results)


async def model_burst(batch: list[list[int]]) -> list[float]:
    """The same burst through the mocker engine in this process: the simulated times alone (sorted)."""
    engine = MockerEngine(MockerConfig(**MOCKER_SETTINGS), vocab_size=VOCABULARY[1])
    await engine.start()
    try:

        async def first_token(number: int, prompt: list[int]) -> float:
            request = PreprocessedRequest(
                request_id=f"burst-{number}",
                model="mocker",
                token_ids=prompt,
                sampling=SamplingOptions(),
                stop_conditions=StopConditions(max_tokens=MAX_TOKENS),
                eos_token_ids=[],
            )
            start = time.perf_counter()
            async for _ in engine.generate(request, RequestContext(request.request_id)):
                return time.perf_counter() - start
            raise RuntimeError("the mocker produced nothing")

        return sorted(await asyncio.gather(*(first_token(n, prompt) for n, prompt in enumerate(batch))))
    finally:
        await engine.close()


def show(label: str, times: list[float]) -> None:
    print(f"  {label:<10}" + " ".join(f"{seconds * 1000:6.0f}" for seconds in times), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,2,4,8", help="burst sizes, comma-separated")
    parser.add_argument("--tokens", type=int, default=3000, help="tokens per prompt")
    parser.add_argument("--rounds", type=int, default=2, help="bursts of each size per stack")
    parser.add_argument(
        "--stacks", type=stack_names, default=list(STACK_NAMES), help="e.g. flotilla (default: flotilla,dynamo)"
    )
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    batches = {
        (size, round_): prompts(size, args.tokens, seed=size * 100 + round_)
        for size in sizes
        for round_ in range(args.rounds)
    }
    measured: dict[str, dict[tuple[int, int], list[float]]] = {}
    makers = {"flotilla": flotilla_stack, "dynamo": dynamo_stack}
    for name in args.stacks:
        with makers[name](workers=1, mocker_settings=MOCKER_SETTINGS, router_mode="round-robin") as stack:
            uvloop.run(stack_burst(stack, prompts(2, args.tokens, seed=1)))  # warm-up, not counted
            measured[name] = {key: uvloop.run(stack_burst(stack, batch)) for key, batch in batches.items()}
    print(f"TTFT ms of bursts of distinct {args.tokens}-token prompts on one mocker worker (speed-up 1), sorted:")
    for key, batch in batches.items():
        print(f"burst of {key[0]}, round {key[1] + 1}:")
        show("model", uvloop.run(model_burst(batch)))
        for name in args.stacks:
            show(name, measured[name][key])


if __name__ == "__main__":
    main()
