"""Active load per worker: the router's own decisions, corrected by the workers' reports."""

from frontend_gateway.routing.kv_load import ActiveLoad
from runtime.kv.events import WorkerLoad

A, B = (1, 0), (2, 0)


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_prompt_tokens_are_in_flight_until_prefill_done_and_blocks_active_until_finished() -> None:
    load = ActiveLoad()
    load.started("r1", A, prefill_tokens=100, own_blocks=7)
    load.started("r2", A, prefill_tokens=20, own_blocks=2)
    assert (load.prefill_tokens(A), load.decode_blocks(A), load.requests(A)) == (120, 9, 2)
    load.prefill_done("r1")
    load.prefill_done("r1")  # repeated: counted once
    assert (load.prefill_tokens(A), load.decode_blocks(A)) == (20, 9)
    load.finished("r1")
    load.finished("r2")  # finished before its prefill was done (an error, a cancellation)
    assert (load.prefill_tokens(A), load.decode_blocks(A), load.requests(A), load.in_flight()) == (0, 0, 0, 0)


def test_notices_for_unknown_requests_change_nothing() -> None:
    load = ActiveLoad()
    load.started("r1", A, prefill_tokens=10, own_blocks=1)
    load.prefill_done("other")
    load.finished("other")
    load.finished("r1")
    load.finished("r1")
    assert (load.prefill_tokens(A), load.decode_blocks(A), load.requests(A)) == (0, 0, 0)
    assert load.prefill_tokens(B) == 0 and load.decode_blocks(B) == 0


def test_a_request_started_again_without_finishing_is_never_counted_twice() -> None:
    load = ActiveLoad()
    load.started("r1", A, prefill_tokens=10, own_blocks=3)
    load.started("r1", B, prefill_tokens=12, own_blocks=4)  # a migration whose finish notice was lost
    assert (load.decode_blocks(A), load.decode_blocks(B)) == (0, 4)


def test_a_fresh_report_replaces_the_count_and_later_decisions_add_to_it() -> None:
    clock = Clock()
    load = ActiveLoad(clock=clock, report_fresh_s=5)
    load.started("r1", A, prefill_tokens=0, own_blocks=10)
    # The worker holds 25 blocks: other routers' requests, or fewer if requests share blocks.
    load.observe(WorkerLoad(instance_id=1, active_requests=3, kv_active_blocks=25))
    assert load.decode_blocks(A) == 25
    load.started("r2", A, prefill_tokens=0, own_blocks=4)
    assert load.decode_blocks(A) == 29
    load.finished("r1")
    assert load.decode_blocks(A) == 19
    clock.now += 6  # the report is stale: the router's own count again
    assert load.decode_blocks(A) == 4


def test_a_report_without_block_counts_does_not_correct_anything() -> None:
    load = ActiveLoad()
    load.started("r1", A, prefill_tokens=0, own_blocks=10)
    load.observe(WorkerLoad(instance_id=1, active_requests=40))
    assert load.decode_blocks(A) == 10


def test_a_corrected_count_never_goes_below_zero() -> None:
    load = ActiveLoad()
    load.started("r1", A, prefill_tokens=0, own_blocks=10)
    load.observe(WorkerLoad(instance_id=1, active_requests=1, kv_active_blocks=2))
    load.finished("r1")
    assert load.decode_blocks(A) == 0


def test_removing_an_instance_forgets_its_load_and_requests() -> None:
    load = ActiveLoad()
    load.started("r1", A, prefill_tokens=5, own_blocks=1)
    load.started("r2", B, prefill_tokens=5, own_blocks=1)
    load.remove_instance(1)
    assert (load.decode_blocks(A), load.in_flight()) == (0, 1)
    load.finished("r1")  # the stream's notice after the instance left: a no-op
    assert load.decode_blocks(B) == 1


def test_a_report_that_missed_requests_on_their_way_never_lowers_the_router_s_own_count() -> None:
    load = ActiveLoad()
    load.started("r1", A, prefill_tokens=160, own_blocks=10)
    # The worker reports before r1 reached it: nothing active.
    load.observe(WorkerLoad(instance_id=1, active_requests=0, kv_active_blocks=0))
    assert load.decode_blocks(A) == 10
    load.started("r2", A, prefill_tokens=160, own_blocks=10)
    assert load.decode_blocks(A) == 20


def test_prompt_blocks_that_running_requests_share_are_held_once() -> None:
    load = ActiveLoad()
    # Two requests on A share their first 3 blocks (a system prompt); each has 2 blocks of its own.
    load.started("r1", A, prefill_tokens=0, hashes=[11, 12, 13, 21], own_blocks=2)
    load.started("r2", A, prefill_tokens=0, hashes=[11, 12, 13, 31, 32], own_blocks=2)
    # Held: 11, 12, 13, 21, 31, 32 once each, and 2 + 2 own.
    assert load.decode_blocks(A) == 6 + 4
    # A third prompt with the same system prompt adds only its other blocks on A, all of them on B.
    assert (load.new_blocks(A, [11, 12, 13, 41]), load.new_blocks(B, [11, 12, 13, 41])) == (1, 4)
    load.finished("r1")
    # r2 still holds the shared blocks; r1's own ones are gone.
    assert load.decode_blocks(A) == 5 + 2
    assert load.new_blocks(A, [11, 21]) == 1
    load.finished("r2")
    assert (load.decode_blocks(A), load.new_blocks(A, [11, 12])) == (0, 2)


def test_a_worker_whose_reported_cache_is_full_enough_is_busy_until_its_report_goes_stale() -> None:
    clock = Clock()
    load = ActiveLoad(clock=clock)
    load.observe(WorkerLoad(instance_id=1, active_requests=3, kv_usage=0.95, kv_total_blocks=100))
    assert load.busy(A, kv_usage=0.9, waiting=None)
    assert not load.busy(A, kv_usage=0.96, waiting=None)
    clock.now += 60  # no report since: the router's own count (nothing) is all it knows
    assert not load.busy(A, kv_usage=0.9, waiting=None)


def test_the_routers_own_blocks_make_a_worker_busy_before_its_next_report() -> None:
    load = ActiveLoad()
    load.observe(WorkerLoad(instance_id=1, active_requests=0, kv_usage=0.0, kv_total_blocks=10))
    load.started("r1", A, prefill_tokens=10, own_blocks=9)
    assert load.busy(A, kv_usage=0.9, waiting=None)
    load.finished("r1")
    assert not load.busy(A, kv_usage=0.9, waiting=None)


def test_a_worker_reporting_enough_waiting_requests_is_busy() -> None:
    load = ActiveLoad()
    load.observe(WorkerLoad(instance_id=1, active_requests=5, waiting=3))
    assert load.busy(A, kv_usage=None, waiting=3)
    assert not load.busy(A, kv_usage=None, waiting=4)
    assert not load.busy(B, kv_usage=0.5, waiting=1)  # never heard from: not busy


def test_a_workers_kv_usage_is_its_fresh_report_or_the_routers_own_count_and_unknown_if_never_heard() -> None:
    clock = Clock()
    load = ActiveLoad(clock=clock)
    assert load.kv_usage(A) is None  # never heard of: the decode gate denies a local prefill there
    load.observe(WorkerLoad(instance_id=1, active_requests=1, kv_usage=0.4, kv_total_blocks=100))
    assert load.kv_usage(A) == 0.4
    load.started("r1", A, prefill_tokens=0, own_blocks=60)
    assert load.kv_usage(A) == 0.6  # the router's own decision counts before the next report
    clock.now += 60
    load.finished("r1")
    assert load.kv_usage(A) == 0.0  # a stale report no longer counts; the router holds nothing there
