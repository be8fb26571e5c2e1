"""place(): hand-computed placements and reasons (a pure function: no database)."""

from dataclasses import replace

import pytest

from controlplane.deployments.placement import (
    Demand,
    GpuInventory,
    NodeInventory,
    Placement,
    ReplicaPlacement,
    Unschedulable,
    format_bytes,
    place,
)

GiB = 1 << 30


def gpu_node(
    name: str, *free_gib: float, total_gib: float = 80, instances: tuple[int, ...] = (), **kw: object
) -> NodeInventory:
    counts = instances or (0,) * len(free_gib)
    gpus = tuple(
        GpuInventory(index=i, memory_total_bytes=int(total_gib * GiB), memory_free_bytes=int(free * GiB), instances=n)
        for i, (free, n) in enumerate(zip(free_gib, counts, strict=True))
    )
    return NodeInventory(name=name, gpus=gpus, memory_free_bytes=64 * GiB, **kw)  # type: ignore[arg-type]


def cpu_node(name: str, memory_free_gib: float, **kw: object) -> NodeInventory:
    return NodeInventory(name=name, memory_free_bytes=int(memory_free_gib * GiB), **kw)  # type: ignore[arg-type]


def demand(replicas: int = 1, gpus: int = 1, memory_gib: float | None = 20, **kw: object) -> Demand:
    memory = None if memory_gib is None else int(memory_gib * GiB)
    return Demand(replicas=replicas, gpus_per_replica=gpus, memory_per_replica_bytes=memory, **kw)  # type: ignore[arg-type]


def spots(result: Placement | Unschedulable) -> list[tuple[str, tuple[int, ...]]]:
    replicas = result.replicas if isinstance(result, Placement) else result.placed
    return [(r.node, r.gpu_indexes) for r in replicas]


def test_spread_puts_each_replica_on_a_different_node() -> None:
    result = place(demand(replicas=2), [gpu_node("a", 80, 80), gpu_node("b", 80, 80)])
    assert result == Placement((ReplicaPlacement("a", (0,)), ReplicaPlacement("b", (0,))))


def test_spread_takes_the_emptiest_gpus_and_then_spreads_over_gpus() -> None:
    # a: GPU0 has 30 GiB free, GPU1 80; b: 80 and 80.  1st: tie on counts and free (80) → a, its GPU1.
    # 2nd: a has a replica → b GPU0.  3rd: one replica each; a's best unused GPU has 30 free, b's 80 → b GPU1.
    result = place(demand(replicas=3), [gpu_node("a", 30, 80), gpu_node("b", 80, 80)])
    assert spots(result) == [("a", (1,)), ("b", (0,)), ("b", (1,))]


def test_spread_counts_the_groups_replicas_already_placed() -> None:
    result = place(
        demand(replicas=1, existing_replicas_by_node={"a": 1}), [gpu_node("a", 80, 80), gpu_node("b", 40, 40)]
    )
    assert spots(result) == [("b", (0,))]


def test_binpack_fills_the_busiest_node_with_best_fitting_gpus() -> None:
    # a has 110 GiB free in all, b 160: a first.  On a, best fit: GPU0 (30 free) → 10 left; then GPU1 (80) →
    # 60; then a (70 free in all) still beats b, and only GPU1 fits → 40.
    result = place(demand(replicas=3, policy="binpack"), [gpu_node("a", 30, 80), gpu_node("b", 80, 80)])
    assert spots(result) == [("a", (0,)), ("a", (1,)), ("a", (1,))]


def test_binpack_moves_on_when_the_busiest_node_is_full() -> None:
    result = place(demand(replicas=2, memory_gib=50, policy="binpack"), [gpu_node("a", 60), gpu_node("b", 80)])
    assert spots(result) == [("a", (0,)), ("b", (0,))]


def test_tensor_parallel_replicas_take_all_their_gpus_on_one_node() -> None:
    # 40 GiB over 2 GPUs: 20 GiB each. a has one GPU; b's two have 16 free; c's two have 30.
    nodes = [gpu_node("a", 80), gpu_node("b", 16, 16), gpu_node("c", 30, 30)]
    assert spots(place(demand(gpus=2, memory_gib=40), nodes)) == [("c", (0, 1))]


def test_the_memory_need_is_split_evenly_and_rounded_up() -> None:
    need = demand(gpus=2, memory_gib=None)
    assert need.memory_per_gpu_bytes is None
    assert Demand(1, 2, 2 * GiB + 1).memory_per_gpu_bytes == GiB + 1


def test_unschedulable_names_the_best_node_and_what_it_has() -> None:
    nodes = [gpu_node("gpu-a", 40, 10), gpu_node("gpu-b", 10, 10)]
    result = place(demand(gpus=2, memory_gib=40), nodes)
    assert result == Unschedulable("needs 2 GPUs with 20 GiB free each; the best node, gpu-a, has 1")


def test_unschedulable_says_how_much_the_roomiest_gpu_has_when_none_fits() -> None:
    result = place(demand(memory_gib=50), [gpu_node("a", 30, 12.5)])
    assert isinstance(result, Unschedulable)
    assert result.reason == (
        "needs 1 GPU with 50 GiB free; the best node, a, has 0 (its GPU with the most free memory has 30 GiB)"
    )


def test_replicas_that_fit_are_placed_and_the_rest_explained() -> None:
    result = place(demand(replicas=3, memory_gib=50), [gpu_node("a", 80), gpu_node("b", 60)])
    assert isinstance(result, Unschedulable)
    assert spots(result) == [("a", (0,)), ("b", (0,))]
    assert result.reason == (
        "only 2 of 3 replicas fit; the third needs 1 GPU with 50 GiB free; "
        "the best node, a, has 0 (its GPU with the most free memory has 30 GiB)"
    )


def test_with_no_node_registered_the_reason_says_to_start_an_agent() -> None:
    result = place(demand(), [])
    assert isinstance(result, Unschedulable)
    assert result.reason.startswith("no node is registered")


def test_offline_and_draining_nodes_take_nothing_and_are_named() -> None:
    nodes = [gpu_node("a", 80, unschedulable_because="offline"), gpu_node("b", 80, unschedulable_because="draining")]
    result = place(demand(), nodes)
    assert result == Unschedulable("no node can take new instances: a is offline, b is draining")


def test_only_schedulable_nodes_are_used() -> None:
    nodes = [gpu_node("a", 80, unschedulable_because="draining"), gpu_node("b", 30)]
    assert spots(place(demand(replicas=1), nodes)) == [("b", (0,))]


def test_a_replica_goes_only_to_a_node_that_runs_its_engine_even_a_fuller_one() -> None:
    nodes = [gpu_node("a", 80, 80, engines=frozenset({"mocker"})), gpu_node("b", 25, engines=frozenset({"vllm"}))]
    assert spots(place(demand(replicas=1, engine="vllm"), nodes)) == [("b", (0,))]
    result = place(demand(replicas=2, engine="vllm"), nodes)
    assert result == Unschedulable(
        "only 1 of 2 replicas fit; the second needs 1 GPU with 20 GiB free; the best node, b, has 0 "
        "(its GPU with the most free memory has 5 GiB)",
        (ReplicaPlacement("b", (0,)),),
    )


def test_when_no_node_runs_the_engine_the_reason_says_how_to_get_it() -> None:
    nodes = [gpu_node("a", 80, engines=frozenset({"mocker"})), cpu_node("b", 64, engines=frozenset())]
    result = place(demand(engine="vllm"), nodes)
    assert result == Unschedulable("no node runs vllm: install it with pip install 'flotilla[vllm]' on a node")
    pinned = place(demand(gpus=0, engine="mocker", pinned_nodes=frozenset({"b"})), nodes)
    assert pinned == Unschedulable(
        "no node it is pinned to (b) runs mocker: run an agent of this version on a node (it runs mocker with no "
        "extra install)"
    )


def test_nodes_that_run_the_engine_but_take_nothing_new_are_named() -> None:
    nodes = [gpu_node("a", 80, engines=frozenset({"vllm"}), unschedulable_because="cordoned"), gpu_node("b", 80)]
    result = place(demand(engine="vllm"), [nodes[0], replace(nodes[1], engines=frozenset({"mocker"}))])
    assert result == Unschedulable("no node can take new instances: a is cordoned")


def test_pinned_nodes_restrict_placement_even_to_a_worse_node() -> None:
    nodes = [gpu_node("a", 80, 80), gpu_node("b", 25)]
    result = place(demand(replicas=1, pinned_nodes=frozenset({"b"})), nodes)
    assert spots(result) == [("b", (0,))]


def test_pinning_to_nodes_that_are_not_registered_says_so() -> None:
    result = place(demand(pinned_nodes=frozenset({"gpu-z"})), [gpu_node("a", 80)])
    assert result == Unschedulable("pinned to gpu-z, which is not registered")


def test_pinned_gpus_restrict_the_indexes_used() -> None:
    result = place(demand(replicas=2, pinned_gpus=frozenset({2, 3})), [gpu_node("a", 80, 80, 80, 80)])
    assert spots(result) == [("a", (2,)), ("a", (3,))]


def test_pinned_gpus_that_are_too_few_for_a_replica_say_so() -> None:
    result = place(demand(gpus=2, pinned_gpus=frozenset({1})), [gpu_node("a", 80, 80)])
    assert result == Unschedulable("pinned to 1 GPU (1) but each replica needs 2")


def test_reasons_mention_the_pinned_gpus() -> None:
    result = place(demand(memory_gib=50, pinned_gpus=frozenset({1})), [gpu_node("a", 80, 20)])
    assert isinstance(result, Unschedulable)
    assert result.reason.startswith("needs 1 GPU among GPUs 1 with 50 GiB free; the best node, a, has 0")


def test_an_unknown_memory_need_takes_gpus_no_instance_uses() -> None:
    node = gpu_node("a", 80, 80, instances=(1, 0))
    assert spots(place(demand(memory_gib=None), [node])) == [("a", (1,))]
    result = place(demand(replicas=2, memory_gib=None), [node])
    assert isinstance(result, Unschedulable)
    assert result.reason == (
        "only 1 of 2 replicas fit; the second needs 1 unused GPU (its memory need is unknown); the best node, a, has 0"
    )


def test_gpu_replicas_on_a_fleet_without_gpus_are_told_so() -> None:
    result = place(demand(), [cpu_node("cpu-a", 64)])
    assert result == Unschedulable("needs 1 GPU with 20 GiB free; no node that can take new instances has a GPU")


def test_cpu_replicas_prefer_nodes_without_gpus() -> None:
    nodes = [gpu_node("a-gpu", 80), cpu_node("b-cpu", 8)]
    assert spots(place(demand(gpus=0, memory_gib=4), nodes)) == [("b-cpu", ())]
    assert spots(place(demand(gpus=0, memory_gib=4, policy="binpack"), nodes)) == [("b-cpu", ())]


def test_cpu_replicas_spread_over_nodes_before_preferring_cpu_only_ones() -> None:
    nodes = [gpu_node("a-gpu", 80), cpu_node("b-cpu", 8)]
    assert spots(place(demand(replicas=2, gpus=0, memory_gib=4), nodes)) == [("b-cpu", ()), ("a-gpu", ())]


def test_cpu_replicas_binpack_onto_the_node_with_least_free_memory_that_fits() -> None:
    nodes = [cpu_node("a", 32), cpu_node("b", 6), cpu_node("c", 3)]
    # 4 GiB each: b (6 free) first; then b has 2 free, so a.
    result = place(demand(replicas=2, gpus=0, memory_gib=4, policy="binpack"), nodes)
    assert spots(result) == [("b", ()), ("a", ())]


def test_cpu_replicas_with_unknown_memory_fit_any_schedulable_node() -> None:
    nodes = [cpu_node("a", 0), cpu_node("b", 0, unschedulable_because="offline")]
    assert spots(place(demand(replicas=2, gpus=0, memory_gib=None), nodes)) == [("a", ()), ("a", ())]


def test_cpu_replicas_that_do_not_fit_name_the_roomiest_node() -> None:
    result = place(demand(gpus=0, memory_gib=4), [cpu_node("cpu-a", 2), cpu_node("cpu-b", 1)])
    assert result == Unschedulable("needs a node with 4 GiB of free memory; the best node, cpu-a, has 2 GiB free")


def test_zero_replicas_place_nothing() -> None:
    assert place(demand(replicas=0), []) == Placement(())


def test_negative_demands_are_a_programming_error() -> None:
    with pytest.raises(ValueError, match="≥ 0"):
        place(demand(replicas=-1), [])


def test_the_inventory_is_not_modified() -> None:
    nodes = [gpu_node("a", 80)]
    place(demand(replicas=2), nodes)
    assert nodes[0].gpus[0].memory_free_bytes == 80 * GiB


@pytest.mark.parametrize(
    ("size", "text"),
    [(20 * GiB, "20 GiB"), (3 * GiB // 2, "1.5 GiB"), (512 << 20, "512 MiB"), (2048, "2 KiB"), (10, "10 bytes")],
)
def test_sizes_read_as_people_write_them(size: int, text: str) -> None:
    assert format_bytes(size) == text


# The host KV tier: system memory on the node, for GPU replicas too.


def test_a_gpu_replica_with_a_host_tier_goes_to_a_node_with_that_memory_free() -> None:
    short = replace(gpu_node("gpu-a", 80), memory_free_bytes=8 * GiB)
    roomy = replace(gpu_node("gpu-b", 80), memory_free_bytes=64 * GiB)
    result = place(demand(host_memory_per_replica_bytes=16 * GiB), [short, roomy])
    assert result == Placement((ReplicaPlacement("gpu-b", (0,)),))


def test_a_gpu_replica_whose_host_tier_fits_nowhere_is_unschedulable_for_memory() -> None:
    node = replace(gpu_node("gpu-a", 80, 80), memory_free_bytes=24 * GiB)
    result = place(demand(replicas=2, host_memory_per_replica_bytes=16 * GiB), [node])
    assert result == Unschedulable(
        "only 1 of 2 replicas fit; the second needs 1 GPU with 20 GiB free and 16 GiB of free system memory for its "
        "host KV tier; the best node with the GPUs, gpu-a, has 8 GiB of system memory free",
        (ReplicaPlacement("gpu-a", (0,)),),
    )


def test_a_cpu_replica_needs_its_model_and_its_host_tier_together() -> None:
    result = place(demand(gpus=0, memory_gib=10, host_memory_per_replica_bytes=20 * GiB), [cpu_node("cpu-a", 25)])
    assert result == Unschedulable(
        "needs a node with 30 GiB of free memory (20 GiB of it for its host KV tier); the best node, cpu-a, has "
        "25 GiB free"
    )


def test_a_cpu_replica_of_unknown_size_still_needs_its_host_tier() -> None:
    result = place(demand(gpus=0, memory_gib=None, host_memory_per_replica_bytes=20 * GiB), [cpu_node("cpu-a", 8)])
    assert isinstance(result, Unschedulable) and result.reason.startswith("needs a node with 20 GiB of free memory")


def test_a_negative_host_tier_is_a_mistake() -> None:
    with pytest.raises(ValueError, match="host memory"):
        place(demand(host_memory_per_replica_bytes=-1), [gpu_node("gpu-a", 80)])
