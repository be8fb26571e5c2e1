"""The KV router's decision against hand-computed costs, ties and temperature."""

import math
import random
from collections import Counter

import pytest

from frontend_gateway.routing.kv_scoring import (
    Scored,
    WorkerSnapshot,
    choose_worker,
    pick,
    softmax_weights,
    worker_costs,
)

A, B, C = (1, 0), (2, 0), (3, 0)


def test_costs_weigh_the_prefill_left_after_the_hit_against_active_decode_blocks() -> None:
    # A 100-token prompt in blocks of 16. A holds 4 blocks (64 tokens): 36 tokens to compute, plus 32
    # already in flight there → (36 + 32) / 16 = 4.25 prefill blocks; 10 decode blocks active.
    # B holds nothing: 100 / 16 = 6.25 prefill blocks, 2 decode blocks.
    workers = [WorkerSnapshot(A, 4, 32, 10), WorkerSnapshot(B, 0, 0, 2)]
    scored = worker_costs(100, 16, workers, overlap_score_weight=2.0, queued_prefill_weight=1.0)
    assert scored == [Scored(A, 2.0 * 4.25 + 10, 4, 36), Scored(B, 2.0 * 6.25 + 2, 0, 100)]
    # Weight 2: A costs 18.5, B 14.5, so B wins; weight 4: A 27, B 27 - a tie; weight 5: A 31.25 < B 33.25.
    for weight, winner in ((2.0, B), (5.0, A)):
        chosen = choose_worker(
            100,
            16,
            workers,
            overlap_score_weight=weight,
            queued_prefill_weight=1.0,
            temperature=0.0,
            rng=random.Random(0),
        )
        assert chosen is not None and chosen.worker == winner


def test_prefill_already_in_flight_counts_at_its_weight() -> None:
    # A 128-token prompt in blocks of 16. A holds all but the last block: 16 tokens to compute, and 256
    # prompt tokens of other requests are in flight there. B holds nothing and has nothing in flight.
    # Counted in full, A has (16 + 256) / 16 = 17 prefill blocks against B's 8: B wins. At weight 0.5,
    # A has (16 + 128) / 16 = 9 against 8 (still B); at 0.25, (16 + 64) / 16 = 5 against 8: A wins.
    workers = [WorkerSnapshot(A, 7, 256, 0), WorkerSnapshot(B, 0, 0, 0)]
    costs = {
        queued: [
            entry.cost
            for entry in worker_costs(128, 16, workers, overlap_score_weight=1.0, queued_prefill_weight=queued)
        ]
        for queued in (1.0, 0.5, 0.25)
    }
    assert costs == {1.0: [17.0, 8.0], 0.5: [9.0, 8.0], 0.25: [5.0, 8.0]}
    for queued, winner in ((1.0, B), (0.5, B), (0.25, A)):
        chosen = choose_worker(
            128,
            16,
            workers,
            overlap_score_weight=1.0,
            temperature=0.0,
            rng=random.Random(0),
            queued_prefill_weight=queued,
        )
        assert chosen is not None and chosen.worker == winner
        # What the request itself has to compute is not weighed down: it is still all of it.
        assert chosen.prefill_tokens == (16 if winner == A else 128)


def test_weight_zero_balances_on_decode_blocks_alone() -> None:
    workers = [WorkerSnapshot(A, 8, 0, 5), WorkerSnapshot(B, 0, 500, 4)]
    chosen = choose_worker(
        128, 16, workers, overlap_score_weight=0.0, queued_prefill_weight=1.0, temperature=0.0, rng=random.Random(0)
    )
    assert chosen is not None and chosen.worker == B and chosen.cost == 4


def test_the_longest_cached_prefix_wins_when_loads_are_equal() -> None:
    workers = [WorkerSnapshot(A, 1, 0, 0), WorkerSnapshot(B, 6, 0, 0), WorkerSnapshot(C, 3, 0, 0)]
    chosen = choose_worker(
        128, 16, workers, overlap_score_weight=1.0, queued_prefill_weight=1.0, temperature=0.0, rng=random.Random(0)
    )
    assert chosen == Scored(B, 2.0, 6, 32)


def test_a_fully_cached_prompt_has_nothing_left_to_compute() -> None:
    scored = worker_costs(32, 16, [WorkerSnapshot(A, 2, 0, 0)], overlap_score_weight=1.0, queued_prefill_weight=1.0)
    assert scored == [Scored(A, 0.0, 2, 0)]


def test_ties_are_broken_at_random_among_the_cheapest_only() -> None:
    scored = [Scored(A, 3.0, 0, 0), Scored(B, 3.0, 0, 0), Scored(C, 3.5, 0, 0)]
    rng = random.Random(1)
    picks = Counter(pick(scored, temperature=0.0, rng=rng).worker for _ in range(400))
    assert set(picks) == {A, B}
    assert min(picks.values()) > 150  # about even: 200 each


def test_softmax_weights_follow_normalised_costs() -> None:
    # Costs 10, 20, 30 normalise to 0, 0.5, 1: at temperature 0.5 the weights are e^0, e^-1, e^-2.
    assert softmax_weights([10.0, 20.0, 30.0], 0.5) == pytest.approx([1.0, math.exp(-1), math.exp(-2)])
    # Normalisation makes the weights independent of the scale of the costs.
    assert softmax_weights([1000.0, 2000.0, 3000.0], 0.5) == pytest.approx(softmax_weights([1.0, 2.0, 3.0], 0.5))
    assert softmax_weights([7.0, 7.0], 1.0) == [1.0, 1.0]


def test_with_a_temperature_workers_are_drawn_in_softmax_proportions() -> None:
    scored = [Scored(A, 10.0, 0, 0), Scored(B, 20.0, 0, 0), Scored(C, 30.0, 0, 0)]
    rng = random.Random(7)
    draws = 20_000
    picks = Counter(pick(scored, temperature=0.5, rng=rng).worker for _ in range(draws))
    total = 1 + math.exp(-1) + math.exp(-2)
    for worker, weight in ((A, 1.0), (B, math.exp(-1)), (C, math.exp(-2))):
        assert picks[worker] / draws == pytest.approx(weight / total, abs=0.02)


def test_a_tiny_temperature_is_practically_the_cheapest_and_a_huge_one_practically_uniform() -> None:
    scored = [Scored(A, 10.0, 0, 0), Scored(B, 11.0, 0, 0)]
    rng = random.Random(3)
    assert {pick(scored, temperature=0.01, rng=rng).worker for _ in range(200)} == {A}
    picks = Counter(pick(scored, temperature=1000.0, rng=rng).worker for _ in range(4000))
    assert picks[B] / 4000 == pytest.approx(0.5, abs=0.04)


def test_no_workers_means_no_choice() -> None:
    assert (
        choose_worker(
            10, 16, [], overlap_score_weight=1.0, queued_prefill_weight=1.0, temperature=0.0, rng=random.Random()
        )
        is None
    )
    with pytest.raises(ValueError, match="no worker"):
        pick([], temperature=0.0, rng=random.Random())


def test_blocks_the_request_would_add_count_as_decode_load() -> None:
    # A 64-token prompt in blocks of 16, nothing cached anywhere. A runs 10 blocks, of which the prompt
    # shares 3 (a system prompt): it adds 1 there; B runs 9, none shared: the prompt adds all 4.
    workers = [WorkerSnapshot(A, 0, 0, 10, new_blocks=1), WorkerSnapshot(B, 0, 0, 9, new_blocks=4)]
    scored = worker_costs(64, 16, workers, overlap_score_weight=1.0, queued_prefill_weight=1.0)
    assert scored == [Scored(A, 4.0 + 10 + 1, 0, 64), Scored(B, 4.0 + 9 + 4, 0, 64)]


def test_blocks_on_a_lower_tier_count_as_hits_at_their_weight() -> None:
    # A 128-token prompt in blocks of 16. A holds 2 blocks on its device and the next 4 in host memory;
    # B holds 2 on its device and the next 4 on a disk; C holds 4 on its device. At weights 0.75 and 0.25,
    # A saves (2 + 3) blocks = 80 tokens, B (2 + 1) = 48, C 64: A computes 48 tokens, B 80, C 64.
    workers = [WorkerSnapshot(A, 2, 0, 0, host_blocks=4), WorkerSnapshot(B, 2, 0, 0, far_blocks=4)]
    workers.append(WorkerSnapshot(C, 4, 0, 0))
    scored = worker_costs(
        128,
        16,
        workers,
        overlap_score_weight=1.0,
        queued_prefill_weight=0.5,
        host_hit_weight=0.75,
        disk_hit_weight=0.25,
    )
    assert [(entry.worker, entry.prefill_tokens, entry.overlap_blocks) for entry in scored] == [
        (A, 48, 2),
        (B, 80, 2),
        (C, 64, 4),
    ]
    assert [entry.cost for entry in scored] == [3.0, 5.0, 4.0]
    # At weight 0 a lower tier saves nothing: the device holder wins.
    unweighted = worker_costs(128, 16, workers, overlap_score_weight=1.0, queued_prefill_weight=0.5)
    assert min(unweighted, key=lambda entry: entry.cost).worker == C
