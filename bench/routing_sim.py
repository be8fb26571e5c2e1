"""The trace replay of trace_replay.py in simulated time: router settings compared without noise.

    .venv/bin/python bench/routing_sim.py [--queued-prefill-weights 1,0.5] [--weights 8] [--seeds 8]
                                          [--rate 56] [--trace FILE] [--mocker '{"scheduler": "v0"}']
                                          [--replicas 1,2,4] [--replica-sync on|off|both]

A real replay (trace_replay.py) runs each stack's processes on the machine's two cores, so its
latencies move with whatever else the machine does. This script takes the same trace and the same 4
mockers and runs them in simulated time instead: Flotilla's own ``KvRouter`` decides, each worker is
the mocker's own ``Scheduler`` with its own step timing (engines/mocker), and a heap of timed events
stands for the network between them. A request reaches the router, is routed, reaches its worker; the
worker's KV events reach the router's index, its first token and its end reach the router's load
count, and its load report arrives once a second, each after a delay. Only the routing and the
simulated engine count: nothing here measures the serving path's own cost.

With ``--replicas``, several routers (the routers of several ingress processes) take the requests in
turn, as trace_replay.py's ``--ingresses`` sends every Nth request to each; each has its own index fed
by the workers' KV events and its own load count, and with ``--replica-sync on`` each hands its
``ReplicaSync`` messages (routing/replica_sync.py, the bytes it would publish) to the others after a
delay, in the order sent, as NATS delivers one publisher's messages. This separates what several
routers cost the routing from what several processes cost a machine's CPU.

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
from frontend_gateway.routing.replica_sync import ENDS_WAIT_S  # noqa: E402
from runtime.cluster.addressing import EndpointAddress  # noqa: E402
from runtime.errors import ConfigError  # noqa: E402
from runtime.kv.events import WorkerLoad  # noqa: E402
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions  # noqa: E402

TRACE_BLOCK_SIZE = 512  # trace_replay.py's default --trace-block-size
VOCAB_SIZE = 49152  # SmolLM2's, as in the real replay
REPORT_INTERVAL_S = 1.0  # workers publish their load once a second (runtime/kv/load_metrics.py)


@dataclass(frozen=True)
class Delays:
    """Mean seconds between the parts, as a probe of the real replay measured them at p50."""

    to_router: float = 0.0015  # client -> the router's decision (HTTP, checks, hashing)
    to_worker: float = 0.0015  # decision -> the worker's scheduler (NATS)
    back: float = 0.002  # a step's end -> the router hears of the first token, or of the end
    events: float = 0.004  # a step's end -> its KV events in the router's index (5 ms batches)
    sync: float = 0.0015  # a router's decision -> another router replica applies it (one NATS hop, as to_worker)


@dataclass(frozen=True)
class Outcome:
    ttft_p50_ms: float
    ttft_p99_ms: float
    hit_rate: float
    sync_messages: float = 0.0  # replica sync messages published per request


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
    replicas: int = 1,
    ends_wait_s: float = ENDS_WAIT_S,
) -> Outcome:
    """Replay ``trace`` through ``replicas`` KV routers with ``settings`` (request N to router N mod
    ``replicas``) and 4 mockers; delays drawn with ``jitter_seed``; replicas let their requests' ends wait
    up to ``ends_wait_s`` for a decision to ride with (ReplicaSync.ends_wait_s).

    A coroutine only because the router makes asyncio objects: nothing in it awaits until the end.
    """
    config = mocker
    block_size = config.block_size
    step_seconds = StepTimer(config).step_seconds
    now = 0.0
    routers = [
        KvRouter(
            settings,
            block_size=block_size,
            nc=None,  # type: ignore[arg-type]  # no NATS: what would come over it is handed to the router directly
            address=EndpointAddress("sim", "mocker", "generate"),
            clock=lambda: now,
        )
        for _ in range(replicas)
    ]
    instances = [InstanceInfo(number + 1, f"worker{number}") for number in range(WORKERS)]
    for router in routers:
        assert isinstance(router.indexer, KvIndexer)
        for instance in instances:
            router.instance_added(instance)
        # Its subscriber would listen on NATS and ask each worker for its cache (they start empty) in tasks:
        # stopped before they run, as this script hands the router what they would hear.
        await router.subscriber.close()
    syncing = settings.replica_sync and replicas > 1
    for router in routers:
        router.replica_sync.ends_wait_s = ends_wait_s
    sync_messages = 0
    schedulers = [Scheduler(config) for _ in instances]
    for scheduler in schedulers:
        scheduler.cache.record_events = True
    stepping = [False] * len(instances)
    # When each router's waiting ends were last queued to go: one "sync_due" per batch of them, not per end.
    ends_queued: list[float | None] = [None] * replicas
    rng = random.Random(jitter_seed)
    heap: list[tuple[float, int, str, Any]] = []
    order = itertools.count()

    def at(delay: float, kind: str, payload: Any, after: float = 0.0) -> None:
        """``payload`` arrives ``delay`` (give or take 70%) after ``after`` seconds from now."""
        heapq.heappush(heap, (now + after + delay * rng.uniform(0.3, 1.7), next(order), kind, payload))

    # When the last sync message from one router to another arrives: NATS keeps one publisher's order.
    sync_arrival: dict[tuple[int, int], float] = {}

    def send_sync(sender: int) -> None:
        """Hand what router ``sender`` said since its last batch to every other router, after a delay."""
        nonlocal sync_messages
        sync = routers[sender].replica_sync
        for data in sync.take_batches():
            sync_messages += 1
            for receiver in range(replicas):
                if receiver != sender:
                    arrival = max(now + delays.sync * rng.uniform(0.3, 1.7), sync_arrival.get((sender, receiver), 0.0))
                    sync_arrival[sender, receiver] = arrival
                    heapq.heappush(heap, (arrival, next(order), "sync", (receiver, data, sync.subject)))

    if syncing:
        for router in routers:
            router.replica_sync.begin()
        for sender in range(replicas):
            send_sync(sender)  # the first heartbeat: the others know it before the first request

    def start_step(worker: int) -> None:
        scheduler = schedulers[worker]
        stepping[worker] = scheduler.has_work
        if not scheduler.has_work:
            return
        step = scheduler.schedule()
        duration = step_seconds(step.prefill_tokens(), step.decode_tokens()) if step.scheduled else 0.0
        if events := scheduler.cache.take_events():
            for router in routers:  # published once the pass is over, as the mocker publishes them
                at(delays.events, "events", (router, worker, events), after=duration)
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
            replica = index % replicas
            decision = routers[replica].choose(routed, instances)
            assert decision is not None
            if syncing:
                send_sync(replica)
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
            router, worker, events = payload
            router.indexer.apply((worker + 1, 0), events)
        elif kind in ("prefill_done", "finished"):
            replica = int(payload) % replicas  # the router that routed it
            if kind == "prefill_done":
                routers[replica].prefill_done(payload)
            else:
                routers[replica].finished(payload)
            due = routers[replica].replica_sync.ends_due() if syncing else None
            if due is not None and due != ends_queued[replica]:
                # Ends wait for a decision to ride with, or go at ``due`` (ReplicaSync.ENDS_WAIT_S).
                ends_queued[replica] = due
                heapq.heappush(heap, (due, next(order), "sync_due", replica))
        elif kind == "sync_due":
            due = routers[payload].replica_sync.ends_due()
            if due is not None and due <= now:
                send_sync(payload)
        elif kind == "sync":
            receiver, data, subject = payload
            routers[receiver].replica_sync.on_batch(data, subject)
        elif kind == "report":
            cache = schedulers[payload].cache
            for router in routers:
                router.load.observe(
                    WorkerLoad(instance_id=payload + 1, active_requests=0, kv_active_blocks=cache.active_blocks)
                )
            if len(ttft) < len(trace) or any(stepping):
                heapq.heappush(heap, (now + REPORT_INTERVAL_S, next(order), "report", payload))
    for router in routers:
        await router.close()
    times = sorted(ttft.values())
    return Outcome(
        ttft_p50_ms=times[len(times) // 2] * 1000,
        ttft_p99_ms=times[int(0.99 * (len(times) - 1))] * 1000,
        hit_rate=cached / sum(len(prompt) for prompt in prompts),
        sync_messages=sync_messages / len(trace),
    )


@dataclass(frozen=True)
class Row:
    """One setting to simulate: the routers' settings and how many routers share the traffic."""

    settings: RouterSettings
    replicas: int = 1
    ends_wait_s: float = ENDS_WAIT_S


def rows(
    weights: Sequence[float],
    queued_weights: Sequence[float],
    replicas: Sequence[int],
    replica_sync: str,
    ends_waits: Sequence[float] = (ENDS_WAIT_S,),
) -> list[Row]:
    """Every combination; one router has no replicas to sync with, so it is one row whatever ``replica_sync``
    and ``ends_waits`` (seconds), and so is a row of replicas that do not sync whatever ``ends_waits``."""
    syncs = {"on": [True], "off": [False], "both": [True, False]}[replica_sync]
    kv: dict[str, Any] = {"mode": RouterMode.KV, "seed": 0}
    return [
        Row(RouterSettings(**kv, overlap_score_weight=w, queued_prefill_weight=q, replica_sync=sync), count, wait)
        for w in weights
        for q in queued_weights
        for count in replicas
        for sync in (syncs if count > 1 else [True])
        for wait in (ends_waits if count > 1 and sync else ends_waits[:1])
    ]


async def _simulate_all(
    trace: Sequence[TraceRequest],
    prompts: Sequence[list[int]],
    settings: Sequence[Row],
    seeds: int,
    mocker: MockerConfig,
    delays: Delays,
) -> list[list[Outcome]]:
    return [
        [
            await simulate(
                trace,
                prompts,
                row.settings,
                mocker=mocker,
                delays=delays,
                jitter_seed=seed,
                replicas=row.replicas,
                ends_wait_s=row.ends_wait_s,
            )
            for seed in range(1, seeds + 1)
        ]
        for row in settings
    ]


def _counts(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated counts like 1,2,4, not {text!r}") from None
    if not values or any(not 1 <= value <= 16 for value in values):
        raise argparse.ArgumentTypeError(f"expected counts between 1 and 16, not {text!r}")
    return values


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
    parser.add_argument(
        "--replicas", type=_counts, default=[1],
        help="router replicas sharing the traffic, e.g. 1,2,4 (the ingress processes of trace_replay.py --ingresses)",
    )  # fmt: skip
    parser.add_argument(
        "--replica-sync", choices=("on", "off", "both"), default="on",
        help="with more than one replica: whether they share their decisions (--router-replica-sync)",
    )  # fmt: skip
    parser.add_argument(
        "--sync-ms", type=float, default=Delays.sync * 1000,
        help=f"mean delay of a replica sync message, ms (default {Delays.sync * 1000:g}: one NATS hop)",
    )  # fmt: skip
    parser.add_argument(
        "--ends-wait-ms", type=_floats, default=[ENDS_WAIT_S * 1000],
        help="how long a replica's prefill-done and end messages wait for a decision to ride with, ms, e.g. "
        f"0,50 (default {ENDS_WAIT_S * 1000:g}: ReplicaSync's)",
    )  # fmt: skip
    parser.add_argument("--seeds", type=int, default=8, help="delay draws per setting (default 8)")
    parser.add_argument(
        "--mocker", default="{}", help='JSON object of mocker settings over the defaults, e.g. \'{"scheduler": "v0"}\''
    )
    args = parser.parse_args(argv)
    if args.seeds < 2 or args.rate <= 0 or args.duration <= 0 or not 0 <= args.sync_ms < 10_000:
        parser.error("--seeds must be 2 or more, --rate and --duration above 0, --sync-ms between 0 and 10000")
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
    ends_waits = [ms / 1000 for ms in args.ends_wait_ms]
    settings = rows(args.weights, args.queued_prefill_weights, args.replicas, args.replica_sync, ends_waits)
    print(f"{len(trace)} requests, {WORKERS} mockers {args.settings}, {args.seeds} delay draws per setting")
    delays = Delays(sync=args.sync_ms / 1000)
    results = asyncio.run(_simulate_all(trace, prompts, settings, args.seeds, args.config, delays))
    print(
        f"{'weight':>7} {'queued':>7} {'routers':>7} {'sync':>4} {'ends ms':>7} {'msg/req':>7} {'TTFT p50 ms':>12} "
        f"{'±sd':>5} {'p99 ms':>8} {'hit':>7} {'±sd':>6}   p50, p99, hit / first"
    )
    first: tuple[float, float, float] | None = None
    for row, outcomes in zip(settings, results, strict=True):
        p50 = statistics.mean(o.ttft_p50_ms for o in outcomes)
        p99 = statistics.mean(o.ttft_p99_ms for o in outcomes)
        hit = statistics.mean(o.hit_rate for o in outcomes)
        spread = statistics.stdev(o.ttft_p50_ms for o in outcomes)
        hit_spread = statistics.stdev(o.hit_rate for o in outcomes)
        first = first or (p50, p99, hit)
        setting = row.settings
        syncing = row.replicas > 1 and setting.replica_sync
        sync = "-" if row.replicas == 1 else ("on" if setting.replica_sync else "off")
        wait = f"{row.ends_wait_s * 1000:g}" if syncing else "-"
        messages = f"{statistics.mean(o.sync_messages for o in outcomes):.2f}" if syncing else "-"
        print(
            f"{setting.overlap_score_weight:7g} {setting.queued_prefill_weight:7g} {row.replicas:7d} {sync:>4} "
            f"{wait:>7} {messages:>7} {p50:12.1f} {spread:5.1f} {p99:8.1f} {hit:7.4f} {hit_spread:6.4f}   "
            f"{p50 / first[0]:.3f}, {p99 / first[1]:.3f}, {hit / first[2]:.3f}"
        )


if __name__ == "__main__":
    main()
