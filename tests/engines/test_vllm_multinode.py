"""out=vllm over two nodes, with vLLM's CPU build: the multi-node settings as vLLM's own AsyncEngineArgs and
headless config take them, and a leader and a rank 1 (two processes on this machine, one pipeline stage each)
meeting at --leader-addr, the rank exiting 1 when its worker dies.

What cannot be tested here: generation across the two stages. vLLM 0.32's CPU model runner fails every step
with pipeline parallelism, on one node as on two (``assert self.intermediate_tensors is not None`` in
``sync_and_gather_intermediate_tensors``), and SmolLM2's 9 attention heads split over no tensor-parallel size
but 1 and 3; two machines with GPUs would be needed. Run in the vLLM venv (`make test-vllm`), skipped elsewhere.
"""

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.shared.node_group import LeaderAddress, NodeGroup
from engines.vllm.settings import VllmSettings, check_extra_args, engine_arg_names
from runtime.errors import ConfigError
from tests.engines.vllm_model import ENGINE_SETTINGS, KV_CACHE_ENV, VLLM_MARKS
from tests.servers import Server, free_port, start_server

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(600)]

#: Two pipeline stages, one a node: SmolLM2's 30 layers split where its 9 heads would not.
STAGES = {**ENGINE_SETTINGS, "pipeline_parallel_size": 2}


def rank(node_rank: int, leader: LeaderAddress) -> NodeGroup:
    return NodeGroup(num_nodes=2, node_rank=node_rank, leader=leader)


def test_the_multi_node_settings_are_vllms_own_engine_arguments(vllm_model_folder: Path) -> None:
    from engines.vllm.follower import VllmFollower

    assert {"nnodes", "node_rank", "master_addr", "master_port"} <= engine_arg_names()
    leader = LeaderAddress("127.0.0.1", 29555)
    settings = VllmSettings(model=str(vllm_model_folder), nodes=rank(1, leader), extra=dict(STAGES))
    parallel = VllmFollower(settings).engine_config().parallel_config
    assert (parallel.nnodes, parallel.node_rank, parallel.master_addr, parallel.master_port) == (
        2,
        1,
        "127.0.0.1",
        29555,
    )
    # A worker of the leader's instance (vllm serve --headless runs a MultiprocExecutor for it), one GPU here.
    assert (parallel.node_rank_within_dp, parallel.world_size, parallel.local_world_size) == (1, 2, 1)


def test_a_rank_that_would_run_data_parallel_engines_of_its_own_is_refused(vllm_model_folder: Path) -> None:
    from engines.vllm.follower import VllmFollower

    # Data parallelism over the nodes: rank 1 would hold a whole engine, which takes requests, not a worker.
    extra = {**ENGINE_SETTINGS, "data_parallel_size": 2}
    settings = VllmSettings(model=str(vllm_model_folder), nodes=rank(1, LeaderAddress("127.0.0.1", 29555)), extra=extra)
    with pytest.raises(ConfigError, match="--node-rank 1 would run data-parallel engines of its own"):
        VllmFollower(settings).engine_config()


def test_extra_engine_args_cannot_set_what_the_multi_node_flags_set() -> None:
    for key, flag in (("nnodes", "--num-nodes"), ("node_rank", "--node-rank"), ("master_port", "--leader-addr")):
        with pytest.raises(ConfigError, match=f"'{key}' is set by {flag}"):
            check_extra_args({key: 1}, engine_arg_names())


@pytest.fixture
def two_nodes(vllm_model_folder: Path, tmp_path: Path) -> Iterator[tuple[Server, subprocess.Popen[str]]]:
    """A leader serving over HTTP, once its rank 1 (started first, waiting for it) has joined."""
    address = f"127.0.0.1:{free_port()}"
    common = [str(vllm_model_folder), "--num-nodes", "2", "--leader-addr", address]
    common += ["--extra-engine-args", json.dumps(STAGES)]
    # Each "node" binds its one worker's threads to a core of its own.
    env = {**os.environ, **KV_CACHE_ENV, "FLOTILLA_LOG": "info"}
    follower = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "run", "out=vllm", *common, "--node-rank", "1"],
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "VLLM_CPU_OMP_THREADS_BIND": "1"},
    )
    try:
        leader = start_server(
            ["out=vllm", "--model-name", "smol", *common],
            tmp_path / "leader.log",
            env={**KV_CACHE_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0"},
            timeout=400,
        )
    except BaseException:
        end(follower)
        raise
    yield leader, follower
    end(follower)
    leader.stop()


def end(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def test_a_leader_and_its_rank_1_meet_and_the_rank_exits_1_when_its_worker_dies(
    two_nodes: tuple[Server, subprocess.Popen[str]],
) -> None:
    import psutil

    leader, follower = two_nodes
    assert follower.stderr is not None
    logged = ""
    while "the engine's processes are up" not in logged:
        line = follower.stderr.readline()  # the rank's log is the event awaited
        assert line, f"rank 1 ended (exit {follower.wait()}):\n{logged}"
        logged += line
    assert "serving as rank 1 of 2 for the leader at 127.0.0.1:" in logged
    # The leader's engine is up only because rank 1's stage is: its own process holds stage 0 alone.
    assert "Worker_PP0" in leader.log() and "Worker_PP1" not in leader.log()
    workers = psutil.Process(follower.pid).children()
    vllm_workers = [child for child in workers if "VLLM" in " ".join(child.cmdline()) or "VLLM" in child.name()]
    assert vllm_workers, [child.cmdline() for child in workers]
    vllm_workers[0].kill()
    _, rest = follower.communicate(timeout=120)
    assert follower.returncode == 1, logged + rest
    assert "rank 1 of 2 stops: a vLLM worker process died" in rest


def test_a_rank_whose_leader_is_killed_exits_1_instead_of_waiting_for_it(
    two_nodes: tuple[Server, subprocess.Popen[str]],
) -> None:
    """The leader's engine and workers die at once (kill -9): rank 1's workers would wait for its next step
    for ever; the rank notices its leader's address answers no more and exits 1."""
    import psutil

    leader, follower = two_nodes
    assert follower.stderr is not None
    logged = ""
    while "the engine's processes are up" not in logged:
        line = follower.stderr.readline()
        assert line, f"rank 1 ended (exit {follower.wait()}):\n{logged}"
        logged += line
    tree = [psutil.Process(leader.process.pid), *psutil.Process(leader.process.pid).children(recursive=True)]
    for process in tree:
        process.kill()
    _, rest = follower.communicate(timeout=120)
    assert follower.returncode == 1, logged + rest
    assert "rank 1 of 2 stops: the leader at 127.0.0.1:" in rest and "has not answered" in rest
