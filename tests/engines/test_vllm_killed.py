"""`flotilla run out=vllm` killed with SIGKILL, as the out-of-memory killer kills, leaves none of vLLM's processes
running: its engine core (which holds the model and the KV cache, on a GPU node the GPU memory the replacement
needs) ends with it (launcher/worker_tree.py's guard ends it; under the agent, the agent does).

One vLLM start with its CPU build: `make test-vllm` runs it (tests/engines/vllm_model.py)."""

from pathlib import Path

import pytest

from tests.engines.vllm_model import ENGINE_ARGS, KV_CACHE_ENV, VLLM_MARKS
from tests.process_trees import Leftovers, descendants, running, wait_ended
from tests.servers import start_server

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(600)]


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_flotilla_run_out_vllm_killed_with_sigkill_leaves_no_engine_core(
    vllm_model_folder: Path, tmp_path: Path
) -> None:
    args = ["out=vllm", str(vllm_model_folder), "--model-name", "smol", "--extra-engine-args", ENGINE_ARGS]
    server = start_server(args, tmp_path / "run.log", env={**KV_CACHE_ENV}, timeout=300)
    leftovers = Leftovers()
    try:
        engine = descendants(server.process.pid)
        leftovers.add(engine)
        titles = [command_line(pid) for pid in engine]
        assert any("EngineCore" in title for title in titles), titles  # vLLM's own title for it
        server.process.kill()
        assert server.process.wait(timeout=30) == -9
        assert wait_ended(engine, timeout_s=60) == [], [command_line(pid) for pid in running(engine)]
    finally:
        server.process.kill()
        leftovers.kill()
