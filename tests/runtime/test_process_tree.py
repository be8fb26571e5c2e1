"""A worker's tree is ended whole and alone: every process whose environment holds its mark, wherever it runs,
one that ignores SIGTERM killed after the grace, and nothing of another tree or unmarked."""

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from runtime.process_tree import TREE_VARIABLE, Tree, end_tree, members, new_mark
from tests.process_trees import Leftovers, running

# Prints a line once it ignores SIGTERM (or at once), then waits for a signal.
SLEEPER = """
import signal, sys
if sys.argv[1:] == ["stubborn"]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
signal.pause()
"""


@pytest.fixture
def leftovers() -> Iterator[Leftovers]:
    seen = Leftovers()
    yield seen
    seen.kill()


def start(leftovers: Leftovers, mark: str | None, *args: str) -> int:
    """A sleeper in a session of its own, its environment marked ``mark``; its pid once it is ready."""
    env = {name: value for name, value in os.environ.items() if name != TREE_VARIABLE}
    if mark is not None:
        env[TREE_VARIABLE] = mark
    process = subprocess.Popen(
        [sys.executable, "-c", SLEEPER, *args], env=env, stdout=subprocess.PIPE, start_new_session=True
    )
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    leftovers.add([process.pid])
    return process.pid


def test_every_marked_process_ends_and_one_ignoring_sigterm_is_killed_after_the_grace(leftovers: Leftovers) -> None:
    mark, other_mark = new_mark(), new_mark()
    plain = start(leftovers, mark)
    stubborn = start(leftovers, mark, "stubborn")
    unmarked = start(leftovers, None)
    another_tree = start(leftovers, other_mark)
    assert members(Tree(mark=mark)) == sorted([plain, stubborn])

    ending = end_tree(Tree(mark=mark), grace_s=0.2)

    assert sorted(ending.ended) == sorted([plain, stubborn]) and ending.remaining == []
    assert running([plain, stubborn]) == []
    assert running([unmarked, another_tree]) == [unmarked, another_tree]
    assert end_tree(Tree(mark=mark)).ended == []  # nothing left: it returns at once
