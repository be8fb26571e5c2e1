"""What an agent refuses to run, whoever sent the task: the broker carries tasks, it does not vouch for them.

A StartInstance becomes a process on this node, so the agent checks it before anything is downloaded or
launched (``check_start``): its engine is one of the fleet's (runtime/fleet_contract/engine_names.py) that this
node has, never ``pystr:``/``pytok:`` (a Python file of the node's, which would run any code); its model path comes
from the agent's own download, not from the task; and its engine args are only the flags the engine is
configured with (``ENGINE_FLAGS``), never a second ``in=``/``out=``, a model, ``--labels`` or the other
flags by which the agent says what a worker is. Each refusal says exactly what was refused and why.
"""

import re
from collections.abc import Collection, Sequence

from agent.errors import TaskNotAllowed
from runtime.fleet_contract.engine_names import ENGINE_LABELS, FLEET_ENGINES
from runtime.fleet_contract.tasks import StartInstance
from runtime.lora import MAX_NAME_LENGTH

#: The ``flotilla run`` flags a task's engine args may carry, each with a value: those that configure the
#: engine. The others are the agent's to set (the model, ``--model-name``, ``--labels``, the pipeline's
#: ``--router-*`` flags) or mean nothing to a worker. Matched exactly: argparse would take an abbreviation
#: (``--lab``) for the flag it starts.
ENGINE_FLAGS = (
    "--context-length",
    "--threads",
    "--parallel",
    # A GPU engine's: the memory share and the GPU count the control plane placed it by
    # (controlplane/deployments/worker_specs.py adds them to the start of vLLM, SGLang and TensorRT-LLM).
    "--gpu-memory-utilization",
    "--tensor-parallel-size",
    # Inline JSON only: a path would make the worker read a file the task chose.
    "--extra-engine-args",
)
_PYTHON_FILE_ENGINES = ("pystr:", "pytok:")
#: A pipeline's namespace (it names its adapter file) and an adapter's name (runtime/lora.py).
_NAMESPACE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_ADAPTER_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:/-]{{0,{MAX_NAME_LENGTH - 1}}}")


def check_start(request: StartInstance, *, engines: Collection[str], node: str) -> None:
    """Refuse ``request`` unless this node may run it as it stands. Raises TaskNotAllowed saying why.

    ``engines`` are the engines this node can run (``runtime.fleet_contract.engine_names.engines_on_this_node()``).
    """
    spec = request.spec
    check_engine(spec.engine, engines=engines, node=node)
    if spec.model_path is not None:
        raise TaskNotAllowed(
            f"the task names a model path ({spec.model_path!r}): a worker's model is what the agent fetched "
            "from the task's source"
        )
    if spec.projector_path is not None:
        raise TaskNotAllowed(
            f"the task names a projector path ({spec.projector_path!r}): a worker's projector is what the agent "
            "fetched from the task's projector"
        )
    if request.projector is not None and spec.engine != "llamacpp":
        raise TaskNotAllowed(f"the task gives a projector to out={spec.engine}: only out=llamacpp takes one")
    if request.projector is not None and request.source is None:
        raise TaskNotAllowed("the task gives a projector without a model source: a projector is part of a model")
    if spec.lora_file is not None:
        raise TaskNotAllowed(
            f"the task names an adapter file ({spec.lora_file!r}): a worker's adapter file is the one the agent "
            "writes from the task's adapters"
        )
    check_engine_args(spec.engine_args)
    check_adapters(spec.pipeline, [adapter.name for adapter in spec.adapters])


def check_adapters(pipeline: str, names: Sequence[str]) -> None:
    """Refuse a pipeline namespace that cannot name a file, or an adapter name that is not a served model name
    (runtime/lora.py). Raises TaskNotAllowed."""
    if not _NAMESPACE.fullmatch(pipeline):
        raise TaskNotAllowed(f"pipeline {pipeline!r} is not a namespace (1-64 letters, digits, '-' or '_')")
    for name in names:
        if not _ADAPTER_NAME.fullmatch(name):
            raise TaskNotAllowed(
                f"adapter name {name!r} is not 1-{MAX_NAME_LENGTH} letters, digits or . _ : / -, starting with a "
                "letter or digit"
            )


def check_engine(engine: str, *, engines: Collection[str], node: str) -> None:
    """Refuse an engine that is not the fleet's, or that this node cannot run. Raises TaskNotAllowed."""
    if engine.startswith(_PYTHON_FILE_ENGINES):
        raise TaskNotAllowed(
            f"engine {engine!r} runs a Python file of the node's: a person may run it by hand with flotilla "
            "run, a fleet task may not"
        )
    if engine not in FLEET_ENGINES:
        raise TaskNotAllowed(f"engine {engine!r} is not one of the fleet's ({', '.join(ENGINE_LABELS)})")
    if engine not in engines:
        runs = ", ".join(sorted(engines)) or "none"
        raise TaskNotAllowed(f"engine {engine!r} is not available on node {node} (it runs: {runs})")


def check_engine_args(args: Sequence[str]) -> None:
    """Refuse engine args other than ``ENGINE_FLAGS`` with their values. Raises TaskNotAllowed."""
    words = iter(args)
    for word in words:
        flag, equals, value = word.partition("=")
        if not flag.startswith("-"):
            raise TaskNotAllowed(f"engine arg {word!r} is not a flag: in=, out= and the model are the agent's to set")
        if flag not in ENGINE_FLAGS:
            raise TaskNotAllowed(f"engine arg {flag!r} is not one a task may set (only {', '.join(ENGINE_FLAGS)})")
        if not equals:
            following = next(words, None)
            if following is None:
                raise TaskNotAllowed(f"engine arg {flag!r} needs a value")
            value = following
        _check_value(flag, value)


def _check_value(flag: str, value: str) -> None:
    if flag == "--extra-engine-args":
        if not value.lstrip().startswith("{"):
            raise TaskNotAllowed(
                f"--extra-engine-args {value!r} names a file: a task gives the engine's settings as a JSON object"
            )
    elif flag == "--gpu-memory-utilization":
        try:
            share = float(value)
        except ValueError:
            share = -1.0
        if not 0 < share <= 1:  # NaN fails this too
            raise TaskNotAllowed(f"engine arg {flag} {value!r}: the value is not a share of a GPU (0 to 1)")
    elif not value.isdigit():
        raise TaskNotAllowed(f"engine arg {flag} {value!r}: the value is not a whole number")
