"""The ``flotilla run`` command line and environment of an instance's worker (a ``runtime.fleet_tasks.WorkerSpec``).

A worker is ``flotilla run in=dyn://<pipeline>.<component>.<endpoint> out=<engine> [MODEL] [engine args]
--labels pipeline=…,group=…,replica=…,node=…,instance=…``: the labels go into its etcd registration,
which is how the agent (readiness) and the gateway tell whose instance it is.
"""

import sys
from collections.abc import Mapping, Sequence

from runtime.endpoint import format_labels
from runtime.fleet_tasks import WorkerSpec

#: How the agent starts ``flotilla``: the launcher of this very installation, whatever PATH says.
DEFAULT_COMMAND = (sys.executable, "-m", "launcher.cli")


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
    if (router := spec.router) is not None:
        # Registered with the model: gateways route the pipeline so, whatever their own flags say.
        argv += [
            "--router-mode", router.mode,
            "--kv-overlap-score-weight", repr(router.overlap_score_weight),
            "--kv-queued-prefill-weight", repr(router.queued_prefill_weight),
            "--router-temperature", repr(router.temperature),
            "--use-kv-events", "true" if router.use_kv_events else "false",
        ]  # fmt: skip
    argv += ["--labels", format_labels(worker_labels(spec, node))]
    return argv


def worker_env(spec: WorkerSpec, base: Mapping[str, str]) -> dict[str, str]:
    """The worker's environment: ``base``, the spec's variables, and its GPUs in ``CUDA_VISIBLE_DEVICES``.

    A worker with no GPUs gets an empty ``CUDA_VISIBLE_DEVICES``, so that it cannot take one it was not given.
    """
    env = dict(base)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(index) for index in spec.gpu_indexes)
    # Its log lines reach the file as they are written, not when a buffer fills.
    env["PYTHONUNBUFFERED"] = "1"
    # The labels go on the command line; a variable from the agent's own environment would clash with them.
    env.pop("FLOTILLA_LABELS", None)
    return env
