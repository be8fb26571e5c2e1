"""The load ``flotilla profile`` puts on a token engine, in this process, and the sweep over concurrency.

Requests go straight to the engine's ``generate`` (no HTTP, no templating): what is measured is the
engine, as a worker serves it. Prompts are random token ids, a fresh draw for every request, so no two
share a prefix and a prefix cache finds nothing (``cached_tokens`` stays 0). Outputs ignore EOS, so every
request runs to its ``max_tokens``.
"""

import asyncio
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from launcher.profile_sweep import (
    Arrivals,
    Phase,
    Point,
    Shortfall,
    TimeScale,
    best_point,
    concurrency_levels,
    decode_point,
    decode_shape,
    prefill_point,
    shortfall,
)
from runtime.engine import RequestContext, TokenEngine
from runtime.errors import EngineError
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions

#: Requests each prefill client sends back to back at a point: enough for a percentile over a few rounds
#: at concurrency 1, few enough that the sweep stays short.
PREFILL_ROUNDS = 4
#: Output tokens of a decode request (fewer for a context shorter than this: decode_shape).
DECODE_TOKENS = 256


@dataclass
class Sweep:
    """What the sweep measured, per phase and length, in the order it measured them."""

    prefill: dict[int, list[Point]] = field(default_factory=dict)
    decode: dict[int, list[Point]] = field(default_factory=dict)

    def chosen(self, phase: Phase, target_s: float) -> list[Point]:
        """Per length, the point a profile keeps (lengths without one are left out)."""
        points = self.prefill if phase == "prefill" else self.decode
        return [best for best in (best_point(measured, target_s) for measured in points.values()) if best]

    def shortfalls(self, ttft_target_s: float, itl_target_s: float) -> list[Shortfall]:
        """Every length at which no point met its target."""
        found = [shortfall(points, "prefill", isl, ttft_target_s) for isl, points in self.prefill.items()]
        found += [shortfall(points, "decode", context, itl_target_s) for context, points in self.decode.items()]
        return [one for one in found if one is not None]


class Prompts:
    """Distinct random prompts of token ids below ``vocab_size`` (seeded: a rerun sends the same load)."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self._random = random.Random(seed)
        # Ids from the top half of the vocabulary: the low ids are where tokenizers keep special tokens.
        self._low = vocab_size // 2
        self._high = vocab_size - 1
        self._numbers = itertools.count()

    def request(self, length: int, max_tokens: int) -> PreprocessedRequest:
        return PreprocessedRequest(
            request_id=f"profile-{next(self._numbers)}",
            model="profile",
            token_ids=self._random.choices(range(self._low, self._high), k=length),
            sampling=SamplingOptions(temperature=0.0),
            stop_conditions=StopConditions(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True),
        )


async def _stream(engine: TokenEngine, request: PreprocessedRequest) -> list[tuple[float, int]]:
    """The request's outputs as they arrived: (``perf_counter`` time, tokens), empty outputs left out."""
    arrivals: list[tuple[float, int]] = []
    clock = time.perf_counter
    async for output in engine.generate(request, RequestContext(request.request_id)):
        if output.token_ids:
            arrivals.append((clock(), len(output.token_ids)))
    if not arrivals:
        raise EngineError(f"the engine ended request {request.request_id} without a token")
    return arrivals


async def warm_up(engine: TokenEngine, prompts: Prompts, length: int) -> None:
    """Send a few unmeasured requests first: an engine's first requests pay one-time costs (the mocker's
    first step, a GPU engine's kernel compilation and graph capture) that a point must not count."""
    async with asyncio.TaskGroup() as group:
        for _ in range(2):
            group.create_task(_stream(engine, prompts.request(length, 8)))


async def measure_prefill(
    engine: TokenEngine, prompts: Prompts, isl: int, concurrency: int, *, percent: float, scale: TimeScale
) -> Point:
    """``concurrency`` clients each send PREFILL_ROUNDS one-token requests of ``isl`` prompt tokens in turn."""
    ttfts: list[float] = []
    # Drawn before the clock starts: at a high speed-up, drawing a prompt between two requests would
    # take a visible share of the engine's (scaled) time.
    requests = [[prompts.request(isl, 1) for _ in range(PREFILL_ROUNDS)] for _ in range(concurrency)]

    async def client(mine: list[PreprocessedRequest]) -> None:
        for request in mine:
            sent = time.perf_counter()
            arrivals = await _stream(engine, request)
            ttfts.append(arrivals[0][0] - sent)

    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for mine in requests:
            group.create_task(client(mine))
    return prefill_point(isl, concurrency, ttfts, time.perf_counter() - started, percent=percent, scale=scale)


async def measure_decode(
    engine: TokenEngine, prompts: Prompts, context: int, concurrency: int, *, percent: float, scale: TimeScale
) -> Point:
    """One wave of ``concurrency`` requests whose mean context while decoding is ``context`` tokens."""
    prompt_tokens, output_tokens = decode_shape(context, DECODE_TOKENS)
    requests = [prompts.request(prompt_tokens, output_tokens) for _ in range(concurrency)]
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(_stream(engine, request)) for request in requests]
    streams: list[Arrivals] = [task.result() for task in tasks]
    return decode_point(context, concurrency, streams, percent=percent, scale=scale)


async def sweep_lengths(
    engine: TokenEngine,
    prompts: Prompts,
    phase: Phase,
    lengths: list[int],
    *,
    max_concurrency: int,
    target_s: float,
    percent: float,
    scale: TimeScale,
    report: Callable[[Point, bool], None],
) -> dict[int, list[Point]]:
    """For each length, the points at doubling concurrency, up to ``max_concurrency``.

    A length's sweep stops at the first point over ``target_s``: more requests at once only queue longer
    for the same engine. ``report`` is called with each point as it is measured (and whether it met the
    target). Raises what the engine raises (EngineError).
    """
    measure = measure_prefill if phase == "prefill" else measure_decode
    measured: dict[int, list[Point]] = {}
    for length in lengths:
        points = measured.setdefault(length, [])
        for concurrency in concurrency_levels(max_concurrency):
            point = await measure(engine, prompts, length, concurrency, percent=percent, scale=scale)
            points.append(point)
            met = point.meets(target_s)
            report(point, met)
            if not met:
                break
    return measured
