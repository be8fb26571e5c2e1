"""The pipeline page's edit form: router settings, the host KV tier, placement, and each worker group's
engine args, GPUs per replica and replicas, changed together.

It changes nothing itself: ``submit`` calls the actions the REST API calls (``update_pipeline`` for PATCH,
``update_group`` for ``update-group``, ``scale_pipeline`` for ``scale``), each with only what differs from
the pipeline as it is, in one transaction, so that a refusal of the last leaves the first undone. A change
the workers must restart for bumps their group's generation and the reconciler rolls it out as it does for
the API: one instance at a time, each replacement ready before the instance it replaces stops.
"""

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from django import forms
from django.db import transaction

from controlplane.audit.records import Actor
from controlplane.dashboard.forms import ActionForm, JsonObjectField, PipelineForm
from controlplane.deployments import pipelines as pipeline_actions
from controlplane.deployments.models import DisaggPolicy, Pipeline, WorkerGroup
from controlplane.deployments.pipelines import MAX_GPUS_PER_REPLICA, MAX_REPLICAS, MAX_TTFT_TARGET_MS
from controlplane.errors import Conflict, Forbidden, Invalid
from controlplane.fleet.models import validate_node_name
from runtime.fleet_contract.router_settings import (
    DEFAULT_DISK_HIT_WEIGHT,
    DEFAULT_HOST_HIT_WEIGHT,
    DEFAULT_ISL_RATIO,
    DEFAULT_ISL_THRESHOLD,
    DEFAULT_PREFILL_BUSY,
)

#: As many pins as the API takes (``PlacementSerializer``), and the GPU indexes a node may have.
MAX_PINS = 64
MAX_GPU_INDEX = 63
# The deploy form's fields this form shows too, with the value an empty one stands for, as at deploy (None:
# the field is required, or empty means None).
_ROUTER_FIELDS: dict[str, Any] = {
    "router_mode": None,
    "kv_overlap_score_weight": None,
    "kv_queued_prefill_weight": None,
    "router_temperature": None,
    "use_kv_events": None,
    "kv_host_hit_weight": DEFAULT_HOST_HIT_WEIGHT,
    "kv_disk_hit_weight": DEFAULT_DISK_HIT_WEIGHT,
}
# Only for a pipeline of a prefill and a decode group. An empty decode gate is no gate (None).
_DISAGG_FIELDS: dict[str, Any] = {
    "disagg_policy": DisaggPolicy.ALWAYS,
    "disagg_isl_threshold": DEFAULT_ISL_THRESHOLD,
    "disagg_isl_ratio": DEFAULT_ISL_RATIO,
    "disagg_prefill_busy": DEFAULT_PREFILL_BUSY,
    "disagg_decode_busy": None,
}
_ENGINE_FIELDS: dict[str, Any] = {"kv_host_cache_gib": 0.0}
_PLACEMENT_FIELDS: dict[str, Any] = {"placement_policy": None}
# What an action's Invalid names for a worker group, and the group's field of this form it belongs to
# (``groups``: what update_group checks of the group as a whole; only its GPUs can make that fail here).
_GROUP_FIELDS = {
    "engine_args": "engine_args",
    "gpus_per_replica": "gpus_per_replica",
    "groups": "gpus_per_replica",
    "replicas": "replicas",
}


@dataclass(frozen=True)
class GroupChange:
    """What changes in one worker group (None: that stays)."""

    role: str
    engine_args: dict[str, Any] | None = None
    gpus_per_replica: int | None = None
    replicas: int | None = None


@dataclass(frozen=True)
class Edit:
    """An edit that went through: which settings changed, and whether workers restart for it."""

    changed: list[str]
    rolling: bool


class PinnedNodesField(forms.CharField):
    """Node names separated by commas or spaces (empty: any node)."""

    def to_python(self, value: Any) -> list[str]:  # type: ignore[override]
        names = [name for name in str(super().to_python(value)).replace(",", " ").split() if name]
        for name in names:
            try:
                validate_node_name(name)
            except forms.ValidationError as exc:
                raise forms.ValidationError(f"{name!r}: {' '.join(exc.messages)}") from exc
        if len(set(names)) != len(names):
            raise forms.ValidationError("Name each node once.")
        if len(names) > MAX_PINS:
            raise forms.ValidationError(f"At most {MAX_PINS} nodes.")
        return names


class PinnedGpusField(forms.CharField):
    """GPU indexes separated by commas or spaces (empty: any GPU), sorted."""

    def to_python(self, value: Any) -> list[int]:  # type: ignore[override]
        words = [word for word in str(super().to_python(value)).replace(",", " ").split() if word]
        indexes = []
        for word in words:
            if not word.isdigit() or int(word) > MAX_GPU_INDEX:
                raise forms.ValidationError(f"{word!r} is not a GPU index (0 to {MAX_GPU_INDEX}).")
            indexes.append(int(word))
        if len(set(indexes)) != len(indexes):
            raise forms.ValidationError("Name each GPU index once.")
        if len(indexes) > MAX_PINS:
            raise forms.ValidationError(f"At most {MAX_PINS} GPU indexes.")
        return sorted(indexes)


class PipelineEditForm(ActionForm):
    """Change a deployed pipeline (name, model and engine stay: deploy a new pipeline for those).

    Its fields are the deploy form's router and placement fields, the pins, and three per worker group,
    named ``<role>-engine_args``, ``<role>-gpus_per_replica`` and ``<role>-replicas``.
    """

    def __init__(self, pipeline: Pipeline, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pipeline = pipeline
        self.groups: list[WorkerGroup] = list(pipeline.groups.order_by("role"))
        self.setting_defaults = _ROUTER_FIELDS | _ENGINE_FIELDS | _PLACEMENT_FIELDS
        if len(self.groups) > 1:
            self.setting_defaults |= _DISAGG_FIELDS
        for name in self.setting_defaults:
            self.fields[name] = copy.deepcopy(PipelineForm.base_fields[name])
            self.initial[name] = getattr(pipeline, name)
        self.fields["ttft_target_ms"] = forms.IntegerField(
            required=False,
            min_value=1,
            max_value=MAX_TTFT_TARGET_MS,
            label="TTFT target (ms)",
            help_text="An alert fires while the time to first token (p95) is above it; empty: no target.",
        )
        self.initial["ttft_target_ms"] = pipeline.ttft_target_ms
        self.setting_defaults = self.setting_defaults | {"ttft_target_ms": None}
        self.fields["pinned_nodes"] = PinnedNodesField(
            required=False, label="Pinned nodes", help_text="Node names, comma-separated; empty: any node."
        )
        self.fields["pinned_gpus"] = PinnedGpusField(
            required=False, label="Pinned GPUs", help_text="GPU indexes on each node, comma-separated; empty: any."
        )
        self.initial["pinned_nodes"] = ", ".join(pipeline.pinned_nodes)
        self.initial["pinned_gpus"] = ", ".join(str(index) for index in pipeline.pinned_gpus)
        for group in self.groups:
            workers = f"{group.role.capitalize()} workers"
            self.fields[f"{group.role}-engine_args"] = JsonObjectField(
                label=f"{workers}: engine args (JSON)",
                help_text=f"{group.engine}; laid over the model's default args. A change replaces the workers "
                "one at a time.",
            )
            self.fields[f"{group.role}-gpus_per_replica"] = forms.IntegerField(
                min_value=0,
                max_value=MAX_GPUS_PER_REPLICA,
                label=f"{workers}: GPUs per replica",
                help_text="0 runs on CPU. A change replaces the workers one at a time.",
            )
            self.fields[f"{group.role}-replicas"] = forms.IntegerField(
                min_value=0, max_value=MAX_REPLICAS, label=f"{workers}: replicas"
            )
            self.initial[f"{group.role}-engine_args"] = json.dumps(group.engine_args) if group.engine_args else ""
            self.initial[f"{group.role}-gpus_per_replica"] = group.gpus_per_replica
            self.initial[f"{group.role}-replicas"] = group.replicas

    def submit(self, actor: Actor) -> Edit | None:
        """Make the changes; None when the input or an action refused (the errors are on the form, and
        nothing changed). An edit that changes nothing is an ``Edit`` with no names."""
        if not self.is_valid():
            return None
        settings = dict(self._setting_changes())
        groups = list(self._group_changes())
        if not settings and not groups:
            return Edit(changed=[], rolling=False)
        generations = self._generations()
        role: str | None = None  # the group being changed, to put a refusal by its fields
        try:
            with transaction.atomic():
                if settings:
                    pipeline_actions.update_pipeline(actor, self.pipeline, **settings)
                for change in groups:
                    role = change.role
                    if change.engine_args is not None or change.gpus_per_replica is not None:
                        pipeline_actions.update_group(
                            actor,
                            self.pipeline,
                            change.role,
                            engine_args=change.engine_args,
                            gpus_per_replica=change.gpus_per_replica,
                        )
                    if change.replicas is not None:
                        pipeline_actions.scale_pipeline(actor, self.pipeline, change.replicas, change.role)
        except (Invalid, Conflict, Forbidden) as error:
            self._refuse_for(error, role)
            return None
        changed = list(settings) + [
            f"{change.role} {name}"
            for change in groups
            for name in ("engine_args", "gpus_per_replica", "replicas")
            if getattr(change, name) is not None
        ]
        return Edit(changed=changed, rolling=self._generations() != generations)

    def _setting_changes(self) -> Iterator[tuple[str, Any]]:
        for name, default in (self.setting_defaults | {"pinned_nodes": None, "pinned_gpus": None}).items():
            value = self.cleaned_data[name]
            if value is None or value == "":
                value = default
            if value != getattr(self.pipeline, name):
                yield name, value

    def _group_changes(self) -> Iterator[GroupChange]:
        data = self.cleaned_data
        for group in self.groups:
            engine_args = data[f"{group.role}-engine_args"]
            gpus = data[f"{group.role}-gpus_per_replica"]
            replicas = data[f"{group.role}-replicas"]
            change = GroupChange(
                role=group.role,
                engine_args=engine_args if engine_args != group.engine_args else None,
                gpus_per_replica=gpus if gpus != group.gpus_per_replica else None,
                replicas=replicas if replicas != group.replicas else None,
            )
            if change != GroupChange(role=group.role):
                yield change

    def _generations(self) -> dict[int, int]:
        return dict(WorkerGroup.objects.filter(pipeline=self.pipeline).values_list("pk", "generation"))

    def _refuse_for(self, error: Invalid | Conflict | Forbidden, role: str | None) -> None:
        """Put the refusal by the field at fault: a group's own field while a group was being changed."""
        if role is not None and isinstance(error, Forbidden):
            self.add_error(f"{role}-engine_args", str(error))
        elif role is not None and isinstance(error, Invalid) and error.field in _GROUP_FIELDS:
            self.add_error(f"{role}-{_GROUP_FIELDS[error.field]}", error.message)
        else:
            self.refuse(error)
