"""The starts kept on disk until their worker is launched (agent/instances/start_files.py)."""

import logging
from pathlib import Path

import msgspec
import pytest

from agent.instances.start_files import StartFiles
from runtime.fleet_contract.tasks import HubSource, StartInstance, WorkerSpec


def start(instance_id: int, attempt: int, incarnation: str = "") -> StartInstance:
    spec = msgspec.convert(
        {"instance_id": instance_id, "pipeline": "p", "group": "aggregated", "replica": 0, "engine": "mocker"},
        WorkerSpec,
    )
    return StartInstance(spec=spec, source=HubSource("acme/tiny-llm"), attempt=attempt, incarnation=incarnation)


def test_a_kept_start_comes_back_whole_and_only_its_own_end_removes_it(tmp_path: Path) -> None:
    files = StartFiles(tmp_path / "state")
    files.save(start(1, attempt=0, incarnation="inc"))
    files.save(start(1, attempt=1, incarnation="inc"))  # a newer start replaces it
    files.save(start(2, attempt=0))
    assert files.load_all() == [start(1, attempt=1, incarnation="inc"), start(2, attempt=0)]
    files.forget_start(start(1, attempt=0, incarnation="inc"))  # the older start ending leaves the newer one
    assert [request.attempt for request in files.load_all()] == [1, 0]
    files.forget_start(start(1, attempt=1, incarnation="inc"))
    files.forget(2)
    assert files.load_all() == []


def test_a_file_that_holds_no_start_is_logged_and_removed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    state = tmp_path / "state"
    state.mkdir()
    (state / "start-3.json").write_text("{not json")
    (state / "start-4.json").write_bytes(msgspec.json.encode(start(5, attempt=0)))  # another instance's start
    assert StartFiles(state).load_all() == []
    assert sorted(path.name for path in state.iterdir()) == []
    assert "start-3.json, which holds no start this agent can read" in caplog.text
    assert "start-4.json, which holds a start of instance 5" in caplog.text


def test_a_state_folder_that_cannot_be_written_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "state"
    blocked.write_text("a file where the folder should be")
    StartFiles(blocked).save(start(1, attempt=0))
    assert "cannot keep instance 1's start" in caplog.text
