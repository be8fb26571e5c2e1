"""What an agent refuses to run whatever the broker says: engines that are not the fleet's or not on this node
(a Python file above all), a model path of the task's choosing, and engine args that are not the engine's."""

import msgspec
import pytest

from agent.errors import TaskNotAllowed
from agent.tasks.checks import ENGINE_FLAGS, check_engine_args, check_start
from launcher.run_parser import build_run_parser
from runtime.fleet_contract.engine_names import FLEET_ENGINES, IMPLEMENTED_ENGINES
from runtime.fleet_contract.tasks import LocalSource, StartInstance, WorkerSpec

HERE = frozenset({"mocker", "echo_full", "llamacpp"})
START = StartInstance(
    spec=WorkerSpec(
        instance_id=7,
        pipeline="chat",
        group="aggregated",
        replica=0,
        engine="mocker",
        engine_args=["--context-length", "2048", "--extra-engine-args", '{"dp_size":2,"speedup_ratio":100}'],
    )
)


def with_spec(**fields: object) -> StartInstance:
    return msgspec.structs.replace(START, spec=msgspec.structs.replace(START.spec, **fields))


def refusal(request: StartInstance) -> str:
    with pytest.raises(TaskNotAllowed) as refused:
        check_start(request, engines=HERE, node="gpu-a")
    return str(refused.value)


def test_a_start_of_an_engine_the_node_has_with_the_engines_own_flags_passes() -> None:
    check_start(START, engines=HERE, node="gpu-a")
    check_start(with_spec(engine="echo_full", engine_args=[]), engines=HERE, node="gpu-a")
    check_start(with_spec(engine="llamacpp", engine_args=["--threads=4"]), engines=HERE, node="gpu-a")
    # What the control plane adds to a GPU engine's start: the memory share and GPU count it placed it by.
    vllm = with_spec(engine="vllm", engine_args=["--gpu-memory-utilization", "0.188", "--tensor-parallel-size", "2"])
    check_start(vllm, engines={"vllm"}, node="gpu-a")


def test_a_python_file_as_the_engine_is_refused_whatever_its_kind() -> None:
    for engine in ("pystr:/tmp/evil.py", "pytok:evil.py"):
        assert "runs a Python file of the node's" in refusal(with_spec(engine=engine))


def test_an_engine_that_is_not_the_fleets_or_not_on_this_node_is_refused() -> None:
    assert refusal(with_spec(engine="bash")).startswith("engine 'bash' is not one of the fleet's (mocker, llamacpp")
    assert refusal(with_spec(engine="vllm")) == (
        "engine 'vllm' is not available on node gpu-a (it runs: echo_full, llamacpp, mocker)"
    )


def test_a_model_path_is_the_agents_to_set_not_the_tasks() -> None:
    assert "names a model path ('/etc/shadow')" in refusal(with_spec(model_path="/etc/shadow"))


def test_a_projector_path_is_the_agents_to_set_and_only_llamacpp_takes_a_projector() -> None:
    assert "names a projector path ('/etc/shadow')" in refusal(with_spec(projector_path="/etc/shadow"))
    projector = LocalSource(path="/models/mmproj.gguf")
    llamacpp = msgspec.structs.replace(
        with_spec(engine="llamacpp", engine_args=[]), source=LocalSource(path="/models/m.gguf"), projector=projector
    )
    check_start(llamacpp, engines=HERE, node="gpu-a")
    alone = msgspec.structs.replace(llamacpp, source=None)
    assert refusal(alone) == "the task gives a projector without a model source: a projector is part of a model"
    mocker = msgspec.structs.replace(START, projector=projector)
    assert refusal(mocker) == "the task gives a projector to out=mocker: only out=llamacpp takes one"


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["out=pystr:/tmp/evil.py"], "'out=pystr:/tmp/evil.py' is not a flag"),
        (["in=dyn://other.backend.generate"], "is not a flag"),
        (["/models/other.gguf"], "'/models/other.gguf' is not a flag"),
        (["--labels", "node=gpu-b"], "'--labels' is not one a task may set"),
        (["--lab", "node=gpu-b"], "'--lab' is not one a task may set"),  # argparse would take it for --labels
        (["--model-name", "someone-elses-model"], "'--model-name' is not one a task may set"),
        (["--router-mode=random"], "'--router-mode' is not one a task may set"),
        (["--model-path", "/tmp"], "'--model-path' is not one a task may set"),
        (["-v"], "'-v' is not one a task may set"),
        (["--threads", "--labels", "node=gpu-b"], "--threads '--labels': the value is not a whole number"),
        (["--context-length"], "'--context-length' needs a value"),
        (["--extra-engine-args", "/etc/flotilla/mocker.json"], "names a file"),
        (["--gpu-memory-utilization", "1.5"], "'1.5': the value is not a share of a GPU (0 to 1)"),
        (["--gpu-memory-utilization=nan"], "'nan': the value is not a share of a GPU"),
        (["--gpu-memory-utilization", "--labels"], "'--labels': the value is not a share of a GPU"),
        (["--tensor-parallel-size", "two"], "--tensor-parallel-size 'two': the value is not a whole number"),
    ],
)
def test_engine_args_that_would_set_what_the_agent_sets_are_refused_saying_which(args: list[str], why: str) -> None:
    with pytest.raises(TaskNotAllowed, match=r"^engine arg|^--extra-engine-args") as refused:
        check_engine_args(args)
    assert why in str(refused.value)


def test_the_flags_a_task_may_give_are_flags_of_flotilla_run_that_take_a_value() -> None:
    actions = {option: action for action in build_run_parser()._actions for option in action.option_strings}
    for flag in ENGINE_FLAGS:
        assert actions[flag].nargs is None and actions[flag].const is None, flag


def test_every_engine_flotilla_run_implements_is_one_of_the_fleets() -> None:
    assert set(IMPLEMENTED_ENGINES) <= FLEET_ENGINES


def test_flotilla_run_implements_every_engine_of_the_fleet() -> None:
    # No engine is only planned: a name the catalog offers is one ``flotilla run`` runs.
    assert set(IMPLEMENTED_ENGINES) >= FLEET_ENGINES
