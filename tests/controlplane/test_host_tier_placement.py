"""A pipeline's host KV tier on the fleet: placement reserves it in the nodes' system memory, and the start
message gives each engine its own setting for it."""

import json

import pytest

from controlplane.catalog.models import LanguageModel
from controlplane.deployments.inventory import fleet_inventory
from controlplane.deployments.models import Instance
from controlplane.deployments.upkeep import place_pending_instances
from controlplane.deployments.worker_specs import start_message
from tests.controlplane.factories import TEST_ACTOR, GiB, deploy, make_model, make_node
from tests.controlplane.reconciling import Clock, RecordingDispatcher, make_reconciler

pytestmark = pytest.mark.django_db

MOCKER_DEFAULTS = {"kv_bytes_per_token": 1024, "block_size": 64}


def tiered_model() -> LanguageModel:
    return make_model("smol", default_engine_args=MOCKER_DEFAULTS, memory_bytes=2 * GiB)


def test_replicas_whose_host_tiers_outgrow_the_nodes_memory_wait_with_the_reason() -> None:
    make_node("cpu-a", (), memory_gib=64)
    deploy("chat", tiered_model(), replicas=3, kv_host_cache_gib=24)

    place_pending_instances(TEST_ACTOR)

    placed = Instance.objects.filter(node__isnull=False)
    waiting = Instance.objects.get(node__isnull=True)
    assert placed.count() == 2  # 2 × (2 GiB of model + 24 GiB of tier) of 64 GiB
    assert "needs a node with 26 GiB of free memory (24 GiB of it for its host KV tier)" in waiting.reason
    assert "the best node, cpu-a, has 12 GiB free" in waiting.reason


def test_a_placed_replicas_host_tier_is_reserved_on_its_node_for_gpu_replicas_too() -> None:
    make_node("gpu-a", (80,), memory_gib=64)
    model = make_model("llama", default_engine_args=MOCKER_DEFAULTS, memory_bytes=10 * GiB)
    deploy("chat", model, gpus_per_replica=1, kv_host_cache_gib=16)
    place_pending_instances(TEST_ACTOR)

    (node,) = fleet_inventory()

    assert node.memory_free_bytes == 48 * GiB  # the model is on the GPU; its tier in the node's memory
    assert node.gpus[0].memory_free_bytes == 70 * GiB


def test_a_gpu_replica_is_unschedulable_when_its_node_lacks_the_memory_for_its_tier() -> None:
    make_node("gpu-a", (80,), memory_gib=8)
    deploy("chat", tiered_model(), gpus_per_replica=1, kv_host_cache_gib=16)

    place_pending_instances(TEST_ACTOR)

    instance = Instance.objects.get()
    assert instance.node is None
    assert instance.reason == (
        "needs 1 GPU with 2 GiB free and 16 GiB of free system memory for its host KV tier; the best node with the "
        "GPUs, gpu-a, has 8 GiB of system memory free"
    )


def test_the_mockers_start_message_sizes_its_host_tier_in_blocks_and_carries_the_hit_weights() -> None:
    make_node("cpu-a", (), memory_gib=64)
    deploy("chat", tiered_model(), kv_host_cache_gib=2, router_mode="kv", kv_host_hit_weight=0.5, kv_disk_hit_weight=0)
    place_pending_instances(TEST_ACTOR)

    spec = start_message(Instance.objects.get()).spec

    flag = spec.engine_args.index("--extra-engine-args")
    settings = json.loads(spec.engine_args[flag + 1])
    assert settings == {**MOCKER_DEFAULTS, "num_host_blocks": 32768}  # 2 GiB / (1024 bytes × 64 tokens)
    assert (spec.router.host_hit_weight, spec.router.disk_hit_weight) == (0.5, 0.0)


def test_a_pipeline_without_a_host_tier_starts_its_engine_with_none() -> None:
    make_node("cpu-a", (), memory_gib=64)
    deploy("chat", tiered_model())
    place_pending_instances(TEST_ACTOR)

    spec = start_message(Instance.objects.get()).spec

    assert "num_host_blocks" not in " ".join(spec.engine_args)
    assert (spec.router.host_hit_weight, spec.router.disk_hit_weight) == (0.75, 0.25)


def test_an_instance_whose_models_defaults_no_longer_size_its_tier_fails_for_good_instead_of_starting() -> None:
    make_node("cpu-a", (), memory_gib=64)
    deploy("chat", tiered_model(), kv_host_cache_gib=2)
    LanguageModel.objects.update(default_engine_args={})  # the catalog's defaults changed since deploy
    dispatcher = RecordingDispatcher()

    make_reconciler(dispatcher, Clock()).run_once()

    instance = Instance.objects.get()
    assert dispatcher.take() == []
    assert (instance.state, instance.gave_up, instance.node) == ("failed", True, None)
    assert instance.reason.startswith("cannot be started as it stands: the mocker counts its host tier in blocks")
