"""When `flotilla up` restarts a part that ended, after how long, and when it gives up on it."""

import signal

from launcher.stack.restarts import GiveUp, Restart, RestartHistory, RestartPolicy, describe_end

KILLED = -signal.SIGKILL


def test_the_delay_doubles_from_one_second_up_to_thirty() -> None:
    history = RestartHistory(RestartPolicy(burst=8, window_s=1000))
    delays = [history.ended(float(now), KILLED) for now in range(8)]
    assert delays == [Restart(delay_s=d, number=n) for n, d in enumerate([1, 2, 4, 8, 16, 30, 30, 30], start=1)]


def test_one_end_more_than_the_burst_within_the_window_gives_up() -> None:
    history = RestartHistory(RestartPolicy(burst=2, window_s=120))
    assert isinstance(history.ended(0.0, 1), Restart)
    assert isinstance(history.ended(10.0, 1), Restart)
    decision = history.ended(20.0, 1)
    assert decision == GiveUp(ends=3)
    assert decision.why(history.policy) == "its 3rd end within 120 s: it keeps failing"


def test_ends_older_than_the_window_are_forgotten_and_the_delay_starts_again() -> None:
    history = RestartHistory(RestartPolicy(burst=2, window_s=120))
    history.ended(0.0, KILLED)
    history.ended(10.0, KILLED)
    assert history.ended(125.0, KILLED) == Restart(delay_s=2, number=2)  # the end at 0 s has left the window
    assert history.ended(300.0, KILLED) == Restart(delay_s=1, number=1)


def test_exit_code_2_gives_up_at_once_since_the_same_configuration_would_be_refused_again() -> None:
    decision = RestartHistory(RestartPolicy()).ended(0.0, 2)
    assert decision == GiveUp(ends=1, refused=True)
    assert "restarting it cannot help" in decision.why(RestartPolicy())


def test_a_burst_of_zero_gives_up_on_the_first_end() -> None:
    policy = RestartPolicy(burst=0)
    decision = RestartHistory(policy).ended(0.0, KILLED)
    assert decision == GiveUp(ends=1)
    assert decision.why(policy) == "and restarts are off (--restart-burst 0)"


def test_an_end_is_described_by_its_code_or_its_signal() -> None:
    assert describe_end(1) == "exited with code 1"
    assert describe_end(KILLED) == "was killed by signal 9 (SIGKILL)"
