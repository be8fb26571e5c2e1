"""The instance state machine: which moves it allows, and that racing moves cannot both apply."""

import re

import pytest

from controlplane.deployments.instance_states import TRANSITIONS, InstanceState, check_transition
from controlplane.deployments.instances import transition
from controlplane.deployments.models import Instance
from controlplane.errors import Conflict, InvalidTransition
from tests.controlplane.factories import deploy

S = InstanceState

ALLOWED = {
    (S.PENDING, S.DOWNLOADING),
    (S.PENDING, S.STARTING),
    (S.PENDING, S.READY),
    (S.PENDING, S.STOPPING),
    (S.PENDING, S.STOPPED),
    (S.PENDING, S.FAILED),
    (S.DOWNLOADING, S.STARTING),
    (S.DOWNLOADING, S.READY),
    (S.DOWNLOADING, S.STOPPING),
    (S.DOWNLOADING, S.FAILED),
    (S.STARTING, S.READY),
    (S.STARTING, S.STOPPING),
    (S.STARTING, S.FAILED),
    (S.READY, S.STOPPING),
    (S.READY, S.FAILED),
    (S.STOPPING, S.STOPPED),
    (S.STOPPING, S.FAILED),
    (S.STOPPING, S.PENDING),
    (S.FAILED, S.PENDING),
    (S.FAILED, S.STOPPED),
}


@pytest.mark.parametrize("current", list(S))
@pytest.mark.parametrize("new", list(S))
def test_exactly_the_drawn_transitions_are_allowed(current: S, new: S) -> None:
    if (current, new) in ALLOWED:
        check_transition(current, new)
    else:
        with pytest.raises(InvalidTransition, match=f"from {current.value} to {new.value}"):
            check_transition(current, new)


def test_every_state_has_an_entry_and_stopped_is_final() -> None:
    assert set(TRANSITIONS) == set(S)
    assert TRANSITIONS[S.STOPPED] == frozenset()
    with pytest.raises(InvalidTransition, match="none \\(it is final\\)"):
        check_transition(S.STOPPED, S.PENDING)


def test_the_model_docstring_lists_exactly_the_allowed_moves() -> None:
    listed: dict[str, set[str]] = {}
    for line in (Instance.__doc__ or "").splitlines():
        if match := re.fullmatch(r"\s+(\w+)\s+→ (.*)", line):
            state, targets = match.groups()
            listed[state] = set() if targets == "(final)" else set(targets.split(", "))
    assert listed == {state.value: {target.value for target in TRANSITIONS[state]} for state in S}


@pytest.mark.django_db
@pytest.mark.postgresql
def test_a_transition_from_a_state_read_before_another_change_is_refused() -> None:
    instance = deploy().instances.get()
    stale = Instance.objects.get(pk=instance.pk)
    transition(instance, S.STOPPED, reason="first")
    with pytest.raises(Conflict, match="changed meanwhile \\(it is stopped now\\)"):
        transition(stale, S.FAILED, reason="second")
    instance.refresh_from_db()
    assert (instance.state, instance.reason) == (S.STOPPED, "first")


@pytest.mark.django_db
def test_a_transition_records_when_the_state_changed() -> None:
    instance = deploy().instances.get()
    before = instance.state_changed_at
    transition(instance, S.FAILED, reason="out of memory")
    instance.refresh_from_db()
    assert instance.state == S.FAILED
    assert instance.state_changed_at >= before
