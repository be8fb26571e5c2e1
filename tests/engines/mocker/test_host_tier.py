"""The host KV tier on its own: reserved now, copied at the next step, landed when the copy ends, evicted
least recently used first; its events and state say ``medium="cpu"``. Times are simulated seconds."""

import pytest

from engines.mocker.host_tier import HostTier, block_seconds
from runtime.kv.events import BlockRemoved, BlockStored

A, B, C, D = 11, 12, 13, 14


def tier(num_blocks: int = 4, d2h: float = 0.5, h2d: float = 0.25) -> HostTier:
    host = HostTier(num_blocks, d2h_block_seconds=d2h, h2d_block_seconds=h2d)
    host.record_events = True
    return host


def landed(host: HostTier, *cohorts: list[tuple[int, int | None]]) -> HostTier:
    """``host`` with ``cohorts`` copied and landed, in order."""
    for cohort in cohorts:
        assert host.prepare(cohort)
    host.submit(0.0)
    while (deadline := host.next_deadline()) is not None:
        host.tick(deadline)
    host.take_events()
    return host


def test_a_copy_costs_its_bytes_over_the_bandwidth_divided_by_the_speedup() -> None:
    assert block_seconds(2_000_000_000, 32.0, 1.0) == pytest.approx(1 / 16)
    assert block_seconds(2_000_000_000, 32.0, 10.0) == pytest.approx(1 / 160)
    assert block_seconds(2_000_000_000, 0.0, 1.0) == 0.0  # bandwidth 0: unlimited
    assert block_seconds(2_000_000_000, 32.0, 0.0) == 0.0  # speed-up 0: no waiting at all


def test_a_cohort_is_reserved_at_once_copied_from_the_next_submit_and_lands_when_its_copy_ends() -> None:
    host = tier()
    assert host.prepare([(A, None), (B, A)])
    assert host.used_blocks == 2 and not host.holds(A)
    assert host.lookup([A, B], 0, 2) == (0, True)  # being copied: look again later
    assert host.next_deadline() is None and host.busy  # reserved, not yet on the lane
    host.submit(1.0)
    assert host.next_deadline() == pytest.approx(2.0)  # two blocks at 0.5 s from 1.0
    host.tick(1.9)
    assert not host.holds(A) and host.take_events() == []
    host.tick(2.0)
    assert host.holds(A) and host.holds(B) and host.offloaded_blocks == 2
    assert host.take_events() == [BlockStored([A, B], None, medium="cpu")]
    assert host.lookup([A, B, C], 0, 3) == (2, False)
    assert not host.busy


def test_copies_out_share_one_lane_first_in_first_out() -> None:
    host = tier()
    assert host.prepare([(A, None)])
    assert host.prepare([(C, None)])
    host.submit(0.0)
    host.tick(0.5)
    assert host.holds(A) and not host.holds(C)  # the second starts when the first has ended
    host.tick(1.0)
    assert host.holds(C)


def test_blocks_already_on_the_host_are_not_copied_again() -> None:
    host = landed(tier(), [(A, None), (B, A)])
    assert host.prepare([(A, None), (B, A), (C, B)])
    host.submit(10.0)
    assert host.next_deadline() == pytest.approx(10.5)  # C alone
    host.tick(10.5)
    assert host.take_events() == [BlockStored([C], B, medium="cpu")] and host.offloaded_blocks == 3


def test_eviction_takes_the_least_recently_used_block_and_is_announced_on_the_cpu_tier() -> None:
    host = landed(tier(num_blocks=2), [(A, None)], [(B, None)])
    host.lookup([A], 0, 1)  # A used again: B is now the least recently used
    assert host.prepare([(C, None)])
    assert host.take_events() == [BlockRemoved([B], medium="cpu")]
    assert host.holds(A) and not host.holds(B) and host.used_blocks == 2


def test_a_lookup_touches_a_prompts_blocks_last_first_so_its_first_block_is_evicted_last() -> None:
    host = landed(tier(num_blocks=3), [(A, None), (B, A), (C, B)])
    host.lookup([A, B, C], 0, 3)
    assert host.prepare([(D, None)])
    assert host.take_events() == [BlockRemoved([C], medium="cpu")]


def test_a_block_being_copied_back_is_not_evicted_and_a_cohort_waits_when_nothing_can_be() -> None:
    host = landed(tier(num_blocks=2), [(A, None), (B, A)])
    ident, ends = host.load([A, B], 1.0)
    assert ends == pytest.approx(1.5)  # two blocks at 0.25 s
    assert not host.prepare([(C, None)])  # both are being read: nothing to evict
    assert host.used_blocks == 2 and host.take_events() == []
    assert host.tick(1.5) == [ident] and host.onboarded_blocks == 2
    assert host.holds(A)  # a copy back leaves the host's copy in place
    assert host.prepare([(C, None)])


def test_a_cancelled_copy_back_frees_its_blocks_for_eviction() -> None:
    host = landed(tier(num_blocks=1), [(A, None)])
    ident, _ = host.load([A], 0.0)
    assert not host.prepare([(B, None)])
    host.cancel_load(ident)
    assert host.prepare([(B, None)]) and host.onboarded_blocks == 0


def test_a_cohort_larger_than_the_tier_keeps_its_first_blocks() -> None:
    host = tier(num_blocks=2)
    assert host.prepare([(A, None), (B, A), (C, B)])
    host.submit(0.0)
    host.tick(10.0)
    assert host.holds(A) and host.holds(B) and not host.holds(C)


def test_the_state_lists_landed_blocks_on_the_cpu_tier_parents_first() -> None:
    host = landed(tier(num_blocks=4), [(A, None), (B, A)])
    assert host.prepare([(C, None)])  # reserved, not landed: not in the state
    assert host.cache_state() == [BlockStored([A, B], None, medium="cpu")]


def test_a_parent_evicted_and_copied_again_after_its_child_still_comes_first_in_the_state() -> None:
    host = landed(tier(num_blocks=3), [(A, None), (B, A)], [(C, None)])
    host.lookup([B], 0, 1)  # A is the least recently used
    landed(host, [(D, None)])  # evicts A
    landed(host, [(A, None)])  # evicts C; A is now held after B
    assert host.cache_state() == [BlockStored([A, B], None, medium="cpu"), BlockStored([D], None, medium="cpu")]
