"""What the GPU engines (SGLang, TensorRT-LLM) are given: the placement the control plane reserved, and
the library's own arguments from ``--extra-engine-args``, checked by name before the library loads.
(vLLM reads its arguments here too, but checks their names against its installed ``AsyncEngineArgs``:
vllm_settings.py.)

The libraries import only on a CUDA machine, so their argument names cannot be looked up where the
arguments are checked: each engine module keeps the list of names its library documents, with the
version they were read from, and a key outside it is refused (exit 2) naming it. A key that Flotilla
sets from its own flags (the GPU count, the memory share) is refused too, naming the flag, so that
the control plane's reservation is the one the engine gets.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from runtime.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class GpuPlacement:
    """Where a GPU engine runs and how much it may take: from ``flotilla run``'s flags, which the node
    agent sets from what the control plane reserved."""

    #: GPUs one replica spans (tensor parallelism).
    tensor_parallel_size: int = 1
    #: The first of the (visible) GPUs the engine takes; the agent's CUDA_VISIBLE_DEVICES already names
    #: the reserved ones, so this is 0 under an agent.
    base_gpu_id: int = 0
    #: The context length Flotilla serves (None: the model's own).
    context_length: int | None = None
    #: The share of each GPU's memory the engine may take (0 < f <= 1); None: the library's default.
    gpu_memory_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size must be at least 1, not {self.tensor_parallel_size}")
        if self.base_gpu_id < 0:
            raise ConfigError(f"--base-gpu-id must be at least 0, not {self.base_gpu_id}")
        fraction = self.gpu_memory_fraction
        if fraction is not None and not 0 < fraction <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be above 0 and at most 1, not {fraction}")


def read_engine_args(raw: Path | str | None, *, engine: str, syntax: Literal["json", "yaml"]) -> dict[str, Any]:
    """The object in file ``raw``, or in ``raw`` itself when it is a str (inline, as the node agent passes a
    pipeline's); ``{}`` when None. YAML is read with PyYAML (TensorRT-LLM depends on it); where PyYAML is
    absent, a YAML file is read as JSON, which is YAML too.

    Raises ConfigError naming the source when it cannot be read or is not an object.
    """
    if raw is None:
        return {}
    if isinstance(raw, str):
        source, text = "--extra-engine-args (inline)", raw
    else:
        source = f"--extra-engine-args {raw}"
        try:
            text = raw.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{source}: cannot be read: {exc}") from None
    values: object
    if syntax == "yaml":
        values = _load_yaml(text, source)
    else:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source}: not valid JSON: {exc}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: expected a {syntax.upper()} object of out={engine}'s arguments")
    return values


def _load_yaml(text: str, source: str) -> object:
    try:
        import yaml
    except ImportError:
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source}: not valid YAML in JSON form, and PyYAML is not installed: {exc}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None


def check_arg_names(
    values: Mapping[str, Any],
    *,
    engine: str,
    documented: frozenset[str],
    read_from: str,
    set_by_flags: Mapping[str, str],
) -> None:
    """Refuse a key of ``values`` that the library does not document (``documented``, read from
    ``read_from``) or that Flotilla sets from a flag (``set_by_flags``: key -> flag). Raises ConfigError."""
    for key in values:
        if key in set_by_flags:
            raise ConfigError(
                f"--extra-engine-args: {key!r} is set by Flotilla for out={engine}: use {set_by_flags[key]} instead"
            )
        if key not in documented:
            raise ConfigError(
                f"--extra-engine-args: unknown key {key!r} for out={engine} (not among the arguments documented "
                f"by {read_from}; see the list in engines/{engine}.py)"
            )
