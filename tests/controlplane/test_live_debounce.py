"""Per-element debounce of a socket's renders (controlplane/live/debounce.py), on an explicit clock."""

from controlplane.live.debounce import PendingRenders


def test_the_first_change_of_an_element_is_due_at_once() -> None:
    pending: PendingRenders[str] = PendingRenders(0.25)
    pending.add("node-1", now=10.0)
    assert pending.next_due() == 10.0
    assert pending.take_due(10.0) == [("node-1", 10.0)]
    assert pending.next_due() is None


def test_a_burst_of_changes_to_one_element_is_one_render_at_the_end_of_the_window() -> None:
    pending: PendingRenders[str] = PendingRenders(0.25)
    pending.add("node-1", now=10.0)
    pending.take_due(10.0)
    for moment in (10.01, 10.05, 10.2):
        pending.add("node-1", now=moment)
    assert len(pending) == 1
    assert pending.next_due() == 10.25
    assert pending.take_due(10.24) == []
    assert pending.take_due(10.25) == [("node-1", 10.2)]  # with the time of the latest change


def test_other_elements_are_not_held_back_by_a_busy_one() -> None:
    pending: PendingRenders[str] = PendingRenders(0.25)
    pending.add("node-1", now=10.0)
    pending.take_due(10.0)
    pending.add("node-1", now=10.1)
    pending.add("node-2", now=10.1)
    assert pending.take_due(10.1) == [("node-2", 10.1)]
    assert pending.take_due(10.25) == [("node-1", 10.1)]


def test_a_change_long_after_the_last_render_is_due_at_once() -> None:
    pending: PendingRenders[str] = PendingRenders(0.25)
    pending.add("node-1", now=10.0)
    pending.take_due(10.0)
    pending.add("node-1", now=11.0)
    assert pending.take_due(11.0) == [("node-1", 11.0)]


def test_renders_long_past_are_forgotten() -> None:
    pending: PendingRenders[int] = PendingRenders(0.25)
    for element in range(200):
        pending.add(element, now=1.0)
    pending.take_due(1.0)
    pending.add(1000, now=5.0)
    pending.take_due(5.0)
    assert len(pending._rendered_at) <= 1
