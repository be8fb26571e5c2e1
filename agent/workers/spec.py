"""An instance's worker: its ``flotilla run`` command line and environment (``fleet_contract.tasks.WorkerSpec``).

A worker is ``flotilla run in=dyn://<pipeline>.<component>.<endpoint> out=<engine> [MODEL] [engine args]
--labels pipeline=…,group=…,replica=…,node=…,instance=…``: the labels go into its etcd registration,
which is how the agent (readiness) and the gateway tell whose instance it is.

Its environment is not the agent's: the agent holds what speaks for the whole node or fleet (the broker's
URL and password, its token, ``HF_TOKEN``), and an engine runs a model's code and its users' prompts. So a
worker gets only the variables it needs to run and serve (``allowed_environment``: an allowlist, so that a
secret added to the agent's environment later does not leak by default), its GPUs, its own instance's worker
key (runtime/fleet_contract/worker_keys.py: what lets it tell the control plane's fences from forged ones and
sign its liveness), and nothing from a task.
"""

import re
import sys
from collections.abc import Mapping, Sequence

from runtime.endpoint import format_labels
from runtime.fleet_contract.signing import SigningKey
from runtime.fleet_contract.tasks import WorkerSpec
from runtime.fleet_contract.worker_keys import WORKER_KEY_VARIABLE, encode, worker_key

#: How the agent starts ``flotilla``: the launcher of this very installation, whatever PATH says.
DEFAULT_COMMAND = (sys.executable, "-m", "launcher.cli")

#: The agent's variables a worker inherits. To run: the search path, home, locale, time zone, temporary
#: files, the CUDA libraries' path, the TLS trust store (a tls:// NATS), Python's own settings. To serve:
#: etcd and NATS (each may come from ``NAME_FILE``, as every setting may), and the serving path's settings
#: the worker reads (runtime/settings.py, FLOTILLA_LOG, the echo engines' delay). Nothing else: not the
#: broker (FLOTILLA_BROKER_URL: with it a worker could send any node any task), not the agent token or its
#: file (it speaks for the node to the control plane), not HF_TOKEN (the download runs in the agent and is
#: the only step that needs it), not the flags of ``flotilla run`` (a worker's come from its task).
#: To run an engine: the settings its libraries read from the environment (ENGINE_VARIABLES), so that a
#: node's operator tunes them once, in the agent's environment file, as for the engines' own servers.
WORKER_VARIABLES = re.compile(
    r"PATH|HOME|USER|LOGNAME|LANG|LANGUAGE|LC_[A-Z]+|TZ|TMPDIR|LD_LIBRARY_PATH|SSL_CERT_(FILE|DIR)|PYTHON[A-Z]+"
    r"|(ETCD_ENDPOINTS|NATS_SERVER)(_FILE)?"
    r"|FLOTILLA_(LOG|DRAIN_S|LEASE_TTL|MAX_REQUEST_BYTES|STREAM_SILENCE_S|STREAM_HEARTBEAT_S|TOKEN_ECHO_DELAY_MS)"
)
#: The engines' own settings: vLLM's (VLLM_CPU_KVCACHE_SPACE sizes a CPU node's KV cache), SGLang's,
#: TensorRT-LLM's, NCCL's and CUDA's (but CUDA_VISIBLE_DEVICES, which the worker's GPUs set), PyTorch's,
#: the thread counts of OpenMP and the math libraries, and Hugging Face's offline switches. One whose
#: name says it holds a secret (VLLM_API_KEY, ..._TOKEN) is not inherited: an engine in a worker serves
#: no HTTP of its own and reads no hub.
ENGINE_VARIABLES = re.compile(
    r"(VLLM|SGLANG|TLLM|TRTLLM|NCCL|CUDA|TORCH|PYTORCH|OMP|MKL|OPENBLAS|MISTRALRS|GGML|LLAMA)_[A-Z0-9_]+"
    r"|(HF_HUB|TRANSFORMERS|HF_DATASETS)_OFFLINE"
)
SECRET_LOOKING = re.compile(r".*(KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL).*")
#: Never a worker's, whatever environment it is given: the agent's credentials and a preloaded library.
NEVER_TO_WORKERS = frozenset(
    {
        "FLOTILLA_BROKER_URL",
        "FLOTILLA_BROKER_URL_FILE",
        "CELERY_BROKER_URL",
        "REDIS_URL",
        "FLOTILLA_AGENT_TOKEN",
        "FLOTILLA_AGENT_TOKEN_FILE",
        "HF_TOKEN",
        "HF_TOKEN_FILE",
        "HUGGING_FACE_HUB_TOKEN",
        "LD_PRELOAD",
        WORKER_KEY_VARIABLE,  # each worker's own, set by worker_env: never one from the agent's environment
    }
)


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
    if spec.projector_path is not None:
        argv += ["--mmproj", spec.projector_path]
    argv += spec.engine_args
    if (router := spec.router) is not None:
        # Registered with the model: gateways route the pipeline so, whatever their own flags say.
        argv += [
            "--router-mode", router.mode,
            "--kv-overlap-score-weight", repr(router.overlap_score_weight),
            "--kv-queued-prefill-weight", repr(router.queued_prefill_weight),
            "--router-temperature", repr(router.temperature),
            "--use-kv-events", "true" if router.use_kv_events else "false",
            "--kv-host-hit-weight", repr(router.host_hit_weight),
            "--kv-disk-hit-weight", repr(router.disk_hit_weight),
            "--disagg-policy", router.disagg_policy,
            "--disagg-isl-threshold", str(router.disagg_isl_threshold),
            "--disagg-isl-ratio", repr(router.disagg_isl_ratio),
            "--disagg-prefill-busy", repr(router.disagg_prefill_busy),
            *([] if (gate := router.disagg_decode_busy) is None else ["--disagg-decode-busy", repr(gate)]),
            "--router-generation", str(router.generation),
        ]  # fmt: skip
    if spec.lora_file is not None:
        # The pipeline's adapters: the worker loads what the file lists, and follows its changes.
        argv += ["--lora-file", spec.lora_file]
    if spec.group in ("prefill", "decode"):
        # Registered with the model: gateways send it only its part of each request.
        argv += ["--disagg-role", spec.group]
    argv += ["--labels", format_labels(worker_labels(spec, node))]
    return argv


def allowed_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` (the agent's) that a worker may inherit: ``WORKER_VARIABLES``, and
    ``ENGINE_VARIABLES`` whose names do not look like a secret's."""
    return {
        name: value
        for name, value in environ.items()
        if WORKER_VARIABLES.fullmatch(name) or (ENGINE_VARIABLES.fullmatch(name) and not SECRET_LOOKING.fullmatch(name))
    }


def _engine_secret(name: str) -> bool:
    """Whether ``name`` is an engine's variable that looks like it holds a secret (never a worker's)."""
    return bool(ENGINE_VARIABLES.fullmatch(name) and SECRET_LOOKING.fullmatch(name))


def worker_env(spec: WorkerSpec, base: Mapping[str, str], node_key: SigningKey | None = None) -> dict[str, str]:
    """The worker's environment: ``base`` (``allowed_environment`` of the agent's) less ``NEVER_TO_WORKERS``
    and the engine variables that look like secrets,
    and its GPUs in ``CUDA_VISIBLE_DEVICES`` (by UUID when the spec has them, else by index), and, given the
    node's task-signing key ``node_key``, its instance's worker key in ``FLOTILLA_WORKER_KEY``.

    A worker with no GPUs gets an empty ``CUDA_VISIBLE_DEVICES``, so that it cannot take one it was not given.
    """
    env = {name: value for name, value in base.items() if name not in NEVER_TO_WORKERS and not _engine_secret(name)}
    # By UUID when the agent checked them (agent/gpu_check.py): no renumbering of the GPUs changes those.
    names = spec.gpu_uuids or [str(index) for index in spec.gpu_indexes]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(names)
    # Indexes are NVML's (the inventory's), which count in PCI bus order; CUDA's own order puts the fastest
    # GPU first, so without this a worker named by index could get a GPU reserved for another.
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    # Its log lines reach the file as they are written, not when a buffer fills.
    env["PYTHONUNBUFFERED"] = "1"
    # The labels go on the command line; a variable from the agent's own environment would clash with them.
    env.pop("FLOTILLA_LABELS", None)
    if node_key is not None:
        env[WORKER_KEY_VARIABLE] = encode(worker_key(node_key, spec.instance_id))
    return env
