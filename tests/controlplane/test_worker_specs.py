"""What an agent is told to run: an instance as StartInstance / StopInstance, and engine args as flags."""

import msgspec
import pytest
from msgspec.structs import replace

from agent.tasks.checks import check_engine_args
from controlplane.audit.records import Actor
from controlplane.deployments.models import Instance
from controlplane.deployments.pipelines import GroupSpec, deploy_pipeline
from controlplane.deployments.upkeep import place_pending_instances
from controlplane.deployments.worker_specs import (
    engine_argv,
    gpu_memory_bytes,
    gpu_memory_share,
    start_message,
    stop_message,
)
from controlplane.fleet.actions import register_node
from runtime.fleet_contract.router_settings import PipelineRouter
from runtime.fleet_contract.tasks import HubSource, LocalSource, StartInstance, decode_task_argument
from tests.controlplane.factories import TEST_ACTOR, GiB, make_model, make_node, node_report

MOCKER_SETTINGS = ["--extra-engine-args", '{"speedup_ratio":10}']


def placed(engine: str | None = None, model_engine: str = "mocker", **model_fields: object) -> Instance:
    """The one instance of a pipeline of model ``llama`` (on ``model_engine``), its group on ``engine``."""
    make_node("gpu-a", (80, 80, 80, 80))
    model = make_model("llama", engine=model_engine, **model_fields)
    group = GroupSpec(gpus_per_replica=2, engine=engine, engine_args={"--context-length": 2048, "dp_size": 2})
    deploy_pipeline(
        TEST_ACTOR,
        name="llama+chat",
        model=model,
        groups=[group],
        router_mode="kv",
        kv_overlap_score_weight=0.5,
        kv_queued_prefill_weight=0.25,
        router_temperature=0.2,
        use_kv_events=False,
    )
    place_pending_instances(TEST_ACTOR)
    return Instance.objects.select_related("pipeline__model", "group", "node").get()


@pytest.mark.django_db
def test_a_start_message_names_the_worker_its_gpus_router_and_model_files() -> None:
    instance = placed(
        source_kind="gguf", source="/models/llama.gguf", engine="mocker", memory_bytes=30 * GiB,
        default_engine_args={"speedup_ratio": 100, "dp_size": 1},
    )  # fmt: skip

    message = start_message(instance)

    spec = message.spec
    assert (spec.instance_id, spec.pipeline, spec.model_name) == (instance.pk, "llama-chat", "llama+chat")
    assert (spec.gpu_indexes, spec.gpu_memory_bytes) == (instance.gpu_indexes, 15 * GiB)
    assert spec.engine_args == ["--context-length", "2048", "--extra-engine-args", '{"dp_size":2,"speedup_ratio":100}']
    assert spec.router == PipelineRouter(
        mode="kv",
        overlap_score_weight=0.5,
        queued_prefill_weight=0.25,
        temperature=0.2,
        use_kv_events=False,
        generation=1,
    )
    assert spec.labels == {"model": "llama"}
    assert message.source == LocalSource(path="/models/llama.gguf")
    assert message.node == instance.node.name  # type: ignore[union-attr]  # the agent refuses another node's
    assert str(spec.address) == "dyn://llama-chat.backend.generate"


@pytest.mark.django_db
def test_a_start_message_survives_the_json_trip_to_the_agent() -> None:
    message = start_message(placed())
    assert decode_task_argument(msgspec.json.decode(msgspec.json.encode(message)), StartInstance) == message


@pytest.mark.django_db
def test_an_engine_that_needs_no_files_gets_no_source() -> None:
    assert start_message(placed(engine="echo_full")).source is None


@pytest.mark.parametrize(
    ("source", "projector", "sent"),
    [
        (
            {"source_kind": "hf", "source": "org/vision-GGUF", "revision": "v2", "filename": "m.Q4_K_M.gguf"},
            "mmproj-f16.gguf",
            HubSource(repo_id="org/vision-GGUF", revision="v2", file="mmproj-f16.gguf"),
        ),
        (
            {"source_kind": "gguf", "source": "/models/m.gguf"},
            "/models/mmproj.gguf",
            LocalSource(path="/models/mmproj.gguf"),
        ),
    ],
)
@pytest.mark.django_db
def test_a_llamacpp_models_projector_is_sent_as_a_file_of_its_repo_or_a_path(
    source: dict[str, str], projector: str, sent: HubSource | LocalSource
) -> None:
    message = start_message(placed(model_engine="llamacpp", projector=projector, memory_bytes=GiB, **source))
    assert message.projector == sent
    assert message.spec.projector_path is None  # the agent's to set once it has the file
    assert "--mmproj" not in message.spec.engine_args


@pytest.mark.django_db
def test_a_group_running_another_engine_than_llamacpp_gets_no_projector() -> None:
    instance = placed(
        engine="mocker", model_engine="llamacpp", source_kind="gguf", source="/models/m.gguf",
        projector="/models/mmproj.gguf", memory_bytes=GiB,
    )  # fmt: skip
    # The model is llama.cpp's; this group runs the mocker on its files (a rehearsal), which takes no projector.
    assert start_message(instance).projector is None


@pytest.mark.django_db
def test_an_instance_that_is_not_placed_has_no_start_message() -> None:
    instance = placed()
    Instance.objects.filter(pk=instance.pk).update(node=None)
    instance.refresh_from_db()
    with pytest.raises(ValueError, match="not placed on a node"):
        start_message(instance)


@pytest.mark.django_db
def test_a_stop_message_says_why_and_how_long_to_drain() -> None:
    instance = placed()
    instance.reason = "scaled down to 0 by alice"
    message = stop_message(instance, grace_s=5)
    assert (message.instance_id, message.reason, message.grace_s) == (instance.pk, "scaled down to 0 by alice", 5)
    assert message.node == instance.node.name  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("engine", "args", "argv"),
    [
        ("llamacpp", {"threads": 4, "context_length": 2048}, ["--threads", "4", "--context-length", "2048"]),
        ("llamacpp", {"--reuse-port": True, "--verbose": False, "--x": None}, ["--reuse-port"]),
        ("mocker", {"speedup_ratio": 10, "--context-length": 512}, ["--context-length", "512", *MOCKER_SETTINGS]),
        ("llamacpp", {"extra": {"a": [1, 2]}}, ["--extra", '{"a":[1,2]}']),
        # The GPU engines' own arguments travel as one JSON object too (JSON is YAML, for out=trtllm).
        ("vllm", {"block_size": 32}, ["--extra-engine-args", '{"block_size":32}']),
        (
            "trtllm",
            {"kv_cache_config": {"max_tokens": 8}},
            ["--extra-engine-args", '{"kv_cache_config":{"max_tokens":8}}'],
        ),
        ("mocker", {}, []),
        # mistral.rs's own settings travel as one JSON object, checked by the worker against its Runner's arguments.
        ("mistralrs", {"max_seqs": 4, "--threads": 2}, ["--threads", "2", "--extra-engine-args", '{"max_seqs":4}']),
    ],
)  # fmt: skip
def test_engine_args_become_flags_or_the_engines_own_settings(
    engine: str, args: dict[str, object], argv: list[str]
) -> None:
    assert engine_argv(engine, args) == argv


def test_a_replicas_memory_is_split_over_its_gpus() -> None:
    assert gpu_memory_bytes(30 * GiB, 4) == 30 * GiB // 4
    assert gpu_memory_bytes(None, 2) == 0
    assert gpu_memory_bytes(8 * GiB, 0) == 0


def node_running(*engines: str) -> None:
    """Node gpu-a (as ``placed`` makes it), its agent reporting ``engines``."""
    report = replace(node_report((80, 80, 80, 80)), engines=sorted(engines))
    register_node(Actor.agent("gpu-a"), "gpu-a", report)


def test_a_memory_share_is_the_replicas_memory_per_gpu_over_the_smallest_gpus_rounded_up() -> None:
    assert gpu_memory_share(15 * GiB, [80 * GiB, 80 * GiB]) == 0.188  # 0.1875, never less than placed
    assert gpu_memory_share(15 * GiB, [80 * GiB, 40 * GiB]) == 0.375
    assert gpu_memory_share(90 * GiB, [80 * GiB]) == 1.0
    assert gpu_memory_share(0, [80 * GiB]) is None  # the model's memory is unknown
    assert gpu_memory_share(15 * GiB, [80 * GiB, 0]) is None  # a GPU's memory is unknown


@pytest.mark.django_db
@pytest.mark.parametrize("engine", ["sglang", "trtllm", "vllm"])
def test_a_gpu_engine_is_told_the_memory_share_it_was_placed_by(engine: str) -> None:
    node_running(engine)
    instance = placed(source_kind="hf", source="org/llama", engine=engine, memory_bytes=30 * GiB)
    argv = start_message(instance).spec.engine_args
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.188"  # 15 GiB of each 80 GiB GPU
    check_engine_args(argv)  # and the agent takes it


@pytest.mark.django_db
def test_vllm_is_split_over_the_gpus_of_its_replica() -> None:
    node_running("vllm")
    argv = start_message(
        placed(source_kind="hf", source="org/llama", engine="vllm", memory_bytes=30 * GiB)
    ).spec.engine_args
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    check_engine_args(argv)  # and the agent takes it


@pytest.mark.django_db
def test_a_memory_share_given_in_the_engine_args_is_kept() -> None:
    node_running("sglang")
    instance = placed(
        source_kind="hf", source="org/llama", engine="sglang", memory_bytes=30 * GiB,
        default_engine_args={"--gpu-memory-utilization": 0.5},
    )  # fmt: skip
    argv = start_message(instance).spec.engine_args
    assert argv.count("--gpu-memory-utilization") == 1
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.5"
    # A CPU engine's start message has none: test_a_start_message_names_the_worker_its_gpus_router_and_model_files.
