"""Changes to pipelines: deploy, update, scale, stop, start, delete.

Each action runs in one transaction and writes audit entries. Actions record desired state (a group's
replica count, the pipeline's running/stopped state) together with the instance rows it implies: new
instances are pending and unplaced; instances no longer wanted are stopping (or stopped when nothing
runs). Each asks for a reconciler pass once it commits (``controlplane.reconcile_requests``), so that
the change reaches the agents at once rather than at the next periodic pass, which places the new
instances and sends their tasks (``upkeep``, run by ``reconciler``).
"""

import math
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import F

from controlplane.audit.records import JSON, Actor, record, snapshot
from controlplane.catalog.engines import DISAGG_ENGINES, GGUF_ONLY_ENGINES, GPU_ONLY_ENGINES
from controlplane.catalog.models import Adapter, LanguageModel
from controlplane.catalog.remote_code import RemoteCodeChange, check_group_change, record_change
from controlplane.deployments import served_names
from controlplane.deployments.instance_states import LIVE_STATES, PROCESS_STATES, InstanceState
from controlplane.deployments.instances import add_instances, stop_instance
from controlplane.deployments.kv_tiers import HostTierRefused, host_tier_args
from controlplane.deployments.models import DisaggPolicy, Instance, Pipeline, WorkerGroup, validate_served_name
from controlplane.errors import Conflict, Invalid
from controlplane.fleet.models import Node
from controlplane.fleet.node_engines import check_engine_runs_somewhere
from controlplane.reconcile_requests import request_reconcile
from planner.errors import SettingsError
from planner.targets_json import targets_from_dict

MAX_REPLICAS = 512
MAX_GPUS_PER_REPLICA = 16
MAX_ROUTER_WEIGHT = 1000.0
MAX_ROUTER_TEMPERATURE = 100.0
# Fields of a pipeline that deploy sets and update may change (name, namespace and model are fixed).
# The settings a pipeline's workers register with their model (as --router-* flags).
ROUTER_FIELDS = frozenset(
    {
        "router_mode",
        "kv_overlap_score_weight",
        "kv_queued_prefill_weight",
        "router_temperature",
        "use_kv_events",
        "kv_host_hit_weight",
        "kv_disk_hit_weight",
        "disagg_policy",
        "disagg_isl_threshold",
        "disagg_isl_ratio",
        "disagg_prefill_busy",
        "disagg_decode_busy",
    }
)
# Settings the pipeline's engines are started with: a change restarts every group's workers (rolling update).
ENGINE_FIELDS = frozenset({"kv_host_cache_gib"})
# The planner's targets: read by the planner's loop each interval, nothing restarts for them.
# The TTFT target: read by the alerts' rule, nothing restarts for it either.
SETTING_FIELDS = (
    ROUTER_FIELDS | ENGINE_FIELDS | {"placement_policy", "pinned_nodes", "pinned_gpus", "planner", "ttft_target_ms"}
)
#: The largest TTFT target a pipeline may set (milliseconds): ten minutes is a typo, not a target.
MAX_TTFT_TARGET_MS = 600_000
#: The largest --disagg-isl-threshold a pipeline may set (tokens), and --disagg-prefill-busy (engine steps).
MAX_ISL_THRESHOLD = 10_000_000
MAX_PREFILL_BUSY = 1000.0
#: The largest host KV tier a replica may ask for, in GiB: a big 8-GPU server's whole memory (4 TiB). Beyond
#: it a value is a typo (bytes for GiB), not a plan; placement still checks the node's free memory.
MAX_HOST_CACHE_GIB = 4096.0
_VALID_ROLE_SETS = ({WorkerGroup.Role.AGGREGATED}, {WorkerGroup.Role.PREFILL, WorkerGroup.Role.DECODE})
_NAMESPACE_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
# Scaling down stops the instances that got least far first, the newest first among equals.
_STOP_ORDER = {
    InstanceState.PENDING: 0,
    InstanceState.FAILED: 1,
    InstanceState.DOWNLOADING: 2,
    InstanceState.STARTING: 3,
    InstanceState.READY: 4,
}


@dataclass(frozen=True)
class GroupSpec:
    """One worker group as deploy takes it; ``engine`` None means the model's engine."""

    role: str = WorkerGroup.Role.AGGREGATED
    replicas: int = 1
    gpus_per_replica: int = 0
    engine: str | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)


def pipeline_snapshot(pipeline: Pipeline) -> JSON:
    """The pipeline's fields and its groups, for audit entries."""
    values = snapshot(pipeline, exclude=("updated_at",))
    values["groups"] = [snapshot(group) for group in pipeline.groups.order_by("role")]
    values["adapters"] = list(pipeline.adapters.order_by("name").values_list("name", flat=True))
    return values


@transaction.atomic
def deploy_pipeline(
    actor: Actor,
    *,
    name: str,
    model: LanguageModel,
    groups: Sequence[GroupSpec],
    namespace: str | None = None,
    **settings: Any,
) -> Pipeline:
    """Create a running pipeline with its worker groups and their (pending, unplaced) instances.

    Raises Invalid naming the field (groups, pins, router settings, namespace), Conflict when the name or
    the namespace is taken, Forbidden when a group's engine args trust remote code and ``actor`` may not allow
    that (catalog/remote_code.py).
    """
    _check_served_name(name)
    if (taken := served_name_taken(name)) is not None:
        raise Conflict(served_name_taken_message(name, taken))
    _check_settings(settings)
    _check_groups(model, groups, settings.get("pinned_gpus") or [])
    remote_code = {
        spec.role: check_group_change(actor, before=None, after=spec.engine_args, role=spec.role) for spec in groups
    }
    _check_host_tier(model, groups, settings.get("kv_host_cache_gib"), field="kv_host_cache_gib")
    for spec in groups:  # at deploy only: a group deployed before its node went keeps its engine
        check_engine_runs_somewhere(spec.engine or model.engine, f"the {spec.role} group", field="groups")
    if namespace is None:
        namespace = _free_namespace(name)
    elif Pipeline.objects.filter(namespace=namespace).exists():
        raise Conflict(f"namespace {namespace!r} belongs to another pipeline")
    pipeline = Pipeline(name=name, namespace=namespace, model=model, **settings)
    try:
        with transaction.atomic():  # a savepoint, so that what clashed can be read after a concurrent deploy
            pipeline.save()
    except IntegrityError as exc:
        raise Conflict(_clash_after_race(name, namespace)) from exc
    for spec in groups:
        group = WorkerGroup.objects.create(
            pipeline=pipeline,
            role=spec.role,
            engine=spec.engine or model.engine,
            replicas=spec.replicas,
            gpus_per_replica=spec.gpus_per_replica,
            engine_args=spec.engine_args,
        )
        add_instances(actor, group, spec.replicas)
    record(actor, "pipeline.deploy", pipeline, before=None, after=pipeline_snapshot(pipeline))
    for role, change in remote_code.items():
        _record_remote_code(actor, pipeline, change, role)
    served_names.publish_after_commit(pipeline)
    request_reconcile()
    return pipeline


@transaction.atomic
def update_pipeline(actor: Actor, pipeline: Pipeline, **changes: Any) -> Pipeline:
    """Change router settings, the host KV tier, placement policy or pins. Running instances stay where they
    are, but for a change of router settings, which its workers register, or of the host tier, which its
    engines are started with: that one rolls out to them, one at a time, each replacement ready before the
    instance it replaces stops (``roll_out_updates``).

    Raises Invalid naming the field.
    """
    _check_settings(changes)
    pipeline = Pipeline.objects.select_for_update().select_related("model").get(pk=pipeline.pk)
    if "pinned_gpus" in changes:
        _check_pinned_gpus(changes["pinned_gpus"], pipeline.groups.all())
    if "kv_host_cache_gib" in changes:
        _check_host_tier(
            pipeline.model, _group_specs(pipeline), changes["kv_host_cache_gib"], field="kv_host_cache_gib"
        )
    before = pipeline_snapshot(pipeline)
    changed = {name for name, value in changes.items() if getattr(pipeline, name) != value}
    for name, value in changes.items():
        setattr(pipeline, name, value)
    if changed & ROUTER_FIELDS:
        pipeline.router_generation += 1
    if changed & (ROUTER_FIELDS | ENGINE_FIELDS):
        pipeline.groups.update(generation=F("generation") + 1)
    pipeline.save()
    record(actor, "pipeline.update", pipeline, before=before, after=pipeline_snapshot(pipeline))
    request_reconcile()  # new pins or policy may let waiting instances be placed, new settings roll out
    return pipeline


@transaction.atomic
def update_group(
    actor: Actor,
    pipeline: Pipeline,
    role: str | None = None,
    *,
    engine_args: dict[str, Any] | None = None,
    gpus_per_replica: int | None = None,
) -> WorkerGroup:
    """Change a worker group's engine args or GPUs per replica. A change bumps the group's generation, and
    the reconciler replaces its instances one at a time (``roll_out_updates``). Raises Invalid naming the
    field, Conflict when nothing would change, Forbidden when the new engine args turn remote code on and
    ``actor`` may not allow that (catalog/remote_code.py).
    """
    pipeline = Pipeline.objects.select_for_update().select_related("model").get(pk=pipeline.pk)
    group = _group(pipeline, role)
    changes: dict[str, Any] = {}
    remote_code = RemoteCodeChange(was=False, now=False)
    if engine_args is not None and engine_args != group.engine_args:
        changes["engine_args"] = engine_args
        remote_code = check_group_change(actor, before=group.engine_args, after=engine_args, role=group.role)
    if gpus_per_replica is not None and gpus_per_replica != group.gpus_per_replica:
        changes["gpus_per_replica"] = gpus_per_replica
    if not changes:
        raise Conflict(f"the {group.role} group of pipeline {pipeline.name} has these settings already")
    spec = GroupSpec(
        role=group.role,
        replicas=group.replicas,
        gpus_per_replica=changes.get("gpus_per_replica", group.gpus_per_replica),
        engine=group.engine,
        engine_args=changes.get("engine_args", group.engine_args),
    )
    others = [
        GroupSpec(role=g.role, replicas=g.replicas, gpus_per_replica=g.gpus_per_replica, engine=g.engine)
        for g in pipeline.groups.exclude(pk=group.pk)
    ]
    _check_groups(pipeline.model, [spec, *others], pipeline.pinned_gpus)
    _check_host_tier(pipeline.model, [spec], pipeline.kv_host_cache_gib, field="engine_args")
    before = pipeline_snapshot(pipeline)
    WorkerGroup.objects.filter(pk=group.pk).update(**changes, generation=F("generation") + 1)
    group.refresh_from_db()
    record(actor, "pipeline.update_group", pipeline, before=before, after=pipeline_snapshot(pipeline))
    _record_remote_code(actor, pipeline, remote_code, group.role)
    request_reconcile()
    return group


def _record_remote_code(actor: Actor, pipeline: Pipeline, change: RemoteCodeChange, role: str) -> None:
    record_change(actor, pipeline, change, kind="pipeline", where=f"the {role} group's engine_args")


@transaction.atomic
def scale_pipeline(
    actor: Actor,
    pipeline: Pipeline,
    replicas: int,
    role: str | None = None,
    *,
    reason: str = "",
    stop_first: Collection[int] = (),
) -> WorkerGroup:
    """Set a worker group's replica count; a running pipeline gets new pending instances or stops some.

    ``role`` picks the group and may be left out when the pipeline has one. ``reason`` (the planner's,
    say) is kept in the audit entry and on the instances it stops. A scale-down stops those that serve
    nothing yet first, then, among instances in the same state, those whose workers ``stop_first`` names
    (endpoint instance ids: the planner's least busy), then the latest replicas. Raises Invalid naming
    ``replicas`` or ``role``.
    """
    if not 0 <= replicas <= MAX_REPLICAS:
        raise Invalid(f"replicas must be between 0 and {MAX_REPLICAS}", field="replicas")
    pipeline = Pipeline.objects.select_for_update().get(pk=pipeline.pk)
    group = _group(pipeline, role)
    before = pipeline_snapshot(pipeline)
    WorkerGroup.objects.filter(pk=group.pk).update(replicas=replicas)
    group.replicas = replicas
    if pipeline.state == Pipeline.State.RUNNING:
        live = _live_instances(group)
        if len(live) < replicas:
            add_instances(actor, group, replicas - len(live))
        for instance in _to_stop(live, len(live) - replicas, set(stop_first)):
            stop_instance(actor, instance, f"scaled down to {replicas} by {actor.name}{': ' if reason else ''}{reason}")
    after = pipeline_snapshot(pipeline)
    if reason:
        after["reason"] = reason
    record(actor, "pipeline.scale", pipeline, before=before, after=after)
    request_reconcile()
    return group


@transaction.atomic
def stop_pipeline(actor: Actor, pipeline: Pipeline) -> Pipeline:
    """Stop every instance; the replica counts are kept for ``start_pipeline``. Raises Conflict if stopped."""
    pipeline = Pipeline.objects.select_for_update().get(pk=pipeline.pk)
    if pipeline.state == Pipeline.State.STOPPED:
        raise Conflict(f"pipeline {pipeline.name} is stopped already")
    before = pipeline_snapshot(pipeline)
    pipeline.state = Pipeline.State.STOPPED
    pipeline.save(update_fields=["state", "updated_at"])
    for group in pipeline.groups.all():
        for instance in _live_instances(group):
            stop_instance(actor, instance, f"pipeline stopped by {actor.name}")
    record(actor, "pipeline.stop", pipeline, before=before, after=pipeline_snapshot(pipeline))
    served_names.publish_after_commit(pipeline)  # its model is a 503 "no ready replica" now, not a 404
    request_reconcile()
    return pipeline


@transaction.atomic
def start_pipeline(actor: Actor, pipeline: Pipeline) -> Pipeline:
    """Run a stopped pipeline again with its groups' replica counts. Raises Conflict if it is running."""
    pipeline = Pipeline.objects.select_for_update().get(pk=pipeline.pk)
    if pipeline.state == Pipeline.State.RUNNING:
        raise Conflict(f"pipeline {pipeline.name} is running already")
    before = pipeline_snapshot(pipeline)
    pipeline.state = Pipeline.State.RUNNING
    pipeline.save(update_fields=["state", "updated_at"])
    for group in pipeline.groups.all():
        # The replicas it ran when it was stopped start again (the newest rows, some maybe still stopping):
        # their restarts go on counting.
        gone = group.instances.filter(state__in=(InstanceState.STOPPED, InstanceState.STOPPING))
        missing = group.replicas - len(_live_instances(group))
        add_instances(actor, group, missing, succeeds=list(gone.order_by("-replica")[: max(missing, 0)]))
    record(actor, "pipeline.start", pipeline, before=before, after=pipeline_snapshot(pipeline))
    served_names.publish_after_commit(pipeline)
    request_reconcile()
    return pipeline


@transaction.atomic
def delete_pipeline(actor: Actor, pipeline: Pipeline) -> None:
    """Delete a stopped pipeline whose instances have all stopped (their rows go with it).

    Raises Conflict while it runs or while its instances are still stopping.
    """
    pipeline = Pipeline.objects.select_for_update().get(pk=pipeline.pk)
    if pipeline.state != Pipeline.State.STOPPED:
        raise Conflict(f"pipeline {pipeline.name} is running; stop it first")
    stopping = pipeline.instances.filter(state__in=PROCESS_STATES).count()
    if stopping:
        raise Conflict(f"pipeline {pipeline.name} still has {stopping} instance(s) stopping; wait for them")
    record(actor, "pipeline.delete", pipeline, before=pipeline_snapshot(pipeline), after=None)
    served_names.withdraw_after_commit(pipeline.name)
    for adapter in pipeline.adapters.values_list("name", flat=True):
        served_names.withdraw_after_commit(adapter)
    pipeline.delete()


def _group(pipeline: Pipeline, role: str | None) -> WorkerGroup:
    groups = list(pipeline.groups.all())
    if role is None:
        if len(groups) > 1:
            roles = ", ".join(group.role for group in groups)
            raise Invalid(f"pipeline {pipeline.name} has several worker groups ({roles}): say which", field="role")
        return groups[0]
    for group in groups:
        if group.role == role:
            return group
    raise Invalid(f"pipeline {pipeline.name} has no {role} worker group", field="role")


def _live_instances(group: WorkerGroup) -> list[Instance]:
    return list(group.instances.select_related("pipeline", "group").filter(state__in=LIVE_STATES))


def _to_stop(live: list[Instance], count: int, preferred: Collection[int] = ()) -> list[Instance]:
    if count <= 0:
        return []
    ranked = sorted(
        live,
        key=lambda i: (
            _STOP_ORDER[i.state],
            i.endpoint_instance_id not in preferred,
            i.node_id is not None,
            -i.replica,
        ),
    )
    return ranked[:count]


def served_name_taken(name: str) -> str | None:
    """The served name of the pipeline or LoRA adapter that ``name`` collides with: the same name, letter case
    aside (clients would not tell "Chat" from "chat"); None when none has it."""
    taken = Pipeline.objects.filter(name__iexact=name).values_list("name", flat=True).first()
    if taken is None:
        taken = Adapter.objects.filter(name__iexact=name).values_list("name", flat=True).first()
    return taken


def served_name_taken_message(name: str, taken: str) -> str:
    """Why ``name`` is refused, naming the pipeline or adapter whose name ``taken`` it collides with."""
    if Adapter.objects.filter(name=taken).exists():
        return f"an adapter in the catalog is served as {taken!r} (served names may not differ only in letter case)"
    if taken == name:
        return f"a pipeline named {name!r} already exists"
    return f"a pipeline named {taken!r} already exists (served names may not differ only in letter case)"


def _clash_after_race(name: str, namespace: str) -> str:
    """What a concurrent deploy took between the checks and the insert: its name or its namespace."""
    if (taken := served_name_taken(name)) is not None:
        return served_name_taken_message(name, taken)
    if Pipeline.objects.filter(namespace=namespace).exists():
        return f"namespace {namespace!r} belongs to another pipeline"
    return f"a pipeline named {name!r} or with namespace {namespace!r} was deployed at the same time; try again"


def _free_namespace(name: str) -> str:
    """A dyn:// namespace for a served name: unsafe characters become '-', and a suffix keeps it unique."""
    base = _NAMESPACE_UNSAFE.sub("-", name).strip("-")[:60] or "pipeline"
    candidate, suffix = base, 2
    while Pipeline.objects.filter(namespace=candidate).exists():
        candidate, suffix = f"{base}-{suffix}", suffix + 1
    return candidate


def _check_settings(settings: dict[str, Any]) -> None:
    unknown = sorted(set(settings) - SETTING_FIELDS)
    if unknown:
        raise Invalid(f"a pipeline has no setting {unknown[0]!r}", field=unknown[0])
    for name in ("kv_host_hit_weight", "kv_disk_hit_weight"):
        credit = settings.get(name)
        if credit is not None and not (_is_number(credit) and 0 <= credit <= 1):
            raise Invalid("must be a number between 0 and 1 (a device hit counts 1)", field=name)
    host_gib = settings.get("kv_host_cache_gib")
    if host_gib is not None and not (_is_number(host_gib) and 0 <= host_gib <= MAX_HOST_CACHE_GIB):
        raise Invalid(
            f"must be a number of GiB from 0 (no host tier) to {MAX_HOST_CACHE_GIB:g}", field="kv_host_cache_gib"
        )
    weight = settings.get("kv_overlap_score_weight")
    if weight is not None and not (math.isfinite(weight) and 0 <= weight <= MAX_ROUTER_WEIGHT):
        raise Invalid(f"must be between 0 and {MAX_ROUTER_WEIGHT:g}", field="kv_overlap_score_weight")
    queued = settings.get("kv_queued_prefill_weight")
    if queued is not None and not (math.isfinite(queued) and 0 <= queued <= 1):
        raise Invalid("must be between 0 and 1", field="kv_queued_prefill_weight")
    temperature = settings.get("router_temperature")
    if temperature is not None and not (math.isfinite(temperature) and 0 <= temperature <= MAX_ROUTER_TEMPERATURE):
        raise Invalid(f"must be between 0 and {MAX_ROUTER_TEMPERATURE:g}", field="router_temperature")
    policy = settings.get("disagg_policy")
    if policy is not None and policy not in DisaggPolicy.values:
        raise Invalid(f"must be one of {', '.join(DisaggPolicy.values)}", field="disagg_policy")
    threshold = settings.get("disagg_isl_threshold")
    if threshold is not None and not (isinstance(threshold, int) and 0 <= threshold <= MAX_ISL_THRESHOLD):
        raise Invalid(f"must be a whole number of tokens from 0 to {MAX_ISL_THRESHOLD}", field="disagg_isl_threshold")
    ratio = settings.get("disagg_isl_ratio")
    if ratio is not None and not (math.isfinite(ratio) and 0 <= ratio <= 1):
        raise Invalid("must be between 0 and 1", field="disagg_isl_ratio")
    busy = settings.get("disagg_prefill_busy")
    if busy is not None and not (math.isfinite(busy) and 0 < busy <= MAX_PREFILL_BUSY):
        raise Invalid(f"must be above 0 and at most {MAX_PREFILL_BUSY:g}", field="disagg_prefill_busy")
    gate = settings.get("disagg_decode_busy")
    if gate is not None and not (math.isfinite(gate) and 0 <= gate <= 1):
        raise Invalid("must be between 0 and 1, or null for no gate", field="disagg_decode_busy")
    if settings.get("planner") is not None:
        check_planner_settings(settings["planner"])
    target = settings.get("ttft_target_ms")
    if target is not None and not (isinstance(target, int) and 1 <= target <= MAX_TTFT_TARGET_MS):
        raise Invalid(
            f"must be a whole number of milliseconds from 1 to {MAX_TTFT_TARGET_MS}, or null for no target",
            field="ttft_target_ms",
        )
    pinned_nodes = settings.get("pinned_nodes")
    if pinned_nodes:
        known = set(Node.objects.filter(name__in=pinned_nodes).values_list("name", flat=True))
        unknown_nodes = [name for name in pinned_nodes if name not in known]
        if unknown_nodes:
            raise Invalid(f"no node is named {unknown_nodes[0]!r}", field="pinned_nodes")


def check_planner_settings(document: Any) -> None:
    """Raise Invalid naming the setting's path (``planner.default.ttft_s``) unless the planner can plan with
    ``document`` (planner/targets_json.py)."""
    try:
        targets_from_dict(document)
    except SettingsError as exc:
        raise Invalid(exc.message, field=f"planner.{exc.field}" if exc.field else "planner") from exc


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_host_tier(model: LanguageModel, groups: Sequence[GroupSpec], host_gib: float | None, *, field: str) -> None:
    """Raise Invalid (naming ``field``) unless every group's engine can keep a host tier of ``host_gib``."""
    for spec in groups:
        engine_args = {**model.default_engine_args, **spec.engine_args}
        try:
            host_tier_args(spec.engine or model.engine, engine_args, host_gib, spec.gpus_per_replica)
        except HostTierRefused as exc:
            raise Invalid(f"the {spec.role} group: {exc}", field=field) from exc


def _group_specs(pipeline: Pipeline) -> list[GroupSpec]:
    return [
        GroupSpec(
            role=g.role,
            replicas=g.replicas,
            gpus_per_replica=g.gpus_per_replica,
            engine=g.engine,
            engine_args=g.engine_args,
        )
        for g in pipeline.groups.all()
    ]


def _check_groups(model: LanguageModel, groups: Sequence[GroupSpec], pinned_gpus: Sequence[int]) -> None:
    if not groups:
        raise Invalid("a pipeline needs at least one worker group", field="groups")
    roles = [spec.role for spec in groups]
    if len(set(roles)) != len(roles) or set(roles) not in _VALID_ROLE_SETS:
        raise Invalid(
            f"worker groups must be one aggregated group, or one prefill and one decode group, not {', '.join(roles)}",
            field="groups",
        )
    for spec in groups:
        engine = spec.engine or model.engine
        where = f"the {spec.role} group"
        if not 0 <= spec.replicas <= MAX_REPLICAS:
            raise Invalid(f"{where}: replicas must be between 0 and {MAX_REPLICAS}", field="groups")
        if not 0 <= spec.gpus_per_replica <= MAX_GPUS_PER_REPLICA:
            raise Invalid(f"{where}: gpus_per_replica must be between 0 and {MAX_GPUS_PER_REPLICA}", field="groups")
        if engine in GPU_ONLY_ENGINES and spec.gpus_per_replica == 0:
            raise Invalid(f"{where}: {engine} runs on GPUs; set gpus_per_replica to 1 or more", field="groups")
        if engine in GGUF_ONLY_ENGINES and not model.is_gguf:
            raise Invalid(f"{where}: {engine} loads GGUF files and model {model.name} is not one", field="groups")
        if spec.role != WorkerGroup.Role.AGGREGATED and engine not in DISAGG_ENGINES:
            raise Invalid(
                f"{where}: {engine} cannot hand a prompt's KV cache between workers yet; engines that can: "
                f"{', '.join(DISAGG_ENGINES)} (or deploy one aggregated group)",
                field="groups",
            )
    _check_pinned_gpus(pinned_gpus, groups)


def _check_pinned_gpus(pinned_gpus: Sequence[int], groups: Sequence[GroupSpec] | Any) -> None:
    if not pinned_gpus:
        return
    needed = max((spec.gpus_per_replica for spec in groups), default=0)
    if len(set(pinned_gpus)) < needed:
        raise Invalid(
            f"{len(set(pinned_gpus))} pinned GPU(s) cannot hold a replica that needs {needed}", field="pinned_gpus"
        )


def _check_served_name(name: str) -> None:
    """The served model name as the field's validator checks it, for every caller. Raises Invalid."""
    try:
        validate_served_name(name)
    except ValidationError as exc:
        raise Invalid(f"{name!r}: {' '.join(exc.messages)}", field="name") from exc
