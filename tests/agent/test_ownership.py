"""Which workers the control plane's list of the node's instances disowns: not listed, listed in a state that
wants no process, at a newer attempt, or of another incarnation; what the list leaves in doubt is kept."""

from agent.control_plane_client import AgentInstance
from agent.instances.ownership import Started, disowned

OLD, NEW = "a" * 32, "b" * 32


def _started(attempts: dict[int, int | None]) -> dict[int, Started]:
    return {instance_id: Started(attempt) for instance_id, attempt in attempts.items()}


def test_workers_not_listed_stopping_failed_or_of_an_older_attempt_are_disowned() -> None:
    listing = [
        AgentInstance(id=1, state="ready", attempt=0),
        AgentInstance(id=2, state="stopping", attempt=0),
        AgentInstance(id=3, state="failed", attempt=0),
        AgentInstance(id=4, state="pending", attempt=2),
        AgentInstance(id=6, state="starting", attempt=1),
        AgentInstance(id=7, state="ready"),  # a control plane that does not say its attempt
    ]
    workers = _started({1: 0, 2: 0, 3: 0, 4: 1, 5: 0, 6: 1, 7: 0, 8: None})
    verdicts = {verdict.instance_id: verdict for verdict in disowned(workers, listing)}

    assert sorted(verdicts) == [2, 3, 4, 5, 8]
    assert verdicts[5].why == "instance 5 is no longer placed on this node"
    assert verdicts[2].why == "the control plane has instance 2 stopping" and verdicts[2].awaits_stop
    assert verdicts[3].why == "the control plane has instance 3 failed" and not verdicts[3].awaits_stop
    assert verdicts[4].why == "the control plane is at attempt 2 of instance 4 (pending), this worker runs attempt 1"
    assert verdicts[8].listed_state is None and not verdicts[8].awaits_stop


def test_an_attempt_either_side_does_not_know_keeps_the_worker() -> None:
    listing = [AgentInstance(id=1, state="ready"), AgentInstance(id=2, state="ready", attempt=3)]
    assert disowned(_started({1: 4, 2: None}), listing) == []
    assert disowned({}, listing) == []


def test_a_worker_started_just_before_the_list_was_asked_for_is_kept_while_the_list_may_not_show_it() -> None:
    listing = [AgentInstance(id=2, state="failed", attempt=0)]
    verdicts = disowned(_started({1: 0, 2: 0}), listing, recent={1, 2})
    assert [verdict.instance_id for verdict in verdicts] == [2]  # what the list says of it counts at once


def test_a_worker_of_another_incarnation_of_the_id_is_disowned_whatever_its_attempt() -> None:
    # A database restored from an older backup gave instance id 1 to a new instance: same id, same attempt.
    listing = [
        AgentInstance(id=1, state="ready", attempt=0, incarnation=NEW),
        AgentInstance(id=2, state="ready", attempt=0, incarnation=NEW),
        AgentInstance(id=3, state="ready", attempt=0),  # a control plane that does not say
    ]
    workers = {1: Started(0, OLD), 2: Started(0, NEW), 3: Started(0, OLD)}
    (verdict,) = disowned(workers, listing)
    assert verdict.instance_id == 1 and not verdict.awaits_stop  # its "stopped" would be refused: not sent
    assert f"incarnation {NEW}, this worker's is {OLD}" in verdict.why
