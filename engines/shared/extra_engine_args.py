"""``--extra-engine-args``: an engine's own arguments, from a file or given inline (the node agent passes
a pipeline's inline), read for every engine that takes them, and checked by name for those whose
library cannot be imported where they are checked.

SGLang and TensorRT-LLM import only on a CUDA machine, so their argument names cannot be looked up
where the arguments are checked: each engine module keeps the list of names its library documents,
with the version they were read from, and a key outside it is refused (exit 2) naming it
(``check_arg_names``). A key that Flotilla sets from its own flags (the GPU count, the memory share) is
refused too, naming the flag, so that the control plane's reservation is the one the engine gets. vLLM
checks names against its installed ``AsyncEngineArgs`` (engines/vllm/settings.py); the mocker and mistral.rs
against their settings' fields.
"""

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from runtime.errors import ConfigError


def engine_args_source(raw: Path | str, syntax: Literal["json", "yaml"] = "json") -> str:
    """How messages name ``raw``: the flag and the file, or the flag and "inline"."""
    return f"--extra-engine-args (inline {syntax.upper()})" if isinstance(raw, str) else f"--extra-engine-args {raw}"


def read_engine_args(raw: Path | str | None, *, engine: str, syntax: Literal["json", "yaml"]) -> dict[str, Any]:
    """The object in file ``raw``, or in ``raw`` itself when it is a str (inline, as the node agent passes a
    pipeline's); ``{}`` when None. YAML is read with PyYAML (TensorRT-LLM depends on it); where PyYAML is
    absent, a YAML file is read as JSON, which is YAML too.

    Raises ConfigError naming the source when it cannot be read or is not an object.
    """
    if raw is None:
        return {}
    source = engine_args_source(raw, syntax)
    if isinstance(raw, str):
        text = raw
    else:
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
