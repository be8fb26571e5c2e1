"""The engines a fleet may run: the one list the catalog offers, the agent accepts and ``flotilla run`` knows.

A fleet task names its engine (``WorkerSpec.engine``, the worker's ``out=``). Only a name listed here can
reach a worker: the control plane offers these and no others (``controlplane/catalog/engines.py`` builds
its choices from ``ENGINE_LABELS``), and an agent refuses a task naming anything else. ``flotilla run``
also takes ``out=pystr:FILE.py`` and ``out=pytok:FILE.py`` (a user's Python file as the engine): a person
may run those by hand, but a task may not, since a name the broker carries would then run any code.

``IMPLEMENTED_ENGINES`` are those this version of ``flotilla run`` runs: every name of ``ENGINE_LABELS``.
``engines_on_this_node()`` is what an agent can run here.
"""

import importlib.util

#: Every engine a fleet may run, and how the dashboard names it, in the order it lists them.
ENGINE_LABELS: dict[str, str] = {
    "mocker": "mocker (simulated vLLM, no weights)",
    "llamacpp": "llama.cpp (GGUF)",
    "mistralrs": "mistral.rs",
    "vllm": "vLLM",
    "sglang": "SGLang",
    "trtllm": "TensorRT-LLM",
    "echo_core": "echo (tokens)",
    "echo_full": "echo (text)",
}
FLEET_ENGINES = frozenset(ENGINE_LABELS)

#: The engines this version of ``flotilla run`` implements: every engine of the fleet
#: (tests/agent/test_task_checks.py holds the two lists to the same names).
#: GPU-only engines are listed too: ``engines_on_this_node()`` reports one only where its library imports,
#: so an agent on a CPU node refuses its tasks and the catalog offers it only where some node has it.
IMPLEMENTED_ENGINES = ("echo_core", "echo_full", "llamacpp", "mistralrs", "mocker", "sglang", "trtllm", "vllm")

#: These run only on a GPU: a worker group of theirs needs at least one GPU per replica.
GPU_ONLY_ENGINES = frozenset({"vllm", "sglang", "trtllm"})
#: llama.cpp loads GGUF files only.
GGUF_ONLY_ENGINES = frozenset({"llamacpp"})
#: Engines whose workers need no model files: nothing to download, no MODEL argument.
ENGINES_WITHOUT_FILES = frozenset({"echo_full"})
#: Engines configured by one object of their own settings (``flotilla run --extra-engine-args``): JSON, YAML
#: for trtllm (JSON is YAML too).
SETTINGS_FILE_ENGINES = frozenset({"mistralrs", "mocker", "sglang", "trtllm", "vllm"})

#: Engines that serve prefill and decode on separate workers (``flotilla run --disagg-role``): a worker group of
#: role prefill or decode must run one of them.
DISAGG_ENGINES = ("mocker", "sglang", "trtllm", "vllm")

#: Engines that load LoRA adapters at run time (runtime/lora.py's ``LoraEngine``; ``flotilla run --lora``): a
#: pipeline of another engine cannot load one, and its workers get no ``--lora-file``.
LORA_ENGINES = ("llamacpp", "mocker", "sglang", "trtllm", "vllm")
#: Of those, the engines that take a first adapter at run time at no cost to a worker started without one (no
#: memory set aside, no other kernels): their workers always get an adapter file, so a pipeline's first adapter
#: loads without a restart. vLLM, SGLang and TensorRT-LLM must be started with LoRA enabled (their own rule), so a
#: pipeline's first load rolls their workers over, once.
LORA_AT_NO_COST_ENGINES = ("llamacpp", "mocker")

#: The Python package an engine needs beyond Flotilla's own dependencies (an optional install).
_ENGINE_PACKAGES = {
    "llamacpp": "llama_cpp",
    "mistralrs": "mistralrs",
    "sglang": "sglang",
    "trtllm": "tensorrt_llm",
    "vllm": "vllm",
}


def engines_on_this_node() -> frozenset[str]:
    """The engines a worker started by this interpreter can run: the implemented ones whose package is
    installed (looked up, not imported: importing llama.cpp or vLLM takes seconds)."""
    return frozenset(
        name
        for name in IMPLEMENTED_ENGINES
        if (package := _ENGINE_PACKAGES.get(name)) is None or importlib.util.find_spec(package) is not None
    )
