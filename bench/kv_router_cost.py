"""What one KV routing decision costs the gateway's event loop, in microseconds.

A decision hashes the prompt in blocks, looks the hashes up in the index, and scores every candidate
worker; it runs synchronously on the event loop for every request, so it must stay far below a
millisecond. This measures, for each case, the hashing alone, the index lookup alone and the whole
``KvRouter.choose`` (plus the ``finished`` notice that follows every decision), with an index as a
busy fleet would have it: every worker holding ``--cached-blocks`` other blocks, and each a prefix
of the request of a different length; then the same decision with the gateway's routing metrics
attached (frontend_gateway/routing/metrics.py: three histogram observations per decision), and the
ratio of the two, measured in the same run.

    .venv/bin/python bench/kv_router_cost.py [--repeat 7] [--iterations 2000]

Cases: a 4k-token prompt (64 blocks of 64) against 16 workers, and an 8k-token prompt (128 blocks of
64) against 4 workers. Prints the median over the repeats of the mean per decision.
"""

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nats.aio.client import Client as NATS  # noqa: E402

from frontend_gateway.metrics import GatewayMetrics  # noqa: E402
from frontend_gateway.routing.health import RoutingHealth  # noqa: E402
from frontend_gateway.routing.kv_indexer import KvIndexer  # noqa: E402
from frontend_gateway.routing.kv_router import KvRouter  # noqa: E402
from frontend_gateway.routing.protocol import InstanceInfo, RouterMode, RouterSettings  # noqa: E402
from runtime.cluster.addressing import EndpointAddress  # noqa: E402
from runtime.kv.blocks import sequence_block_hashes  # noqa: E402
from runtime.kv.events import BlockStored  # noqa: E402
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions  # noqa: E402

BLOCK_SIZE = 64
CASES = ((4096, 16), (8192, 4))  # (prompt tokens, workers)


def per_call_us(work: Callable[[], object], iterations: int, repeat: int) -> float:
    """The median over ``repeat`` runs of the mean time of one call, in µs."""
    runs = []
    for _ in range(repeat):
        started = time.perf_counter_ns()
        for _ in range(iterations):
            work()
        runs.append((time.perf_counter_ns() - started) / iterations / 1000)
    return statistics.median(runs)


def paired_us(
    first: Callable[[], object], second: Callable[[], object], iterations: int, repeat: int
) -> tuple[float, float]:
    """``per_call_us`` of both, their runs interleaved so that the machine's noise falls on both alike."""
    runs: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for work, times in ((first, runs[0]), (second, runs[1])):
            started = time.perf_counter_ns()
            for _ in range(iterations):
                work()
            times.append((time.perf_counter_ns() - started) / iterations / 1000)
    return statistics.median(runs[0]), statistics.median(runs[1])


def build_router(
    prompt: list[int], workers: int, cached_blocks: int, rng: random.Random, health: RoutingHealth | None = None
) -> KvRouter:
    """A KV router whose index holds ``cached_blocks`` unrelated blocks per worker and a prefix of ``prompt``."""
    settings = RouterSettings(mode=RouterMode.KV, seed=1)
    # choose() does no I/O: the router is never started, so it needs no NATS connection.
    router = KvRouter(settings, block_size=BLOCK_SIZE, nc=cast(NATS, None), address=EndpointAddress(), health=health)
    assert isinstance(router.indexer, KvIndexer)
    hashes = sequence_block_hashes(prompt, BLOCK_SIZE)
    for instance_id in range(1, workers + 1):
        other = [rng.getrandbits(64) for _ in range(cached_blocks)]
        held = rng.randrange(len(hashes) + 1)
        router.indexer.apply((instance_id, 0), [BlockStored(other), BlockStored(hashes[:held])])
    return router


def measure(
    prompt_tokens: int, workers: int, cached_blocks: int, iterations: int, repeat: int, rng: random.Random
) -> str:
    """One line of the table: hashing, lookup and whole decision for one case, in µs."""
    prompt = [rng.randrange(49152) for _ in range(prompt_tokens)]
    seed = rng.random()
    router = build_router(prompt, workers, cached_blocks, random.Random(seed))
    # The same index (same seed), with the gateway's metrics told of every decision.
    watched = build_router(prompt, workers, cached_blocks, random.Random(seed), GatewayMetrics().for_routing("m"))
    candidates = [InstanceInfo(instance_id, f"s.{instance_id}") for instance_id in range(1, workers + 1)]
    request = PreprocessedRequest(
        request_id="bench",
        model="m",
        token_ids=prompt,
        sampling=SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=16),
    )
    hashes = sequence_block_hashes(prompt, BLOCK_SIZE)

    def decide() -> None:
        router.choose(request, candidates)
        router.finished("bench")

    def decide_watched() -> None:
        watched.choose(request, candidates)
        watched.finished("bench")

    hash_us = per_call_us(lambda: sequence_block_hashes(prompt, BLOCK_SIZE), iterations, repeat)
    lookup_us = per_call_us(lambda: router.indexer.find_matches(hashes), iterations, repeat)
    choose_us, watched_us = paired_us(decide, decide_watched, iterations, repeat)
    return (
        f"{prompt_tokens:>8} {workers:>8} {hash_us:>8.1f} {lookup_us:>8.1f} {choose_us:>8.1f} {watched_us:>10.1f}"
        f" {watched_us / choose_us:>8.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--cached-blocks", type=int, default=16384, help="other blocks each worker holds")
    args = parser.parse_args()
    rng = random.Random(42)
    print(f"block size {BLOCK_SIZE}, {args.cached_blocks} other blocks cached per worker; µs per decision (median)")
    print(f"{'prompt':>8} {'workers':>8} {'hash':>8} {'lookup':>8} {'choose':>8} {'+metrics':>10} {'ratio':>8}")
    for prompt_tokens, workers in CASES:
        print(measure(prompt_tokens, workers, args.cached_blocks, args.iterations, args.repeat, rng))


if __name__ == "__main__":
    main()
