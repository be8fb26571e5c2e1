"""What an agent is told to run: an instance as ``runtime.fleet_tasks`` messages (one query: its GPUs' UUIDs).

``start_message(instance)`` builds the StartInstance of a placed instance: the pipeline's namespace and
served name, the group's role, engine and GPUs, the engine args (the model's defaults with the group's
laid over them, as ``flotilla run`` flags), the pipeline's router settings, and where the model's files
come from. ``attempt`` is the instance's restart count, so an agent can tell a restart from a repeat.
"""

import json
import math
from collections.abc import Mapping
from typing import Any

from controlplane.catalog.models import LanguageModel
from controlplane.deployments.models import Instance
from controlplane.fleet.models import Gpu
from runtime.addressing import DEFAULT_ENDPOINT
from runtime.engine_names import ENGINES_WITHOUT_FILES, SETTINGS_FILE_ENGINES
from runtime.fleet_tasks import (
    HubSource,
    LocalSource,
    ModelSource,
    StartInstance,
    StopInstance,
    WorkerSpec,
)
from runtime.router_settings import PipelineRouter

SETTINGS_FLAG = "--extra-engine-args"


def start_message(instance: Instance) -> StartInstance:
    """The StartInstance of a placed instance. Raises ValueError when it is not placed on a node."""
    if instance.node is None:
        raise ValueError(f"instance {instance.pk} is not placed on a node")
    pipeline, group = instance.pipeline, instance.group
    model = pipeline.model
    spec = WorkerSpec(
        instance_id=instance.pk,
        pipeline=pipeline.namespace,
        group=group.role,
        replica=instance.replica,
        engine=group.engine,
        model_name=pipeline.name,
        component=group.component,
        endpoint=DEFAULT_ENDPOINT,
        engine_args=engine_argv(group.engine, merged_engine_args(instance)),
        gpu_indexes=[int(index) for index in instance.gpu_indexes],
        gpu_uuids=gpu_uuids(instance),
        gpu_memory_bytes=gpu_memory_bytes(model.memory_bytes, group.gpus_per_replica),
        labels={"model": model.name},
        router=PipelineRouter(
            mode=pipeline.router_mode,
            overlap_score_weight=pipeline.kv_overlap_score_weight,
            queued_prefill_weight=pipeline.kv_queued_prefill_weight,
            temperature=pipeline.router_temperature,
            use_kv_events=pipeline.use_kv_events,
            generation=pipeline.router_generation,
        ),
    )
    source = None if group.engine in ENGINES_WITHOUT_FILES else model_source(model)
    return StartInstance(spec=spec, source=source, attempt=instance.restarts, node=instance.node.name)


def merged_engine_args(instance: Instance) -> dict[str, Any]:
    """The instance's engine args: its model's defaults with its group's laid over them."""
    return {**instance.pipeline.model.default_engine_args, **instance.group.engine_args}


def gpu_uuids(instance: Instance) -> list[str]:
    """The UUIDs of the instance's GPUs in the order of its indexes; [] unless its node reported all of them."""
    indexes = [int(index) for index in instance.gpu_indexes]
    known = dict(Gpu.objects.filter(node_id=instance.node_id, index__in=indexes).values_list("index", "uuid"))
    uuids = [known.get(index, "") for index in indexes]
    return uuids if all(uuids) else []


def stop_message(instance: Instance, *, grace_s: float) -> StopInstance:
    """The StopInstance of a stopping instance: its node, its reason, and the seconds it has to drain."""
    node = instance.node.name if instance.node is not None else ""
    return StopInstance(instance_id=instance.pk, reason=instance.reason, grace_s=grace_s, node=node)


def model_source(model: LanguageModel) -> ModelSource:
    """Where a node gets the model's files: a Hugging Face repo at a revision, or a path on the node."""
    if model.source_kind == LanguageModel.SourceKind.HUGGING_FACE:
        return HubSource(repo_id=model.source, revision=model.revision or "main", file=model.filename or None)
    return LocalSource(path=model.source)


def gpu_memory_bytes(memory_bytes: int | None, gpus: int) -> int:
    """What a replica needs on each of its ``gpus`` GPUs (0 when unknown or on CPU)."""
    if not memory_bytes or gpus <= 0:
        return 0
    return math.ceil(memory_bytes / gpus)


def engine_argv(engine: str, args: Mapping[str, Any]) -> list[str]:
    """Engine args (a JSON object) as ``flotilla run`` arguments, in the object's order.

    * A key that starts with ``--`` is a flag of ``flotilla run`` itself: ``{"--context-length": 4096}``
      gives ``--context-length 4096``; ``true`` gives the bare flag, ``false`` and ``null`` leave it out.
    * The other keys are the engine's own settings. An engine configured by a JSON object (the mocker,
      with Dynamo's key names: ``{"speedup_ratio": 10}``) gets them all as one ``--extra-engine-args``
      JSON argument; any other engine gets each as a flag (``threads`` → ``--threads``).
    """
    argv: list[str] = []
    settings: dict[str, Any] = {}
    for key, value in args.items():
        if key.startswith("--"):
            argv += _flag(key, value)
        elif engine in SETTINGS_FILE_ENGINES:
            settings[key] = value
        else:
            argv += _flag("--" + key.replace("_", "-"), value)
    if settings:
        argv += [SETTINGS_FLAG, json.dumps(settings, separators=(",", ":"), sort_keys=True)]
    return argv


def _flag(flag: str, value: Any) -> list[str]:
    if value is None or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, dict | list):
        return [flag, json.dumps(value, separators=(",", ":"))]
    return [flag, str(value)]
