"""out=vllm's flags and settings, checked without vLLM: its GPUs, its memory share, its engine arguments, and a
node without the package told which extra to install (exit 2, one line)."""

import subprocess
import sys
from pathlib import Path

import pytest

from engines.shared.node_group import LeaderAddress, NodeGroup
from engines.vllm.engine import visible_devices
from engines.vllm.settings import VllmSettings, check_disagg_role, check_extra_args, read_extra_args
from launcher.cli import parse_run_options
from launcher.options import RunOptions
from launcher.run_parser import build_run_parser
from runtime.errors import ConfigError

FIELDS = frozenset({"model", "block_size", "enable_prefix_caching", "gpu_memory_utilization", "max_model_len"})


def options(*argv: str) -> RunOptions:
    parser = build_run_parser()
    return parse_run_options(parser, parser.parse_args(list(argv)))


def test_the_gpu_flags_reach_the_run_options() -> None:
    given = options(
        "out=vllm", "m", "--tensor-parallel-size", "2", "--base-gpu-id", "1", "--gpu-memory-utilization", "0.35"
    )
    assert (given.tensor_parallel_size, given.base_gpu_id, given.gpu_memory_utilization) == (2, 1, 0.35)
    assert options("out=vllm", "m").tensor_parallel_size == 1


def test_the_memory_share_is_read_from_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_GPU_MEMORY_UTILIZATION", "0.4")
    assert options("out=vllm", "m").gpu_memory_utilization == 0.4


def test_the_gpu_flags_are_refused_for_another_engine(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        options("out=llamacpp", "m.gguf", "--gpu-memory-utilization", "0.5")
    assert exit_.value.code == 2
    assert "--gpu-memory-utilization places a GPU engine" in capsys.readouterr().err


def test_the_memory_share_placed_by_is_what_vllm_is_given() -> None:
    settings = VllmSettings(model="/m", max_model_len=2048, gpu_memory_utilization=0.35, extra={"block_size": 32})
    kwargs = settings.engine_kwargs()
    assert kwargs["gpu_memory_utilization"] == 0.35 and kwargs["max_model_len"] == 2048
    assert kwargs["block_size"] == 32 and kwargs["model"] == "/m"
    assert "gpu_memory_utilization" not in VllmSettings(model="/m").engine_kwargs()


def test_the_nodes_an_instance_spans_become_vllms_multi_node_engine_arguments() -> None:
    nodes = NodeGroup(num_nodes=2, node_rank=1, leader=LeaderAddress("10.0.0.1", 29500))
    kwargs = VllmSettings(model="/m", tensor_parallel_size=8, nodes=nodes).engine_kwargs()
    assert (kwargs["nnodes"], kwargs["node_rank"], kwargs["master_addr"], kwargs["master_port"]) == (
        2,
        1,
        "10.0.0.1",
        29500,
    )
    assert kwargs["tensor_parallel_size"] == 8  # every node's GPUs: vLLM starts 8 / 2 of them on each
    assert not {"nnodes", "node_rank", "master_addr", "master_port"} & set(VllmSettings(model="/m").engine_kwargs())


def test_a_node_uses_its_share_of_the_gpus_and_they_must_split_evenly() -> None:
    nodes = NodeGroup(num_nodes=2, leader=LeaderAddress("h", 1))
    assert VllmSettings(model="/m", tensor_parallel_size=8, nodes=nodes).local_gpus == 4
    assert VllmSettings(model="/m", extra={"pipeline_parallel_size": 2}, nodes=nodes).local_gpus == 1
    assert VllmSettings(model="/m", tensor_parallel_size=2).local_gpus == 2
    with pytest.raises(ConfigError, match="do not split evenly over --num-nodes 2"):
        _ = VllmSettings(model="/m", tensor_parallel_size=3, nodes=nodes).local_gpus


@pytest.mark.parametrize(
    ("key", "flag"),
    [
        ("nnodes", "--num-nodes"),
        ("node_rank", "--node-rank"),
        ("master_addr", "--leader-addr"),
        ("master_port", "--leader-addr"),
    ],
)
def test_the_multi_node_engine_arguments_are_refused_naming_their_flag(key: str, flag: str) -> None:
    with pytest.raises(ConfigError, match=f"'{key}' is set by {flag}"):
        check_extra_args({key: 1}, FIELDS | {key})


def test_an_unknown_engine_argument_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="unknown key 'blok_size'"):
        check_extra_args({"block_size": 32, "blok_size": 32}, FIELDS)
    with pytest.raises(ConfigError, match="did you mean 'block_size'"):
        check_extra_args({"block-size": 32}, FIELDS)


def test_an_engine_argument_a_flag_owns_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match="'gpu_memory_utilization' is set by --gpu-memory-utilization"):
        check_extra_args({"gpu_memory_utilization": 0.9}, FIELDS)
    with pytest.raises(ConfigError, match="--context-length"):
        check_extra_args({"max_model_len": 10}, FIELDS)


def test_engine_arguments_come_from_inline_json_or_a_file(tmp_path: Path) -> None:
    assert read_extra_args('{"block_size": 32}') == {"block_size": 32}
    path = tmp_path / "vllm.json"
    path.write_text('{"enable_prefix_caching": true}')
    assert read_extra_args(path) == {"enable_prefix_caching": True}
    assert read_extra_args(None) == {}
    with pytest.raises(ConfigError, match="JSON object"):
        read_extra_args("[1]")
    with pytest.raises(ConfigError, match="cannot be read"):
        read_extra_args(tmp_path / "missing.json")


def test_the_base_gpu_counts_among_the_gpus_this_process_was_given() -> None:
    assert visible_devices(None, 2, 2) == "2,3"
    assert visible_devices("", 0, 1) == "0"
    assert visible_devices("GPU-a,GPU-b,GPU-c", 1, 2) == "GPU-b,GPU-c"
    with pytest.raises(ConfigError, match="has 2"):
        visible_devices("4,5", 1, 2)


def test_a_node_without_vllm_says_which_extra_to_install() -> None:
    # A None in sys.modules makes the package look absent, to the import system and to find_spec alike.
    code = "import sys; sys.modules['vllm'] = None\nfrom launcher.cli import main\nsys.exit(main(sys.argv[1:]))"
    result = subprocess.run(
        [sys.executable, "-c", code, "run", "out=vllm", "some/model"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith("pip install 'flotilla[vllm]'")
    assert "Traceback" not in result.stderr
    listed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['vllm'] = None\n"
            "from runtime.fleet_contract.engine_names import engines_on_this_node\n"
            "print(sorted(engines_on_this_node()))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "vllm" not in listed.stdout


@pytest.mark.parametrize(
    ("role", "extra", "says"),
    [
        ("prefill", {}, "needs a KV connector in --extra-engine-args"),
        ("decode", {"kv_transfer_config": {"kv_role": "kv_consumer"}}, "needs a KV connector"),
        ("prefill", {"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}}, "kv_producer"),
        ("decode", {"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}}, "kv_consumer"),
    ],
)
def test_a_prefill_or_decode_worker_needs_a_connector_of_its_role(
    role: str, extra: dict[str, object], says: str
) -> None:
    with pytest.raises(ConfigError, match=says):
        check_disagg_role(role, extra)


def test_a_fitting_connector_or_an_aggregated_worker_passes() -> None:
    both = {"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}}
    for role in ("prefill", "decode"):
        check_disagg_role(role, both)
    check_disagg_role("aggregated", {})
