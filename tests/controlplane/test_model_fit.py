"""Where a model would fit, per engine: placement's answer on the inventory, before it is deployed."""

from controlplane.dashboard.model_fit import engine_fits, serving_engines
from controlplane.deployments.placement import GpuInventory, NodeInventory

GiB = 1 << 30
ENGINES = frozenset({"llamacpp", "mistralrs", "vllm"})


def node(name: str, free_gib: tuple[float, ...], *, memory_gib: float = 8, because: str = "") -> NodeInventory:
    gpus = tuple(
        GpuInventory(index=index, memory_total_bytes=80 * GiB, memory_free_bytes=int(free * GiB))
        for index, free in enumerate(free_gib)
    )
    return NodeInventory(
        name, gpus, memory_free_bytes=int(memory_gib * GiB), unschedulable_because=because, engines=ENGINES
    )


def test_gguf_files_are_served_by_llamacpp_and_mistralrs_and_folders_by_the_others() -> None:
    assert serving_engines(is_gguf=True) == ["llamacpp", "mistralrs"]
    assert serving_engines(is_gguf=False) == ["mistralrs", "vllm", "sglang", "trtllm"]


def test_every_gpu_with_room_is_named_and_full_ones_are_not() -> None:
    [fit] = engine_fits(30 * GiB, ["vllm"], [node("a", (40, 20)), node("b", (31,))])
    assert fit.gpus == ["a GPU 0: 40 GiB free", "b GPU 0: 31 GiB free"]
    assert fit.nodes == []  # vLLM runs on GPUs only
    assert fit.fits and not fit.problem


def test_a_replica_too_big_for_one_gpu_is_split_over_the_fewest_gpus_of_one_node() -> None:
    [fit] = engine_fits(60 * GiB, ["vllm"], [node("a", (20, 20, 20, 20)), node("b", (35, 35))])
    assert fit.gpus == [] and fit.multi_gpu == "2 GPUs of b (0, 1), 30 GiB each"


def test_engines_that_run_on_cpu_list_the_nodes_with_the_memory() -> None:
    [fit] = engine_fits(6 * GiB, ["llamacpp"], [node("cpu", (), memory_gib=7), node("tiny", (), memory_gib=4)])
    assert fit.nodes == ["cpu: 7 GiB free"] and fit.gpus == []


def test_nodes_that_take_no_new_instances_are_left_out() -> None:
    [fit] = engine_fits(10 * GiB, ["vllm"], [node("a", (40,), because="draining")])
    assert not fit.fits and "no node can take new instances: a is draining" in fit.problem


def test_fitting_nowhere_gives_placements_reason_on_gpus_and_on_cpu() -> None:
    [fit] = engine_fits(50 * GiB, ["llamacpp"], [node("a", (20,))])
    assert fit.problem.startswith("on GPUs: needs 1 GPU with 50 GiB free; the best node, a, has 0")
    assert "on CPU: needs a node with 50 GiB of free memory" in fit.problem


def test_an_engine_no_node_runs_says_how_to_get_one() -> None:
    [fit] = engine_fits(1 * GiB, ["sglang"], [node("a", (80,))])
    assert "no node runs sglang" in fit.problem


def test_an_unknown_need_gives_no_answer() -> None:
    [fit] = engine_fits(None, ["vllm"], [node("a", (80,))])
    assert not fit.fits and "size of its weights is unknown" in fit.problem


def test_a_large_fleet_is_not_listed_whole() -> None:
    [fit] = engine_fits(1 * GiB, ["vllm"], [node(f"n{index}", (80, 80)) for index in range(10)])
    assert len(fit.gpus) == 9 and fit.gpus[-1] == "and 12 more"
