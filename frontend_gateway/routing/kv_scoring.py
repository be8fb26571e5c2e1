"""The KV router's decision: a pure function of the request's size, its cache hits and the workers' load.

For each worker, in blocks of the model's block size::

    cost = overlap_score_weight × prefill blocks + decode blocks

where *prefill blocks* is the prompt left to compute there after its cache hit (a block held only on a
lower tier of that worker's cache counts ``host_hit_weight`` of a hit in host memory, ``disk_hit_weight``
on a disk or outside the node: it is copied back, not computed, but the copy takes time) plus
``queued_prefill_weight`` × the prompt tokens already in flight to that worker and not yet known to be
computed (Dynamo's router counts those in full; see routing/protocol.py for why a share is closer to
the wait they mean), and *decode blocks* the KV blocks its active
requests hold plus those this request would add there (its prompt blocks that no running request there
holds yet, and its own: see kv_load.py), as Dynamo's router projects them. The cheapest worker wins,
ties at random. With a temperature above zero the worker is
drawn instead, with probability ∝ exp(−normalised cost / temperature), where costs are normalised to
0..1 across the candidates (so that the temperature means the same at any load).
"""

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from frontend_gateway.routing.kv_indexer import Worker


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """What the router knows of one candidate worker when a request arrives."""

    worker: Worker
    overlap_blocks: int  # leading blocks of this request it holds on its device
    prefill_tokens_in_flight: int  # prompt tokens sent to it and not yet computed
    decode_blocks: float  # KV blocks its active requests hold
    new_blocks: int = 0  # KV blocks this request would add to them there
    # The blocks right after the device's that it holds only in host memory, and only farther (disk, outside).
    host_blocks: int = 0
    far_blocks: int = 0


@dataclass(frozen=True, slots=True)
class Scored:
    """A worker's cost for one request, and what that request would ask of it."""

    worker: Worker
    cost: float
    overlap_blocks: int  # on the device
    prefill_tokens: int  # this request's prompt tokens to compute there (lower-tier hits counted by their credit)


def worker_costs(
    prompt_tokens: int,
    block_size: int,
    workers: Sequence[WorkerSnapshot],
    *,
    overlap_score_weight: float,
    queued_prefill_weight: float,
    host_hit_weight: float = 0.0,
    disk_hit_weight: float = 0.0,
) -> list[Scored]:
    """The cost of sending a ``prompt_tokens``-token request to each of ``workers``, in their order."""
    scored: list[Scored] = []
    for snapshot in workers:
        hit = snapshot.overlap_blocks + host_hit_weight * snapshot.host_blocks + disk_hit_weight * snapshot.far_blocks
        to_compute = max(0, prompt_tokens - round(hit * block_size))
        prefill_blocks = (to_compute + queued_prefill_weight * snapshot.prefill_tokens_in_flight) / block_size
        cost = overlap_score_weight * prefill_blocks + snapshot.decode_blocks + snapshot.new_blocks
        scored.append(Scored(snapshot.worker, cost, snapshot.overlap_blocks, to_compute))
    return scored


def pick(scored: Sequence[Scored], *, temperature: float, rng: random.Random) -> Scored:
    """The cheapest of ``scored`` (ties at random), or a softmax draw when ``temperature`` > 0.

    Raises ValueError when ``scored`` is empty.
    """
    if not scored:
        raise ValueError("no worker to pick from")
    lowest = min(entry.cost for entry in scored)
    if temperature <= 0.0:
        cheapest = [entry for entry in scored if entry.cost == lowest]
        return cheapest[0] if len(cheapest) == 1 else rng.choice(cheapest)
    return scored[_softmax_draw(softmax_weights([entry.cost for entry in scored], temperature), rng)]


def softmax_weights(costs: Sequence[float], temperature: float) -> list[float]:
    """Unnormalised probabilities exp(−(cost − min) / (max − min) / temperature); all 1.0 if costs are equal."""
    lowest, highest = min(costs), max(costs)
    spread = highest - lowest
    if spread == 0.0:
        return [1.0] * len(costs)
    return [math.exp(-(cost - lowest) / spread / temperature) for cost in costs]


def _softmax_draw(weights: Sequence[float], rng: random.Random) -> int:
    point = rng.random() * sum(weights)
    for index, weight in enumerate(weights):
        point -= weight
        if point < 0.0:
            return index
    return len(weights) - 1  # rounding left a sliver past the last weight


def choose_worker(
    prompt_tokens: int,
    block_size: int,
    workers: Sequence[WorkerSnapshot],
    *,
    overlap_score_weight: float,
    queued_prefill_weight: float,
    temperature: float,
    rng: random.Random,
) -> Scored | None:
    """The worker for a ``prompt_tokens``-token request among ``workers``, or None when there is none."""
    if not workers:
        return None
    scored = worker_costs(
        prompt_tokens,
        block_size,
        workers,
        overlap_score_weight=overlap_score_weight,
        queued_prefill_weight=queued_prefill_weight,
    )
    return pick(scored, temperature=temperature, rng=rng)
