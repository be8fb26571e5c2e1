"""How `make test` splits the suite: the parts it runs must together hold every test."""

import re
import subprocess
from pathlib import Path

TESTS = Path(__file__).parent
#: `make test-vllm` collects only these files (Makefile: VLLM_TESTS), in the venv that has vLLM.
VLLM_FILES = sorted(TESTS.glob("engines/test_vllm*.py"))


def test_every_test_marked_vllm_is_in_a_file_the_vllm_step_collects() -> None:
    marked = {
        path
        for path in TESTS.rglob("*.py")
        if re.search(r"\bVLLM_MARKS\b|pytest\.mark\.vllm\b", path.read_text()) and path.name != "vllm_model.py"
    }
    assert marked, "no test is marked vllm: the pattern above no longer finds them"
    assert marked <= set(VLLM_FILES), sorted(str(path) for path in marked - set(VLLM_FILES))


def test_the_makefile_collects_the_vllm_files_and_runs_the_serial_part_alone() -> None:
    makefile = (TESTS.parent / "Makefile").read_text()
    # What `make test-vllm` would run (-n: printed, not run), its pytest line naming every vLLM file once.
    printed = subprocess.run(
        ["make", "-n", "--no-print-directory", "test-vllm"],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    [command] = [line for line in printed.splitlines() if "pytest" in line and "-m vllm" in line]
    named = [word for word in command.split() if word.startswith("tests/")]
    assert sorted(named) == [str(path.relative_to(TESTS.parent)) for path in VLLM_FILES]
    assert '-m "not serial"' in makefile and "pytest -q -m serial" in makefile
