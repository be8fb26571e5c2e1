"""``flotilla run --num-nodes N --node-rank R --leader-addr HOST:PORT``: each misuse stops the real command with
exit 2 and one line saying what is wrong, and the flags reach the run's options and the engines' node group."""

import subprocess
import sys

import pytest

from engines.shared.node_group import LeaderAddress, NodeGroup
from launcher.cli import parse_run_options
from launcher.options import RunOptions
from launcher.proctitle import run_title
from launcher.run_parser import build_run_parser
from runtime.errors import ConfigError

LEADER = ["--leader-addr", "10.0.0.1:29500"]


def run_flotilla(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", "run", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-nodes", "0"], "argument --num-nodes: 0 must be at least 1"),
        (["--num-nodes", "two"], "argument --num-nodes: 'two' is not an integer"),
        (["--node-rank", "-1"], "argument --node-rank: -1 must be at least 0"),
        (["--num-nodes", "2", "--node-rank", "2", *LEADER], "--node-rank 2 is not a rank of --num-nodes 2"),
        (["--node-rank", "1"], "--node-rank 1 is not a rank of --num-nodes 1"),
        (["--num-nodes", "2"], "--num-nodes 2 needs --leader-addr HOST:PORT"),
        (["--num-nodes", "2", "--node-rank", "1"], "--num-nodes 2 needs --leader-addr HOST:PORT"),
        (LEADER, "--leader-addr is where several nodes meet: give --num-nodes N"),
        (["--num-nodes", "2", "--leader-addr", "10.0.0.1"], "'10.0.0.1' is not HOST:PORT"),
        (["--num-nodes", "2", "--leader-addr", ":29500"], "':29500' is not HOST:PORT"),
        (["--num-nodes", "2", "--leader-addr", "h:70000"], "the port '70000' is not a TCP port"),
        (["--num-nodes", "2", "--leader-addr", "h:port"], "the port 'port' is not a TCP port"),
        (["--num-nodes", "2", "--leader-addr", "fd00::1:29500"], "write an IPv6 leader address in brackets"),
    ],
)
def test_a_bad_multi_node_flag_stops_the_run_with_exit_2_saying_why(args: list[str], message: str) -> None:
    result = run_flotilla("out=vllm", "some/model", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("engine", ["llamacpp", "mistralrs", "mocker", "echo_core", "echo_full", "dyn"])
def test_an_engine_without_multi_node_refuses_the_flags_naming_those_that_have_it(engine: str) -> None:
    result = run_flotilla(f"out={engine}", "--num-nodes", "2", *LEADER)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"flotilla run: error: --num-nodes spans one engine over several machines, which out=sglang and out=vllm "
        f"do; out={engine} does not"
    )


def test_tensorrt_llm_is_told_to_span_nodes_under_mpi() -> None:
    result = run_flotilla("out=trtllm", "some/model", "--node-rank", "1")
    assert result.returncode == 2, result.stderr
    assert "out=trtllm runs over several nodes under MPI, not through --num-nodes" in result.stderr
    assert "mpirun -np <GPUs in all> ... trtllm-llmapi-launch flotilla run out=trtllm" in result.stderr


def test_a_bad_multi_node_variable_stops_the_run_naming_it() -> None:
    import os

    env = {**os.environ, "FLOTILLA_LEADER_ADDR": "nowhere"}
    result = run_flotilla("out=vllm", "some/model", "--num-nodes", "2", env=env)
    assert result.returncode == 2, result.stderr
    assert "FLOTILLA_LEADER_ADDR" in result.stderr and "'nowhere' is not HOST:PORT" in result.stderr


def options(*argv: str) -> RunOptions:
    parser = build_run_parser()
    return parse_run_options(parser, parser.parse_intermixed_args(list(argv)))


def test_the_flags_reach_the_options_and_their_node_group() -> None:
    given = options("out=sglang", "m", "--num-nodes", "4", "--node-rank", "3", "--leader-addr", "[fd00::1]:29500")
    assert (given.num_nodes, given.node_rank, given.leader_addr) == (4, 3, LeaderAddress("fd00::1", 29500))
    assert given.node_group == NodeGroup(num_nodes=4, node_rank=3, leader=LeaderAddress("fd00::1", 29500))
    assert str(given.leader_addr) == "[fd00::1]:29500"


def test_without_the_flags_an_engine_runs_on_one_node_as_its_leader() -> None:
    alone = options("out=vllm", "m").node_group
    assert (alone.num_nodes, alone.node_rank, alone.leader, alone.is_leader, alone.spans_nodes) == (
        1,
        0,
        None,
        True,
        False,
    )


def test_the_flags_are_read_from_their_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_NUM_NODES", "2")
    monkeypatch.setenv("FLOTILLA_NODE_RANK", "1")
    monkeypatch.setenv("FLOTILLA_LEADER_ADDR", "leader.internal:29500")
    given = options("out=vllm", "m")
    assert (given.num_nodes, given.node_rank, given.leader_addr) == (2, 1, LeaderAddress("leader.internal", 29500))


def test_a_rank_above_0_is_named_so_in_the_process_list_whatever_its_input() -> None:
    follower = options("in=http", "out=vllm", "m", "--num-nodes", "2", "--node-rank", "1", *LEADER)
    assert run_title(follower) == "flotilla run out=vllm rank 1 of 2"
    assert (
        run_title(options("in=http", "out=vllm", "m", "--num-nodes", "2", *LEADER)) == "flotilla run in=http out=vllm"
    )


def test_a_node_group_checks_itself_where_no_parser_did() -> None:
    with pytest.raises(ConfigError, match="ranks count from 0 to 1"):
        NodeGroup(num_nodes=2, node_rank=5, leader=LeaderAddress("h", 1))
    with pytest.raises(ConfigError, match="needs --leader-addr"):
        NodeGroup(num_nodes=2)
    with pytest.raises(ConfigError, match="do not split evenly over --num-nodes 2"):
        NodeGroup(num_nodes=2, leader=LeaderAddress("h", 1)).local_share(3)
