"""bench/kv_tiers_vs_dynamo.py in simulated time: where its ITL p99 comes from, without the serving path.

    .venv/bin/python bench/kv_tiers_sim.py [--seeds 2,3,4] [--draws 4] [--delay-scales 0,1] [--tiers host,device]
                                           [--engines] [--dynamo-python .dynamo-venv/bin/python] [--dynamo-runs 4]

The same trace (documents that come back, a fresh question each, 32 tokens out, a closed loop of 4) and the
same two mocker workers, host tier and device only, run through Flotilla's own ``KvRouter`` and each worker's
mocker ``Scheduler`` in simulated time, as bench/routing_sim.py runs a trace: every hop between them (client to
router, router to worker, a token back, a step's KV events to the router's index) takes its mean delay (times
``--delay-scales``) times a random factor between 0.3 and 1.7, drawn ``--draws`` times per trace seed. A
request goes out when one before it ends (the client's closed loop). At a scale of 0 every hop is instant and
a request sent as another ends joins the step its worker starts then, as in Dynamo's offline replay.

For each run it prints TTFT p50/p99, ITL p50/p99 and the gaps between tokens by band. With a host tier almost
every gap is one of a few step times: a decode of one or two sequences (~26 or ~34 ms), a 64-token prefill
(a prompt whose document came back from the host, or is shared on the device) beside a decode of one
sequence (~43 ms) or of two (~51 ms), a whole 4160-token prefill beside a decode (~113 ms); none between 55
and 100 ms. ITL p99 is the 50th longest of 4960 gaps, and the gaps of 47 ms and more are about that many: p99
lands on 43 or on 51 ms by a handful of gaps either way, from one trace seed or delay draw to the next.

``--engines`` also runs each trace through the mocker engines themselves, in real time in this process (speed-up
1, ~45 s a run), behind the same router with no HTTP or NATS: what their step loops and token hand-off add. What
the live bench adds beyond that is its serving path's (gateway, request plane, HTTP stream).

``--dynamo-python`` names a Python with Dynamo 1.6.1 installed (``make dynamo``): the same trace then also
runs through Dynamo's own core and router in simulated time (``dynamo.replay.run_trace_replay``, offline, KV
routing, the same closed loop, instant hops) ``--dynamo-runs`` times per seed (its router breaks ties at
random), and its ITL p99s are printed beside Flotilla's.
"""

import argparse
import asyncio
import heapq
import itertools
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop
from kv_tiers_vs_dynamo import BLOCK, add_trace_flags, mocker_settings, trace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engines.mocker.config import MockerConfig  # noqa: E402
from engines.mocker.engine import MockerEngine  # noqa: E402
from engines.mocker.scheduler import Scheduler  # noqa: E402
from engines.mocker.scheduler import Sequence as MockerSequence  # noqa: E402
from engines.mocker.timing import StepTimer  # noqa: E402
from frontend_gateway.routing.kv_router import KvRouter  # noqa: E402
from frontend_gateway.routing.protocol import InstanceInfo, RouterMode, RouterSettings  # noqa: E402
from runtime.cluster.addressing import EndpointAddress  # noqa: E402
from runtime.engine import RequestContext  # noqa: E402
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions  # noqa: E402

VOCAB_SIZE = 40000
#: Mean seconds of each hop (bench/routing_sim.py's, measured on the live stack at p50).
TO_ROUTER, TO_WORKER, BACK, EVENTS = 0.0015, 0.0015, 0.002, 0.004
#: Gap bands, ms: decodes; a short prefill beside one decode; beside two; nothing the model makes; a whole prefill.
BANDS = ((0, 40), (40, 47), (47, 55), (55, 100), (100, float("inf")))


class _NoStopping:
    stopped = False


async def simulate(prompts: list[list[int]], max_tokens: int, settings: dict[str, Any], *, workers: int,
                   concurrency: int, draw: int, delay_scale: float = 1.0) -> list[list[float]]:  # fmt: skip
    """Each request's times (seconds): when it was sent, then when each of its tokens reached the client.

    Each hop's mean delay is multiplied by ``delay_scale``; at 0 every hop is instant: a request sent when
    another ends (at a step's end) is routed and joins the step its worker starts then, as in Dynamo's offline
    replay.
    """
    config = MockerConfig(**settings)
    step_seconds = StepTimer(config).step_seconds
    now = 0.0
    router = KvRouter(
        RouterSettings(mode=RouterMode.KV, seed=draw),
        block_size=config.block_size,
        nc=None,  # type: ignore[arg-type]  # no NATS: what would come over it is handed to the router directly
        address=EndpointAddress("sim", "mocker", "generate"),
        clock=lambda: now,
    )
    instances = [InstanceInfo(number + 1, f"worker{number}") for number in range(workers)]
    for instance in instances:
        router.instance_added(instance)
    await router.subscriber.close()  # it would listen on NATS: this script hands it what it would hear
    schedulers = [Scheduler(config) for _ in instances]
    for scheduler in schedulers:
        scheduler.set_record_events(True)
    stepping = [False] * workers
    rng = random.Random(draw)
    heap: list[tuple[float, int, str, Any]] = []
    order = itertools.count()

    def at(delay: float, kind: str, payload: Any, after: float = 0.0) -> None:
        if not delay_scale and not after:
            deliver(kind, payload)  # now, before the step that starts now
            return
        drawn = delay * delay_scale * rng.uniform(0.3, 1.7)
        heapq.heappush(heap, (now + after + drawn, next(order), kind, payload))

    def start_step(worker: int) -> None:
        scheduler = schedulers[worker]
        stepping[worker] = scheduler.has_work
        if not scheduler.has_work:
            return
        step = scheduler.schedule(now)
        if step.scheduled:
            duration = step_seconds(step.prefill_tokens(), step.decode_tokens())
        else:
            duration = scheduler.idle_seconds()  # waiting for a host copy, as the engine waits
        if events := scheduler.take_events():
            at(EVENTS, "events", (worker, events), after=duration)  # published once the pass is over
        heapq.heappush(heap, (now + duration, next(order), "step", (worker, step)))

    times: list[list[float]] = [[] for _ in prompts]
    waiting = iter(range(len(prompts)))

    def send() -> None:
        index = next(waiting, None)
        if index is not None:
            times[index].append(now)
            at(TO_ROUTER, "route", index)

    def deliver(kind: str, payload: Any) -> None:
        if kind == "route":
            request = PreprocessedRequest(
                request_id=str(payload),
                model="sim",
                token_ids=prompts[payload],
                sampling=SamplingOptions(),
                stop_conditions=StopConditions(max_tokens=max_tokens),
            )
            decision = router.choose(request, instances)
            assert decision is not None
            at(TO_WORKER, "arrive", (payload, decision.instance.instance_id - 1))
        elif kind == "arrive":
            index, worker = payload
            sequence = MockerSequence(
                str(index), prompts[index], max_tokens, seed=index, vocab_size=VOCAB_SIZE, stop=_NoStopping()
            )
            schedulers[worker].add(sequence)
            if not stepping[worker]:
                start_step(worker)
        elif kind == "step":
            worker, step = payload
            for sequence in schedulers[worker].complete(step):
                index = int(sequence.request_id)
                if len(times[index]) == 1 and sequence.outbox:
                    at(BACK, "prefill_done", sequence.request_id)
                times[index].extend([now + BACK] * len(sequence.outbox))
                sequence.outbox = []
                if sequence.done:
                    at(BACK, "finished", sequence.request_id)
            start_step(worker)
        elif kind == "events":
            worker, events = payload
            router.indexer.apply((worker + 1, 0), events)
        elif kind == "prefill_done":
            router.prefill_done(payload)
        elif kind == "finished":
            router.finished(payload)
            send()

    for _ in range(concurrency):
        send()
    while heap:
        now, _, kind, payload = heapq.heappop(heap)
        deliver(kind, payload)
    await router.close()
    return times


class _IndexSink:
    """A worker's KV event sink that hands its events to the router's index at once (no NATS)."""

    def __init__(self, router: KvRouter, instance_id: int) -> None:
        self.router, self.instance_id = router, instance_id

    def publish(self, dp_rank: int, events: list[Any]) -> None:
        self.router.indexer.apply((self.instance_id, dp_rank), events)


async def real_time(prompts: list[list[int]], max_tokens: int, settings: dict[str, Any], *, workers: int,
                    concurrency: int) -> list[list[float]]:  # fmt: skip
    """As ``simulate``, but with the mocker engines themselves in real time in this process: their step loops and
    token hand-off, no HTTP or NATS between them and the router. Takes the trace's length in real seconds."""
    router = KvRouter(
        RouterSettings(mode=RouterMode.KV, seed=0),
        block_size=settings["block_size"],
        nc=None,  # type: ignore[arg-type]  # no NATS: the engines' events are handed to the router directly
        address=EndpointAddress("sim", "mocker", "generate"),
        clock=time.monotonic,
    )
    instances = [InstanceInfo(number + 1, f"worker{number}") for number in range(workers)]
    for instance in instances:
        router.instance_added(instance)
    await router.subscriber.close()
    engines = [MockerEngine(MockerConfig(**settings), vocab_size=VOCAB_SIZE) for _ in instances]
    for instance, engine in zip(instances, engines, strict=True):
        engine.attach_kv_events(_IndexSink(router, instance.instance_id))
        await engine.start()
    times: list[list[float]] = [[] for _ in prompts]
    waiting = iter(range(len(prompts)))

    async def stream() -> None:
        for index in waiting:
            request = PreprocessedRequest(
                request_id=str(index),
                model="sim",
                token_ids=prompts[index],
                sampling=SamplingOptions(),
                stop_conditions=StopConditions(max_tokens=max_tokens, ignore_eos=True),
            )
            decision = router.choose(request, instances)
            assert decision is not None
            times[index].append(time.perf_counter())
            engine = engines[decision.instance.instance_id - 1]
            async for output in engine.generate(request, RequestContext(request.request_id)):
                if len(times[index]) == 1:
                    router.prefill_done(request.request_id)
                times[index].extend([time.perf_counter()] * len(output.token_ids))
            router.finished(request.request_id)

    try:
        await asyncio.gather(*(stream() for _ in range(concurrency)))
    finally:
        for engine in engines:
            await engine.close()
        await router.close()
    return times


def percentile(values: list[float], percent: float) -> float:
    """Linear between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * percent / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def describe(times: list[list[float]]) -> str:
    ttfts = [(request[1] - request[0]) * 1000 for request in times]
    gaps = [(b - a) * 1000 for request in times for a, b in itertools.pairwise(request[1:])]
    bands = " ".join(f"{sum(low <= gap < high for gap in gaps):5d}" for low, high in BANDS)
    return (
        f"{percentile(ttfts, 50):8.1f} {percentile(ttfts, 99):7.1f} {percentile(gaps, 50):8.2f} "
        f"{percentile(gaps, 99):7.2f}   {bands}   {sum(gap >= 47 for gap in gaps):4d}/{len(gaps) / 100:.0f}"
    )


_DYNAMO_REPLAY = """
import json, sys
from dynamo.replay import run_trace_replay
trace, engine, workers, concurrency, block = sys.argv[1], json.loads(sys.argv[2]), *map(int, sys.argv[3:6])
report = run_trace_replay(trace, extra_engine_args={"engine": engine}, num_workers=workers, trace_block_size=block,
                          trace_format="mooncake", router_mode="kv_router", replay_concurrency=concurrency)
print(json.dumps(report.to_dict()["summary"]))
"""


def dynamo_p99s(python: str, args: argparse.Namespace, seed: int, settings: dict[str, Any]) -> list[float]:
    """ITL p99 (ms) of ``--dynamo-runs`` offline replays of seed ``seed``'s trace through Dynamo 1.6.1."""
    engine: dict[str, Any] = {
        "block_size": BLOCK,
        "num_gpu_blocks": settings["num_gpu_blocks"],
        "speedup_ratio": settings["speedup_ratio"],
    }
    if "num_host_blocks" in settings:
        engine["native_host_offload"] = {
            "num_host_blocks": settings["num_host_blocks"],
            "d2h_bandwidth_gbps": settings["host_offload_d2h_bandwidth_gbps"],
            "h2d_bandwidth_gbps": settings["host_offload_h2d_bandwidth_gbps"],
        }
        engine["kv_cache_bytes_per_token"] = settings["kv_bytes_per_token"]
    # Its trace names blocks, not tokens: a document's blocks, then the question's (fresh each time).
    prompts = trace(args, seed)
    documents = {tuple(prompt[: args.document_tokens]) for prompt in prompts}
    names = {document: number * 10_000 for number, document in enumerate(sorted(documents))}
    fresh = itertools.count(10_000_000)
    lines = []
    for prompt in prompts:
        document = names[tuple(prompt[: args.document_tokens])]
        blocks = list(range(document, document + args.document_tokens // BLOCK))
        blocks += [next(fresh) for _ in range(-(-args.question_tokens // BLOCK))]
        lines.append(
            {"timestamp": 0, "input_length": len(prompt), "output_length": args.max_tokens, "hash_ids": blocks}
        )
    p99s = []
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl") as file:
        file.write("".join(json.dumps(line) + "\n" for line in lines))
        file.flush()
        for _ in range(args.dynamo_runs):
            command = [python, "-c", _DYNAMO_REPLAY, file.name, json.dumps(engine)]
            command += [str(args.workers), str(args.concurrency), str(BLOCK)]
            done = subprocess.run(command, capture_output=True, text=True, check=True, env={"RUST_LOG": "error"})
            p99s.append(json.loads(done.stdout.strip().splitlines()[-1])["p99_itl_ms"])
    return p99s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_flags(parser)
    parser.add_argument("--seeds", default="2,3,4", help="trace seeds (kv_tiers_vs_dynamo.py's rounds use 2, 3, 4)")
    parser.add_argument("--draws", type=int, default=4, help="delay draws per trace seed")
    parser.add_argument(
        "--delay-scales", default="1",
        help="hop delays times these, e.g. 0,0.5,1 (0: instant, a request sent as another ends joins the step "
        "starting then, as in Dynamo's offline replay)",
    )  # fmt: skip
    parser.add_argument("--tiers", default="host,device", help="host (a host tier), device (device only), or both")
    parser.add_argument(
        "--engines", action="store_true",
        help="also run the mocker engines themselves in real time here (no HTTP, no NATS): the trace's length a run",
    )  # fmt: skip
    parser.add_argument("--dynamo-python", help="a Python with Dynamo 1.6.1: its offline replay of each trace too")
    parser.add_argument("--dynamo-runs", type=int, default=4, help="Dynamo replays per trace seed")
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    print(
        f"{args.requests} requests over {args.documents} documents of {args.document_tokens} tokens "
        f"(+{args.question_tokens}), {args.max_tokens} out, closed loop of {args.concurrency}, {args.workers} "
        "workers; simulated time. Gaps by band (ms), and gaps of 47 ms or more against the count p99 is at:"
    )
    header = "   ".join(f"[{low},{high:g})" for low, high in BANDS)
    print(f"{'hop delays':>30}{'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7}   {header}   >=47")
    scales = [float(scale) for scale in args.delay_scales.split(",")]
    for tier in args.tiers.split(","):
        settings = mocker_settings(args, host_tier=tier == "host")
        name = "host tier" if tier == "host" else "device only"
        for seed in seeds:
            prompts = trace(args, seed)
            for scale, draw in itertools.product(scales, range(args.draws)):
                times = asyncio.run(
                    simulate(prompts, args.max_tokens, settings, workers=args.workers,
                             concurrency=args.concurrency, draw=draw, delay_scale=scale)
                )  # fmt: skip
                label = f"x{scale:g} draw {draw}"
                print(f"{name:<11} seed {seed} {label:<11}{describe(times)}", flush=True)
            if args.engines:
                times = uvloop.run(
                    real_time(prompts, args.max_tokens, settings, workers=args.workers, concurrency=args.concurrency)
                )
                print(f"{name:<11} seed {seed} {'engines':<11}{describe(times)}", flush=True)
            if args.dynamo_python:
                p99s = dynamo_p99s(args.dynamo_python, args, seed, settings)
                print(
                    f"{name:<12} seed {seed} Dynamo 1.6.1 offline replay, ITL p99: "
                    + ", ".join(f"{p:.2f}" for p in p99s)
                )


if __name__ == "__main__":
    main()
