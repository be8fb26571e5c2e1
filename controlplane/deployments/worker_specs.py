"""What an agent is told to run: an instance as ``runtime.fleet_contract.tasks`` messages (one query: its GPUs' UUIDs).

``start_message(instance)`` builds the StartInstance of a placed instance: the pipeline's namespace and
served name, the group's role, engine and GPUs, the engine args (the model's defaults with the group's
laid over them, with the engine's own settings for the pipeline's host KV tier (``kv_tiers``), as
``flotilla run`` flags; for a GPU engine, the memory share it was placed by as
``--gpu-memory-utilization``, and for vLLM its GPU count as ``--tensor-parallel-size``), the pipeline's
router settings, and where the model's files come from.
``attempt`` is the instance's restart count, so an agent can tell a restart from a repeat.
"""

import json
import math
from collections.abc import Mapping
from typing import Any

from controlplane.catalog.engines import PROJECTOR_ENGINE
from controlplane.catalog.models import Adapter, LanguageModel
from controlplane.deployments.kv_tiers import host_tier_args
from controlplane.deployments.models import Instance, Pipeline
from controlplane.fleet.models import Gpu
from runtime.cluster.addressing import DEFAULT_ENDPOINT
from runtime.fleet_contract.engine_names import ENGINES_WITHOUT_FILES, GPU_ONLY_ENGINES, SETTINGS_FILE_ENGINES
from runtime.fleet_contract.router_settings import PipelineRouter
from runtime.fleet_contract.tasks import (
    AdapterSource,
    HubSource,
    LocalSource,
    ModelSource,
    SetAdapters,
    StartInstance,
    StopInstance,
    WorkerSpec,
)

SETTINGS_FLAG = "--extra-engine-args"
MEMORY_SHARE_FLAG = "--gpu-memory-utilization"
#: Engines split over a replica's GPUs by this flag (``flotilla run``'s), and the flag.
TENSOR_PARALLEL_FLAGS = {"vllm": "--tensor-parallel-size"}


def start_message(instance: Instance) -> StartInstance:
    """The StartInstance of a placed instance. Raises ValueError when it is not placed on a node,
    HostTierRefused when its engine args (its model's defaults changed since deploy) cannot size its host tier."""
    if instance.node is None:
        raise ValueError(f"instance {instance.pk} is not placed on a node")
    pipeline, group = instance.pipeline, instance.group
    model = pipeline.model
    gpus = instance_gpus(instance)
    memory_per_gpu = gpu_memory_bytes(model.memory_bytes, group.gpus_per_replica)
    engine_args = merged_engine_args(instance)
    engine_args.update(host_tier_args(group.engine, engine_args, pipeline.kv_host_cache_gib, group.gpus_per_replica))
    if group.engine in GPU_ONLY_ENGINES and MEMORY_SHARE_FLAG not in engine_args:
        # The engine takes what it was placed by, not its own default (vLLM's 0.9 of the GPU): else a second
        # replica placed on the same GPU "as long as memory lasts" would find none left.
        share = gpu_memory_share(memory_per_gpu, [total for _, total in gpus])
        if share is not None:
            engine_args[MEMORY_SHARE_FLAG] = share
    tensor_parallel = TENSOR_PARALLEL_FLAGS.get(group.engine)
    if tensor_parallel is not None and group.gpus_per_replica > 1 and tensor_parallel not in engine_args:
        # The engine is given all the replica's GPUs (CUDA_VISIBLE_DEVICES); without this it would use one.
        engine_args[tensor_parallel] = group.gpus_per_replica
    spec = WorkerSpec(
        instance_id=instance.pk,
        pipeline=pipeline.namespace,
        group=group.role,
        replica=instance.replica,
        engine=group.engine,
        model_name=pipeline.name,
        component=group.component,
        endpoint=DEFAULT_ENDPOINT,
        engine_args=engine_argv(group.engine, engine_args),
        gpu_indexes=[int(index) for index in instance.gpu_indexes],
        # By UUID only when the node reported every one (the agent falls back to indexes).
        gpu_uuids=uuids if all(uuids := [uuid for uuid, _ in gpus]) else [],
        gpu_memory_bytes=memory_per_gpu,
        labels={"model": model.name},
        router=PipelineRouter(
            mode=pipeline.router_mode,
            overlap_score_weight=pipeline.kv_overlap_score_weight,
            queued_prefill_weight=pipeline.kv_queued_prefill_weight,
            temperature=pipeline.router_temperature,
            use_kv_events=pipeline.use_kv_events,
            host_hit_weight=pipeline.kv_host_hit_weight,
            disk_hit_weight=pipeline.kv_disk_hit_weight,
            disagg_policy=pipeline.disagg_policy,
            disagg_isl_threshold=pipeline.disagg_isl_threshold,
            disagg_isl_ratio=pipeline.disagg_isl_ratio,
            disagg_prefill_busy=pipeline.disagg_prefill_busy,
            disagg_decode_busy=pipeline.disagg_decode_busy,
            generation=pipeline.router_generation,
        ),
        adapters=adapter_sources(pipeline),
        adapter_generation=pipeline.adapter_generation,
        pipeline_id=pipeline.pk,
    )
    source = None if group.engine in ENGINES_WITHOUT_FILES else model_source(model)
    return StartInstance(
        spec=spec,
        source=source,
        projector=projector_source(model) if group.engine == PROJECTOR_ENGINE else None,
        attempt=instance.restarts,
        incarnation=instance.incarnation,
        node=instance.node.name,
    )


def merged_engine_args(instance: Instance) -> dict[str, Any]:
    """The instance's engine args: its model's defaults with its group's laid over them."""
    return {**instance.pipeline.model.default_engine_args, **instance.group.engine_args}


def instance_gpus(instance: Instance) -> list[tuple[str, int]]:
    """The UUID ("" when its node did not report one) and total memory (0: unknown) of each of the instance's
    GPUs, in the order of its indexes."""
    indexes = [int(index) for index in instance.gpu_indexes]
    rows = Gpu.objects.filter(node_id=instance.node_id, index__in=indexes)
    known = {index: (uuid, total) for index, uuid, total in rows.values_list("index", "uuid", "memory_total_bytes")}
    return [known.get(index, ("", 0)) for index in indexes]


def gpu_memory_share(memory_bytes_per_gpu: int, gpu_totals: list[int]) -> float | None:
    """The share of each GPU a replica was placed by: its memory on each GPU over the smallest GPU's, rounded
    up to a thousandth (never less than placed), at most 1; None when either is unknown."""
    if memory_bytes_per_gpu <= 0 or not gpu_totals or min(gpu_totals) <= 0:
        return None
    return min(math.ceil(memory_bytes_per_gpu * 1000 / min(gpu_totals)) / 1000, 1.0)


def stop_message(instance: Instance, *, grace_s: float) -> StopInstance:
    """The StopInstance of a stopping instance: its node, its reason, the seconds it has to drain, and the
    start it stops (its attempt and incarnation: an agent leaves a newer worker alone)."""
    node = instance.node.name if instance.node is not None else ""
    return StopInstance(
        instance_id=instance.pk,
        reason=instance.reason,
        grace_s=grace_s,
        node=node,
        attempt=instance.restarts,
        incarnation=instance.incarnation,
    )


def adapter_sources(pipeline: Pipeline) -> list[AdapterSource]:
    """The LoRA adapters loaded on ``pipeline``, each with where a node gets its files, by name."""
    return [AdapterSource(name=adapter.name, source=adapter_source(adapter)) for adapter in pipeline.adapters.all()]


def adapters_message(pipeline: Pipeline, node: str) -> SetAdapters:
    """The SetAdapters task telling node ``node``'s agent the pipeline's adapter set now."""
    return SetAdapters(
        pipeline=pipeline.namespace,
        pipeline_id=pipeline.pk,
        adapters=adapter_sources(pipeline),
        generation=pipeline.adapter_generation,
        node=node,
    )


def adapter_source(adapter: Adapter) -> ModelSource:
    """Where a node gets an adapter's files: as a model's (``model_source``)."""
    if adapter.source_kind == LanguageModel.SourceKind.HUGGING_FACE:
        return HubSource(repo_id=adapter.source, revision=adapter.revision or "main", file=adapter.filename or None)
    return LocalSource(path=adapter.source)


def model_source(model: LanguageModel) -> ModelSource:
    """Where a node gets the model's files: a Hugging Face repo at a revision, or a path on the node."""
    if model.source_kind == LanguageModel.SourceKind.HUGGING_FACE:
        return HubSource(repo_id=model.source, revision=model.revision or "main", file=model.filename or None)
    return LocalSource(path=model.source)


def projector_source(model: LanguageModel) -> ModelSource | None:
    """Where a node gets the model's multimodal projector (llama.cpp's mmproj): a file of the model's repo at its
    revision, or a path on the node; None when the model has none."""
    if not model.projector:
        return None
    if model.source_kind == LanguageModel.SourceKind.HUGGING_FACE:
        return HubSource(repo_id=model.source, revision=model.revision or "main", file=model.projector)
    return LocalSource(path=model.projector)


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
