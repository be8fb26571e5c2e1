"""A worker's command line, environment and labels, and the `--labels` flag of `flotilla run` that carries them."""

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from agent.workers.spec import allowed_environment, worker_argv, worker_env, worker_labels
from launcher.cli import parse_run_options
from launcher.options import RunOptions
from launcher.run_parser import build_run_parser
from runtime.endpoint import InstanceEntry, format_labels, parse_labels
from runtime.errors import ConfigError
from runtime.fleet_contract.router_settings import PipelineRouter
from runtime.fleet_contract.signing import agent_signing_key
from runtime.fleet_contract.tasks import WorkerSpec
from runtime.fleet_contract.worker_keys import WORKER_KEY_VARIABLE, decode, worker_key

SPEC = WorkerSpec(
    instance_id=42,
    pipeline="smollm",
    group="aggregated",
    replica=3,
    engine="mocker",
    model_path="/models/smollm.gguf",
    model_name="smollm",
    engine_args=["--extra-engine-args", "/etc/flotilla/mocker.json"],
    gpu_indexes=[1, 3],
    labels={"team": "search", "node": "spoofed"},
)


def test_the_worker_command_line_is_flotilla_run_with_its_address_model_and_labels() -> None:
    argv = worker_argv(SPEC, "gpu-a", command=["flotilla"])
    assert argv[:6] == [
        "flotilla",
        "run",
        "in=dyn://smollm.backend.generate",
        "out=mocker",
        "/models/smollm.gguf",
        "--model-name",
    ]
    assert argv[6:9] == ["smollm", "--extra-engine-args", "/etc/flotilla/mocker.json"]
    assert argv[-2] == "--labels"
    assert parse_labels(argv[-1]) == {
        "team": "search",
        "pipeline": "smollm",
        "group": "aggregated",
        "replica": "3",
        "node": "gpu-a",
        "instance": "42",
    }


def test_a_projector_the_agent_fetched_is_given_to_the_worker_as_mmproj(tmp_path: Path) -> None:
    projector = tmp_path / "mmproj.gguf"
    projector.write_bytes(b"GGUF")
    spec = msgspec.structs.replace(
        SPEC, engine="llamacpp", engine_args=["--threads", "2"], projector_path=str(projector)
    )
    argv = worker_argv(spec, "gpu-a", command=["flotilla"])
    assert argv[4:11] == [
        "/models/smollm.gguf", "--model-name", "smollm", "--mmproj", str(projector), "--threads", "2",
    ]  # fmt: skip
    # The worker's parser takes what the agent wrote (its projector for out=llamacpp).
    assert run_options(argv[2:]).mmproj == projector
    assert "--mmproj" not in worker_argv(SPEC, "gpu-a", command=["flotilla"])


def test_a_spec_label_cannot_pose_as_the_agents_own() -> None:
    assert worker_labels(SPEC, "gpu-a")["node"] == "gpu-a"


def test_a_worker_sees_only_its_gpus_and_its_own_variables() -> None:
    env = worker_env(SPEC, {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3", "FLOTILLA_LABELS": "x=y"})
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # the indexes are NVML's, in PCI bus order
    assert env["PATH"] == "/usr/bin"
    assert "FLOTILLA_LABELS" not in env
    cpu_only = msgspec.structs.replace(SPEC, gpu_indexes=[])
    assert worker_env(cpu_only, {"CUDA_VISIBLE_DEVICES": "0"})["CUDA_VISIBLE_DEVICES"] == ""


def test_a_spec_whose_pipeline_is_no_namespace_is_refused() -> None:
    with pytest.raises(ConfigError, match="namespace"):
        worker_argv(msgspec.structs.replace(SPEC, pipeline="my pipeline"), "gpu-a")
    with pytest.raises(ConfigError, match="label"):
        worker_argv(msgspec.structs.replace(SPEC, group="a,b=c"), "gpu-a")


def test_a_spec_decodes_from_the_json_a_task_carries() -> None:
    assert msgspec.json.decode(msgspec.json.encode(SPEC), type=WorkerSpec) == SPEC


def test_labels_parse_and_format_both_ways() -> None:
    labels = {"pipeline": "p", "replica": "0", "model": "org/name:Q4_K_M"}
    assert parse_labels(format_labels(labels)) == labels
    assert parse_labels("") == {}
    for bad in ("a", "a=b,", "=b", "a=b,a=c", "a=b c"):
        with pytest.raises(ConfigError):
            parse_labels(bad)


def test_an_instance_registered_before_labels_existed_still_decodes() -> None:
    old = b'{"instance_id": 1, "subject": "s", "hostname": "h", "pid": 2}'
    assert msgspec.json.decode(old, type=InstanceEntry).labels == {}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", "run", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_bad_labels_stop_flotilla_run_with_exit_code_2_naming_the_flag_or_variable() -> None:
    result = run_cli("in=dyn://m", "out=echo_full", "--labels", "pipeline")
    assert result.returncode == 2
    assert "--labels" in result.stderr and "'pipeline' is not key=value" in result.stderr
    result = run_cli("in=dyn://m", "out=echo_full", env={"FLOTILLA_LABELS": "a=b,,"})
    assert result.returncode == 2
    assert "FLOTILLA_LABELS" in result.stderr


def test_labels_are_refused_for_an_input_that_registers_nothing() -> None:
    result = run_cli("in=http", "out=echo_full", "--labels", "a=b")
    assert result.returncode == 2
    assert "use it with in=dyn://" in result.stderr


def test_a_pipelines_router_settings_become_the_workers_router_flags() -> None:
    router = PipelineRouter(
        mode="kv",
        overlap_score_weight=2.5,
        queued_prefill_weight=0.25,
        temperature=0.1,
        use_kv_events=False,
        disagg_policy="load",
        disagg_isl_threshold=512,
        disagg_isl_ratio=0.5,
        disagg_prefill_busy=2.5,
        disagg_decode_busy=0.9,
    )
    spec = WorkerSpec(instance_id=7, pipeline="chat", group="aggregated", replica=0, engine="echo_full", router=router)
    argv = worker_argv(spec, "gpu-a")
    assert argv[argv.index("--kv-queued-prefill-weight") + 1] == "0.25"
    # What `flotilla run` makes of them (after `python -m launcher.cli run`): the same settings, which
    # it registers with the model.
    assert run_options(argv[4:]).worker_router == router
    assert run_options(worker_argv(msgspec.structs.replace(spec, router=None), "gpu-a")[4:]).worker_router is None


def run_options(args: list[str]) -> RunOptions:
    parser = build_run_parser()
    return parse_run_options(parser, parser.parse_intermixed_args(args))


AGENTS_ENVIRONMENT = {
    "PATH": "/usr/bin",
    "HOME": "/var/lib/flotilla-agent",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TZ": "UTC",
    "TMPDIR": "/tmp",
    "PYTHONPATH": "/opt/flotilla",
    "ETCD_ENDPOINTS": "http://etcd:2379",
    "NATS_SERVER_FILE": "/etc/flotilla/nats-url",
    "FLOTILLA_DRAIN_S": "5",
    "FLOTILLA_LEASE_TTL": "10",
    "FLOTILLA_LOG": "info",
    "FLOTILLA_BROKER_URL": "redis://:fleet-password@redis:6379/0",
    "FLOTILLA_AGENT_TOKEN_FILE": "/etc/flotilla/agent.token",
    "FLOTILLA_AGENT_TOKEN": "flt_agent_secret",
    "FLOTILLA_CONTROL_PLANE": "https://cp.example",
    "HF_TOKEN": "hf_secret",
    "HF_ENDPOINT": "https://hf-mirror.example",
    "FLOTILLA_THREADS": "64",
    "FLOTILLA_MODEL_PATH": "/models/other",
    "AWS_SECRET_ACCESS_KEY": "x",
    "LD_PRELOAD": "/tmp/evil.so",
    "VLLM_CPU_KVCACHE_SPACE": "8",
    "VLLM_API_KEY": "sk-vllm",
    "SGLANG_DISABLE_CUDNN_CHECK": "1",
    "NCCL_SOCKET_IFNAME": "eth0",
    "OMP_NUM_THREADS": "8",
    "HF_HUB_OFFLINE": "1",
    "TRTLLM_SECRET_THING": "x",
}


def test_a_worker_inherits_only_the_agents_variables_it_needs_to_run_and_serve() -> None:
    allowed = allowed_environment(AGENTS_ENVIRONMENT)
    assert allowed == {
        name: AGENTS_ENVIRONMENT[name]
        for name in (
            "PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "PYTHONPATH",
            "ETCD_ENDPOINTS", "NATS_SERVER_FILE", "FLOTILLA_DRAIN_S", "FLOTILLA_LEASE_TTL", "FLOTILLA_LOG",
            # the engines' own settings, tuned once in the agent's environment (not their secrets)
            "VLLM_CPU_KVCACHE_SPACE", "SGLANG_DISABLE_CUDNN_CHECK", "NCCL_SOCKET_IFNAME", "OMP_NUM_THREADS",
            "HF_HUB_OFFLINE",
        )
    }  # fmt: skip


def test_a_worker_gets_its_own_instances_key_and_never_one_from_the_agents_environment() -> None:
    node_key = agent_signing_key("flt_agent-token", "gpu-a")
    smuggled = {**AGENTS_ENVIRONMENT, WORKER_KEY_VARIABLE: "7:" + "ab" * 32}

    given = decode(worker_env(SPEC, smuggled, node_key)[WORKER_KEY_VARIABLE])

    assert given == worker_key(node_key, SPEC.instance_id)  # instance 42's, derived from the node's key
    assert given != worker_key(node_key, 43) and given != worker_key(agent_signing_key("flt_other", "gpu-b"), 42)
    assert WORKER_KEY_VARIABLE not in worker_env(SPEC, smuggled)  # no node key (no agent): no key at all
    assert given.key.secret.hex() not in repr(given)  # never the secret, in a log or a traceback


def test_the_agents_credentials_never_reach_a_worker_even_in_an_environment_given_to_it() -> None:
    env = worker_env(SPEC, AGENTS_ENVIRONMENT)
    for secret in (
        "FLOTILLA_BROKER_URL",
        "FLOTILLA_AGENT_TOKEN",
        "FLOTILLA_AGENT_TOKEN_FILE",
        "HF_TOKEN",
        "LD_PRELOAD",
        "VLLM_API_KEY",
        "TRTLLM_SECRET_THING",
    ):
        assert secret not in env


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_prefill_or_decode_groups_worker_serves_its_part_on_its_component(role: str) -> None:
    spec = msgspec.structs.replace(SPEC, group=role, component=role, labels={})
    argv = worker_argv(spec, "gpu-a")
    assert argv[argv.index("--disagg-role") + 1] == role
    options = run_options(argv[4:])
    assert (options.disagg_role, options.worker_address) == (role, f"dyn://smollm.{role}.generate")
    assert "--disagg-role" not in worker_argv(SPEC, "gpu-a")
    assert run_options(worker_argv(SPEC, "gpu-a")[4:]).disagg_role == "aggregated"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["in=http", "out=mocker", "--disagg-role", "prefill"], "is a worker's (in=dyn://...)"),
        (
            ["in=dyn://m.prefill.generate", "out=echo_core", "--disagg-role", "prefill"],
            "engines that can: mocker, sglang, trtllm, vllm",
        ),
        (["in=dyn://m.decode.generate", "out=mocker", "--disagg-role", "middle"], "invalid choice: 'middle'"),
    ],
)
def test_a_disagg_role_where_it_cannot_work_is_refused_saying_why(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        run_options(args)
    assert exited.value.code == 2
    assert says in capsys.readouterr().err
