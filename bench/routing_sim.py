"""The trace replay of trace_replay.py in simulated time: router settings compared without noise.

    .venv/bin/python bench/routing_sim.py [--queued-prefill-weights 1,0.5] [--weights 8] [--seeds 8]
                                          [--rate 56] [--trace FILE] [--mocker '{"scheduler": "v0"}']

A real replay (trace_replay.py) runs each stack's processes on the machine's two cores, so its
latencies move with whatever else the machine does. This script takes the same trace and the same 4
mockers and runs them in simulated time instead: Flotilla's own ``KvRouter`` decides, each worker is
the mocker's own ``Scheduler`` with its own step timing (engines/mocker), and a heap of timed events
stands for the network between them. A request reaches the router, is routed, reaches its worker; the
worker's KV events reach the router's index, its first token and its end reach the router's load
count, and its load report arrives once a second, each after a delay. Only the routing and the
simulated engine count: nothing here measures the serving path's own cost.

Even so, one run is not enough to compare two settings. Routing is chaotic: a notice that arrives a
millisecond earlier changes one decision, which changes the caches, which changes later decisions,
and a run's TTFT p50 moves by a few per cent. So every delay is drawn at random between 0.3 and 1.7
times its mean, and each setting runs with the same ``--seeds`` draws; the script prints the mean and
spread over the seeds, and each setting's mean as a ratio to the first setting's.
"""

import argparse
import asyncio
import heapq
import itertools
import json
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trace_replay import (
    DEFAULT_OVERLAP_WEIGHT,
    DEFAULT_RATE,
    MOCKER_SETTINGS,
    WORKERS,
    BlockTokens,
    TraceRequest,
    TrafficShape,
    generate_trace,
    load_trace,
)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engines.mocker.config import MockerConfig, parse_mocker_config  # noqa: E402
from engines.mocker.scheduler import Scheduler  # noqa: E402
from engines.mocker.scheduler import Sequence as MockerSequence  # noqa: E402
from engines.mocker.timing import StepTimer  # noqa: E402
from frontend_gateway.routing.kv_indexer import KvIndexer  # noqa: E402
from frontend_gateway.routing.kv_router import KvRouter  # noqa: E402
from frontend_gateway.routing.protocol import InstanceInfo, RouterMode, RouterSettings  # noqa: E402
from runtime.addressing import EndpointAddress  # noqa: E402
from runtime.errors import ConfigError  # noqa: E402
from runtime.kv_events import WorkerLoad  # noqa: E402
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions  # noqa: E402

TRACE_BLOCK_SIZE = 512  # trace_replay.py's default --trace-block-size
VOCAB_SIZE = 49152  # SmolLM2's, as in the real replay
REPORT_INTERVAL_S = 1.0  # workers publish their load once a second (runtime/load_metrics.py)


@dataclass(frozen=True)
class Delays:
    """Mean seconds between the parts, as a probe of the real replay measured them at p50."""

    to_router: float = 0.0015  # client -> the router's decision (HTTP, checks, hashing)
    to_worker: float = 0.0015  # decision -> the worker's scheduler (NATS)
    back: float = 0.002  # a step's end -> the router hears of the first token, or of the end
    events: float = 0.004  # a step's scheduling -> its KV events in the router's index (5 ms batches)


@dataclass(frozen=True)
class Outcome:
    ttft_p50_ms: float
    ttft_p99_ms: float
    hit_rate: float


class _NoStopping:
    """A request's stop flag: nobody goes away in a replay."""

    stopped = False


async def simulate(
    trace: Sequence[TraceRequest],
    prompts: Sequence[list[int]],
    settings: RouterSettings,
    *,
    mocker: MockerConfig,
    delays: Delays,
    jitter_seed: int,
) -> Outcome:
    """Replay ``trace`` through a KV router with ``settings`` and 4 mockers; delays drawn with ``jitter_seed``.

    A coroutine only because the router makes asyncio objects: nothing in it awaits until the end.
    """
    config = mocker
    block_size = config.block_size
    step_seconds = StepTimer(config).step_seconds
    now = 0.0
    router = KvRouter(
        settings,
        block_size=block_size,
        nc=None,  # type: ignore[arg-type]  # no NATS: what would come over it is handed to the router directly
        address=EndpointAddress("sim", "mocker", "generate"),
        clock=lambda: now,
    )
    assert isinstance(router.indexer, KvIndexer)
    instances = [InstanceInfo(number + 1, f"worker{number}") for number in range(WORKERS)]
    for instance in instances:
        # It asks the worker for its cache in a task, which close() cancels before it runs (caches start empty).
        router.instance_added(instance)
    schedulers = [Scheduler(config) for _ in instances]
    for scheduler in schedulers:
        scheduler.cache.record_events = True
    stepping = [False] * len(instances)
    rng = random.Random(jitter_seed)
    heap: list[tuple[float, int, str, Any]] = []
    order = itertools.count()

    def at(delay: float, kind: str, payload: Any) -> None:
        heapq.heappush(heap, (now + delay * rng.uniform(0.3, 1.7), next(order), kind, payload))

    def start_step(worker: int) -> None:
        scheduler = schedulers[worker]
        stepping[worker] = scheduler.has_work
        if not scheduler.has_work:
            return
        step = scheduler.schedule()
        if events := scheduler.cache.take_events():
            at(delays.events, "events", (worker, events))
        duration = step_seconds(step.prefill_chunks(), step.decodes(), scheduler.cache.usage) if step.scheduled else 0.0
        heapq.heappush(heap, (now + duration, next(order), "step", (worker, step)))

    start = trace[0].timestamp
    for index, request in enumerate(trace):
        heapq.heappush(heap, ((request.timestamp - start) / 1000 + delays.to_router, next(order), "route", index))
    for worker in range(len(instances)):
        heapq.heappush(heap, (worker * REPORT_INTERVAL_S / len(instances), next(order), "report", worker))
    ttft: dict[int, float] = {}
    cached = 0
    while heap:
        now, _, kind, payload = heapq.heappop(heap)
        if kind == "route":
            index = payload
            routed = PreprocessedRequest(
                request_id=str(index),
                model="sim",
                token_ids=prompts[index],
                sampling=SamplingOptions(),
                stop_conditions=StopConditions(max_tokens=trace[index].output_length),
            )
            decision = router.choose(routed, instances)
            assert decision is not None
            at(delays.to_worker, "arrive", (index, decision.instance.instance_id - 1))
        elif kind == "arrive":
            index, worker = payload
            sequence = MockerSequence(
                str(index),
                prompts[index],
                trace[index].output_length,
                seed=index,
                vocab_size=VOCAB_SIZE,
                stop=_NoStopping(),
            )
            schedulers[worker].add(sequence)
            if not stepping[worker]:
                start_step(worker)
        elif kind == "step":
            worker, step = payload
            for sequence in schedulers[worker].complete(step):
                index = int(sequence.request_id)
                if index not in ttft and sequence.outbox:
                    ttft[index] = now + delays.back - (trace[index].timestamp - start) / 1000
                    cached += sequence.cached_tokens or 0
                    at(delays.back, "prefill_done", sequence.request_id)
                sequence.outbox = []
                if sequence.done:
                    at(delays.back, "finished", sequence.request_id)
            start_step(worker)
        elif kind == "events":
            worker, events = payload
            router.indexer.apply((worker + 1, 0), events)
        elif kind == "prefill_done":
            router.prefill_done(payload)
        elif kind == "finished":
            router.finished(payload)
        elif kind == "report":
            cache = schedulers[payload].cache
            router.load.observe(
                WorkerLoad(instance_id=payload + 1, active_requests=0, kv_active_blocks=cache.active_blocks)
            )
            if len(ttft) < len(trace) or any(stepping):
                heapq.heappush(heap, (now + REPORT_INTERVAL_S, next(order), "report", payload))
    await router.close()
    times = sorted(ttft.values())
    return Outcome(
        ttft_p50_ms=times[len(times) // 2] * 1000,
        ttft_p99_ms=times[int(0.99 * (len(times) - 1))] * 1000,
        hit_rate=cached / sum(len(prompt) for prompt in prompts),
    )


async def _simulate_all(
    trace: Sequence[TraceRequest],
    prompts: Sequence[list[int]],
    settings: Sequence[RouterSettings],
    seeds: int,
    mocker: MockerConfig,
) -> list[list[Outcome]]:
    return [
        [
            await simulate(trace, prompts, setting, mocker=mocker, delays=Delays(), jitter_seed=seed)
            for seed in range(1, seeds + 1)
        ]
        for setting in settings
    ]


def _floats(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, not {text!r}") from None
    if not values or any(not 0.0 <= value < float("inf") for value in values):
        raise argparse.ArgumentTypeError(f"expected finite numbers of 0 or more, not {text!r}")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, help="replay this JSONL trace (Mooncake's format, blocks of 512 tokens)")
    parser.add_argument("--seed", type=int, default=0, help="without --trace: the generated trace's seed")
    parser.add_argument("--rate", type=float, default=DEFAULT_RATE, help="without --trace: requests per second")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of trace")
    parser.add_argument(
        "--weights", type=_floats, default=[DEFAULT_OVERLAP_WEIGHT], help="--kv-overlap-score-weight values"
    )
    parser.add_argument(
        "--queued-prefill-weights", type=_floats, default=[1.0, 0.5], help="--kv-queued-prefill-weight values (0..1)"
    )
    parser.add_argument("--seeds", type=int, default=8, help="delay draws per setting (default 8)")
    parser.add_argument(
        "--mocker", default="{}", help='JSON object of mocker settings over the defaults, e.g. \'{"scheduler": "v0"}\''
    )
    args = parser.parse_args(argv)
    if args.seeds < 2 or args.rate <= 0 or args.duration <= 0:
        parser.error("--seeds must be 2 or more, --rate and --duration above 0")
    if any(value > 1.0 for value in args.queued_prefill_weights):
        parser.error("--queued-prefill-weights: each must be between 0 and 1")
    try:
        overrides = json.loads(args.mocker)
    except ValueError as exc:
        parser.error(f"--mocker: not valid JSON: {exc}")
    if not isinstance(overrides, dict):
        parser.error('--mocker: expected a JSON object of mocker settings, e.g. \'{"scheduler": "v0"}\'')
    args.settings = {**MOCKER_SETTINGS, **overrides}
    try:
        args.config = parse_mocker_config(args.settings, "--mocker")
    except ConfigError as exc:
        parser.error(str(exc))
    return args


def main() -> None:
    args = parse_args()
    if args.trace:
        try:
            trace = load_trace(args.trace, TRACE_BLOCK_SIZE)
        except (OSError, ValueError) as exc:
            sys.exit(f"--trace {args.trace}: {exc}")
        trace = [r for r in trace if r.timestamp - trace[0].timestamp < args.duration * 1000]
    else:
        trace = generate_trace(
            seed=args.seed, rate=args.rate, duration=args.duration, block_size=TRACE_BLOCK_SIZE,
            arrivals="poisson", shape=TrafficShape(),
        )  # fmt: skip
    tokens = BlockTokens(TRACE_BLOCK_SIZE)
    prompts = [tokens.prompt(request) for request in trace]
    settings = [
        RouterSettings(mode=RouterMode.KV, overlap_score_weight=weight, queued_prefill_weight=queued, seed=0)
        for weight in args.weights
        for queued in args.queued_prefill_weights
    ]
    print(f"{len(trace)} requests, {WORKERS} mockers {args.settings}, {args.seeds} delay draws per setting")
    results = asyncio.run(_simulate_all(trace, prompts, settings, args.seeds, args.config))
    print(f"{'weight':>7} {'queued':>7} {'TTFT p50 ms':>12} {'±sd':>5} {'p99 ms':>8} {'hit':>7}   p50, p99 / first")
    first: tuple[float, float] | None = None
    for setting, outcomes in zip(settings, results, strict=True):
        p50 = statistics.mean(o.ttft_p50_ms for o in outcomes)
        p99 = statistics.mean(o.ttft_p99_ms for o in outcomes)
        hit = statistics.mean(o.hit_rate for o in outcomes)
        spread = statistics.stdev(o.ttft_p50_ms for o in outcomes)
        first = first or (p50, p99)
        print(
            f"{setting.overlap_score_weight:7g} {setting.queued_prefill_weight:7g} {p50:12.1f} {spread:5.1f} "
            f"{p99:8.1f} {hit:7.4f}   {p50 / first[0]:.3f}, {p99 / first[1]:.3f}"
        )


if __name__ == "__main__":
    main()
