"""Loading and unloading a model's LoRA adapters on a pipeline, at run time. Each action runs in one transaction,
writes an audit entry and bumps the pipeline's ``adapter_generation``.

A pipeline's workers are told the new set by the reconciler (``Reconciler.send_adapter_sets``: a SetAdapters
task to each node running them, on every pass, since it is idempotent); their agents download the adapters and
write the pipeline's adapter file, which the workers watch. A pipeline's first load also rolls its vLLM, SGLang
and TensorRT-LLM worker groups over (their generation is bumped): those engines must be started with LoRA enabled,
which a worker started before its pipeline had adapters was not. llama.cpp and mocker workers always get the
file (``LORA_AT_NO_COST_ENGINES``) and take a first adapter without a restart.

What may be loaded: an adapter of the pipeline's own model, not loaded on another pipeline (its name is served
once), on a pipeline whose every group runs an engine that takes adapters (``LORA_ENGINES``), no more at once
than that engine holds (``max_loras``).
"""

from typing import Any

from django.db import transaction
from django.db.models import F

from controlplane.audit.records import Actor, record
from controlplane.catalog.models import Adapter
from controlplane.deployments import served_names
from controlplane.deployments.models import Pipeline, WorkerGroup
from controlplane.deployments.pipelines import pipeline_snapshot
from controlplane.errors import Conflict, Invalid
from controlplane.reconcile_requests import request_reconcile
from runtime.fleet_contract.engine_names import LORA_AT_NO_COST_ENGINES, LORA_ENGINES

#: How many adapters an engine holds at once when its engine args do not say: vLLM's ``max_loras`` default (1),
#: the mocker's (4), SGLang's ``max_loras_per_batch`` (8), TensorRT-LLM's LoRA cache (4), llama.cpp's (8).
DEFAULT_MAX_LORAS = {"vllm": 1, "mocker": 4, "sglang": 8, "trtllm": 4, "llamacpp": 8}
#: The engine-args keys that set it: SGLang's own name, and every other engine's.
_MAX_LORAS_KEYS = {"sglang": "max_loras_per_batch"}
_DEFAULT_KEY = "max_loras"


def max_loras(engine: str, engine_args: dict[str, Any]) -> int:
    """How many adapters a worker of ``engine`` started with ``engine_args`` (its model's defaults with its group's
    laid over them) holds at once: ``max_loras`` (SGLang: ``max_loras_per_batch``) as a setting, or as the flag
    ``--max-loras``, else the engine's default. Raises Invalid for a value that is not a positive integer."""
    key = _MAX_LORAS_KEYS.get(engine, _DEFAULT_KEY)
    flag = "--" + key.replace("_", "-")
    for name in (flag, key, key.replace("_", "-")):
        if name in engine_args:
            value = engine_args[name]
            if type(value) is str and value.isdigit():
                value = int(value)
            if type(value) is not int or value < 1:
                raise Invalid(f"the engine args' {name} is {value!r}, not a positive whole number", field="adapter")
            return value
    return DEFAULT_MAX_LORAS[engine]


def pipeline_max_loras(pipeline: Pipeline) -> int:
    """The adapters a pipeline may have loaded: the smallest of its groups' ``max_loras``. Raises Invalid, naming
    the engines that do take adapters, when a group's engine takes none."""
    limits = []
    for group in pipeline.groups.all():
        if group.engine not in LORA_ENGINES:
            takers = ", ".join(sorted(LORA_ENGINES))
            raise Invalid(
                f"pipeline {pipeline.name}'s {group.role} group runs {group.engine}, which loads no LoRA adapters "
                f"(the engines that do: {takers})",
                field="adapter",
            )
        limits.append(max_loras(group.engine, {**pipeline.model.default_engine_args, **group.engine_args}))
    return min(limits, default=0)


@transaction.atomic
def load_adapter(actor: Actor, pipeline: Pipeline, name: str) -> Adapter:
    """Load the adapter ``name`` of the pipeline's model on it. Raises Invalid (naming ``adapter``) for an unknown
    adapter, another model's, an engine that takes none or one that holds no more; Conflict when it is loaded
    already, here or on another pipeline."""
    pipeline = Pipeline.objects.select_for_update().select_related("model").get(pk=pipeline.pk)
    adapter = _adapter(pipeline, name)
    loaded = list(pipeline.adapters.order_by("name"))
    if adapter in loaded:
        raise Conflict(f"adapter {adapter.name!r} is loaded on pipeline {pipeline.name} already")
    elsewhere = adapter.pipelines.exclude(pk=pipeline.pk).values_list("name", flat=True).first()
    if elsewhere is not None:
        raise Conflict(
            f"adapter {adapter.name!r} is loaded on pipeline {elsewhere}: its name is served by one pipeline at a "
            "time; unload it there first"
        )
    limit = pipeline_max_loras(pipeline)
    if len(loaded) >= limit:
        shown = ", ".join(a.name for a in loaded)
        raise Invalid(
            f"pipeline {pipeline.name}'s engine holds {limit} adapter(s) at once and has {len(loaded)} loaded "
            f"({shown}): unload one, or raise max_loras in its engine args",
            field="adapter",
        )
    before = pipeline_snapshot(pipeline)
    first = pipeline.adapter_generation == 0
    pipeline.adapters.add(adapter)
    _next_generation(pipeline)
    if first:
        # Its vLLM, SGLang and TensorRT-LLM workers were started without LoRA (and without an adapter file):
        # replaced one at a time, the new ones get both. Those of the engines that take adapters at no cost were
        # given the file at their start, and load the first one as they run.
        WorkerGroup.objects.filter(pipeline=pipeline).exclude(engine__in=LORA_AT_NO_COST_ENGINES).update(
            generation=F("generation") + 1
        )
    record(actor, "pipeline.load_adapter", pipeline, before=before, after=pipeline_snapshot(pipeline))
    served_names.publish_after_commit(pipeline)
    request_reconcile()
    return adapter


@transaction.atomic
def unload_adapter(actor: Actor, pipeline: Pipeline, name: str) -> Adapter:
    """Unload the adapter ``name`` from the pipeline. Raises Invalid (naming ``adapter``) when it has none of
    that name loaded."""
    pipeline = Pipeline.objects.select_for_update().select_related("model").get(pk=pipeline.pk)
    adapter = pipeline.adapters.filter(name=name).first()
    if adapter is None:
        loaded = ", ".join(pipeline.adapters.order_by("name").values_list("name", flat=True)) or "none"
        raise Invalid(f"pipeline {pipeline.name} has no adapter {name!r} loaded (loaded: {loaded})", field="adapter")
    before = pipeline_snapshot(pipeline)
    pipeline.adapters.remove(adapter)
    _next_generation(pipeline)
    record(actor, "pipeline.unload_adapter", pipeline, before=before, after=pipeline_snapshot(pipeline))
    served_names.withdraw_after_commit(adapter.name)
    request_reconcile()
    return adapter


def _adapter(pipeline: Pipeline, name: str) -> Adapter:
    """The adapter ``name`` of the pipeline's model. Raises Invalid saying what there is instead."""
    adapter = Adapter.objects.select_related("model").filter(name=name).first()
    if adapter is None:
        known = ", ".join(pipeline.model.adapters.values_list("name", flat=True)) or "none"
        raise Invalid(
            f"model {pipeline.model.name} has no adapter named {name!r} (its adapters: {known})", field="adapter"
        )
    if adapter.model_id != pipeline.model_id:
        raise Invalid(
            f"adapter {adapter.name!r} adapts model {adapter.model.name}, and pipeline {pipeline.name} serves "
            f"model {pipeline.model.name}",
            field="adapter",
        )
    return adapter


def _next_generation(pipeline: Pipeline) -> None:
    Pipeline.objects.filter(pk=pipeline.pk).update(adapter_generation=F("adapter_generation") + 1)
    pipeline.refresh_from_db(fields=["adapter_generation"])
