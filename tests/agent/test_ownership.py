"""Which workers the control plane's list of the node's instances disowns: not listed, listed in a state that
wants no process, or at a newer attempt; what the list leaves in doubt is kept."""

from agent.control_plane_client import AgentInstance
from agent.instances.ownership import disowned


def test_workers_not_listed_stopping_failed_or_of_an_older_attempt_are_disowned() -> None:
    listing = [
        AgentInstance(id=1, state="ready", attempt=0),
        AgentInstance(id=2, state="stopping", attempt=0),
        AgentInstance(id=3, state="failed", attempt=0),
        AgentInstance(id=4, state="pending", attempt=2),
        AgentInstance(id=6, state="starting", attempt=1),
        AgentInstance(id=7, state="ready"),  # a control plane that does not say its attempt
    ]
    workers = {1: 0, 2: 0, 3: 0, 4: 1, 5: 0, 6: 1, 7: 0, 8: None}
    verdicts = {verdict.instance_id: verdict for verdict in disowned(workers, listing)}

    assert sorted(verdicts) == [2, 3, 4, 5, 8]
    assert verdicts[5].why == "instance 5 is no longer placed on this node"
    assert verdicts[2].why == "the control plane has instance 2 stopping" and verdicts[2].awaits_stop
    assert verdicts[3].why == "the control plane has instance 3 failed" and not verdicts[3].awaits_stop
    assert verdicts[4].why == "the control plane is at attempt 2 of instance 4 (pending), this worker runs attempt 1"
    assert verdicts[8].listed_state is None and not verdicts[8].awaits_stop


def test_an_attempt_either_side_does_not_know_keeps_the_worker() -> None:
    listing = [AgentInstance(id=1, state="ready"), AgentInstance(id=2, state="ready", attempt=3)]
    assert disowned({1: 4, 2: None}, listing) == []
    assert disowned({}, listing) == []


def test_a_worker_started_just_before_the_list_was_asked_for_is_kept_while_the_list_may_not_show_it() -> None:
    listing = [AgentInstance(id=2, state="failed", attempt=0)]
    verdicts = disowned({1: 0, 2: 0}, listing, recent={1, 2})
    assert [verdict.instance_id for verdict in verdicts] == [2]  # what the list says of it counts at once
