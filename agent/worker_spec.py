"""What the agent runs for an instance: a typed spec, and the ``flotilla run`` command line built from it.

A worker is ``flotilla run in=dyn://<pipeline>.<component>.<endpoint> out=<engine> [MODEL] [engine args]
--labels pipeline=…,group=…,replica=…,node=…,instance=…``: the labels go into its etcd registration,
which is how the agent (readiness) and the gateway tell whose instance it is.
"""

import sys
from collections.abc import Mapping, Sequence

import msgspec

from runtime.addressing import EndpointAddress
from runtime.endpoint import format_labels

#: How the agent starts ``flotilla``: the launcher of this very installation, whatever PATH says.
DEFAULT_COMMAND = (sys.executable, "-m", "launcher.cli")


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One engine worker of an instance, as the control plane dispatches it (JSON in a Celery task)."""

    instance_id: int
    pipeline: str  # the dyn:// namespace of the pipeline
    group: str  # the worker group's role ("aggregated", later "prefill"/"decode")
    replica: int
    engine: str  # out=<engine>
    model_path: str | None = None  # the local path the download gave; None for engines that need no model
    model_name: str | None = None  # the name clients use (--model-name)
    component: str = "backend"
    endpoint: str = "generate"
    engine_args: list[str] = []
    gpu_indexes: list[int] = []
    #: Memory the worker declares on each of its GPUs: what a simulated GPU reports as used.
    gpu_memory_bytes: int = 0
    labels: dict[str, str] = {}
    env: dict[str, str] = {}

    @property
    def address(self) -> EndpointAddress:
        """The worker's endpoint. Raises ConfigError for a pipeline, component or endpoint name it cannot use."""
        return EndpointAddress(self.pipeline, self.component, self.endpoint)


def worker_labels(spec: WorkerSpec, node: str) -> dict[str, str]:
    """The labels of ``spec``'s registration: the spec's, and the agent's own, which say whose instance it is
    (a spec's label cannot override those)."""
    own = {
        "pipeline": spec.pipeline,
        "group": spec.group,
        "replica": str(spec.replica),
        "node": node,
        "instance": str(spec.instance_id),
    }
    return {**{key: value for key, value in spec.labels.items() if key not in own}, **own}


def worker_argv(spec: WorkerSpec, node: str, command: Sequence[str] = DEFAULT_COMMAND) -> list[str]:
    """The command line of ``spec``'s worker. Raises ConfigError for a name or label it cannot carry."""
    argv = [*command, "run", f"in={spec.address}", f"out={spec.engine}"]
    if spec.model_path is not None:
        argv.append(spec.model_path)
    if spec.model_name is not None:
        argv += ["--model-name", spec.model_name]
    argv += spec.engine_args
    argv += ["--labels", format_labels(worker_labels(spec, node))]
    return argv


def worker_env(spec: WorkerSpec, base: Mapping[str, str]) -> dict[str, str]:
    """The worker's environment: ``base``, the spec's variables, and its GPUs in ``CUDA_VISIBLE_DEVICES``.

    A worker with no GPUs gets an empty ``CUDA_VISIBLE_DEVICES``, so that it cannot take one it was not given.
    """
    env = {**base, **spec.env}
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(index) for index in spec.gpu_indexes)
    # Its log lines reach the file as they are written, not when a buffer fills.
    env["PYTHONUNBUFFERED"] = "1"
    # The labels go on the command line; a variable from the agent's own environment would clash with them.
    env.pop("FLOTILLA_LABELS", None)
    return env
