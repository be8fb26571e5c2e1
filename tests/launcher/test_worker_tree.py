"""`flotilla run` started by hand and killed with SIGKILL (as the out-of-memory killer kills) leaves none of its
engine's processes running: its guard ends them, those in sessions of their own and one forked without exec
included (launcher/worker_tree.py). The engine is a Python file that starts processes as SGLang's does
(tests/process_trees.py)."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.process_trees import ENGINE_PROCESSES, Leftovers, running, tree_pids, wait_ended
from tests.servers import start_server

ENGINE = (
    ENGINE_PROCESSES
    + """

async def generate(request):
    yield {"text": "ok", "finish_reason": "stop"}
"""
)


@pytest.fixture
def leftovers() -> Iterator[Leftovers]:
    seen = Leftovers()
    yield seen
    seen.kill()


def test_flotilla_run_killed_with_sigkill_leaves_none_of_its_engines_processes(
    tmp_path: Path, leftovers: Leftovers
) -> None:
    engine = tmp_path / "engine.py"
    engine.write_text(ENGINE)
    server = start_server([f"out=pystr:{engine}"], tmp_path / "run.log")
    tree = tree_pids(server.log())
    leftovers.add(tree)
    assert running(tree) == tree
    server.process.kill()
    assert server.process.wait(timeout=10) == -9
    # The guard's grace for the process that ignores SIGTERM is 10 s; then it is killed.
    assert wait_ended(tree, timeout_s=60) == [], server.log()
