"""The dashboard's forms: they check the shape of the input, and the actions check the rest.

A form's ``submit`` calls the action; the action's Invalid becomes an error on the field it names (or on
the whole form when the form has no such field), its Conflict an error on the field at fault, so that
the page shows every refusal next to the input, in the action's own words.
"""

import dataclasses
import json
from typing import Any

from django import forms

from controlplane.audit.records import Actor
from controlplane.catalog import actions as catalog_actions
from controlplane.catalog.models import LanguageModel, validate_model_name
from controlplane.deployments import pipelines as pipeline_actions
from controlplane.deployments.models import (
    DisaggPolicy,
    Pipeline,
    PlacementPolicy,
    RouterMode,
    WorkerGroup,
    validate_served_name,
)
from controlplane.deployments.pipelines import (
    MAX_GPUS_PER_REPLICA,
    MAX_HOST_CACHE_GIB,
    MAX_ISL_THRESHOLD,
    MAX_PREFILL_BUSY,
    MAX_REPLICAS,
    MAX_ROUTER_TEMPERATURE,
    MAX_ROUTER_WEIGHT,
    GroupSpec,
)
from controlplane.errors import Conflict, Forbidden, Invalid
from controlplane.fleet.node_engines import engine_choices
from runtime.fleet_contract.router_settings import (
    DEFAULT_DISK_HIT_WEIGHT,
    DEFAULT_HOST_HIT_WEIGHT,
    DEFAULT_ISL_RATIO,
    DEFAULT_ISL_THRESHOLD,
    DEFAULT_PREFILL_BUSY,
    DEFAULT_QUEUED_PREFILL_WEIGHT,
)

MAX_ENGINE_ARGS_BYTES = 16 * 1024
#: What the Add-model form offers first, where a node runs it: an engine that serves the model's weights (the
#: first in the list, the mocker, only simulates one).
DEFAULT_MODEL_ENGINE = "llamacpp"
#: The deploy form's two ways of serving (PipelineForm.serving).
AGGREGATED, DISAGGREGATED = "aggregated", "disaggregated"


class JsonObjectField(forms.CharField):
    """A JSON object typed into a text area (empty: ``{}``)."""

    widget = forms.Textarea(attrs={"rows": 3, "spellcheck": "false", "placeholder": "{}"})

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("required", False)
        kwargs.setdefault("max_length", MAX_ENGINE_ARGS_BYTES)
        super().__init__(**kwargs)

    def to_python(self, value: Any) -> Any:
        text = super().to_python(value).strip()
        if not text:
            return {}
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(f"Not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}.") from exc
        if not isinstance(parsed, dict):
            raise forms.ValidationError('A JSON object, such as {"max_num_seqs": 64}.')
        return parsed


class ActionForm(forms.Form):
    """A form whose ``submit`` runs an action and turns its refusals into form errors."""

    # Where a Conflict goes (the field whose value collides); None: the whole form.
    conflict_field: str | None = None
    # Where a Forbidden goes (engine args that need a permission the person lacks); None: the whole form.
    forbidden_field: str | None = None

    def refuse(self, error: Invalid | Conflict | Forbidden) -> None:
        if isinstance(error, Invalid):
            field = error.field if error.field in self.fields else None
            message = error.message if field is not None or error.field is None else f"{error.field}: {error.message}"
        elif isinstance(error, Forbidden):
            field, message = self.forbidden_field, str(error)
        else:
            field, message = self.conflict_field, str(error)
        self.add_error(field, message)


class ModelForm(ActionForm):
    """Add a model to the catalog: a Hugging Face repo (id and revision), a local folder, or a GGUF file."""

    conflict_field = "name"
    forbidden_field = "default_engine_args"

    # The actions do not check names (the API's serializers do): the models' validators do it here.
    name = forms.CharField(max_length=100, validators=[validate_model_name], help_text="What pipelines refer to it by.")
    source_kind = forms.ChoiceField(label="Source", choices=LanguageModel.SourceKind.choices)
    source = forms.CharField(
        max_length=1024,
        label="Repo id or path",
        help_text="owner/name for Hugging Face; an absolute path on the nodes for a folder or a .gguf file.",
    )
    revision = forms.CharField(max_length=255, required=False, help_text="Hugging Face only; empty: main.")
    filename = forms.CharField(
        max_length=255, required=False, help_text="Hugging Face only: the GGUF file to use in a repo of several."
    )
    projector = forms.CharField(
        max_length=1024,
        required=False,
        label="Projector (images)",
        help_text="llamacpp only: the mmproj-*.gguf that lets the model take images; a file of the repo, or an "
        "absolute path on the nodes for a local source.",
    )
    engine = forms.ChoiceField(help_text="The engines some node runs, with the nodes that run each.")
    default_engine_args = JsonObjectField(label="Default engine args (JSON)")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        choices = engine_choices()  # read per form: agents report theirs as they come
        self.fields["engine"].choices = choices
        if any(engine == DEFAULT_MODEL_ENGINE for engine, _ in choices):
            self.fields["engine"].initial = DEFAULT_MODEL_ENGINE

    def submit(self, actor: Actor) -> LanguageModel | None:
        """Create the model; None when the input or the action refused (the errors are on the form)."""
        if not self.is_valid():
            return None
        try:
            return catalog_actions.create_model(actor, **self.cleaned_data)
        except (Invalid, Conflict, Forbidden) as error:
            self.refuse(error)
            return None


class PipelineForm(ActionForm):
    """Deploy a model as a pipeline: one aggregated worker group, or a prefill and a decode group
    (docs/disaggregation.md), which share the engine and its args."""

    conflict_field = "name"
    forbidden_field = "engine_args"

    name = forms.CharField(
        max_length=200,
        validators=[validate_served_name],
        label="Served name",
        help_text="What clients put in a request's model.",
    )
    model = forms.ModelChoiceField(queryset=LanguageModel.objects.order_by("name"), to_field_name="name")
    engine = forms.ChoiceField(
        required=False, help_text="Left empty: the model's. The engines some node runs, with the nodes that run each."
    )
    replicas = forms.IntegerField(min_value=0, max_value=MAX_REPLICAS, initial=1)
    gpus_per_replica = forms.IntegerField(
        min_value=0, max_value=MAX_GPUS_PER_REPLICA, initial=0, label="GPUs per replica", help_text="0 runs on CPU."
    )
    serving = forms.ChoiceField(
        required=False,
        choices=[
            (AGGREGATED, "aggregated: each worker serves whole requests"),
            (DISAGGREGATED, "disaggregated: prompts on prefill workers, answers on decode workers"),
        ],
        initial=AGGREGATED,
        help_text="Disaggregated: the replicas and GPUs above are the decode group's; the prefill group's are below.",
    )
    prefill_replicas = forms.IntegerField(
        min_value=0, max_value=MAX_REPLICAS, initial=1, required=False, help_text="Disaggregated only."
    )
    prefill_gpus_per_replica = forms.IntegerField(
        min_value=0,
        max_value=MAX_GPUS_PER_REPLICA,
        initial=0,
        required=False,
        label="Prefill GPUs per replica",
        help_text="Disaggregated only.",
    )
    router_mode = forms.ChoiceField(choices=RouterMode.choices, initial=RouterMode.ROUND_ROBIN)
    kv_overlap_score_weight = forms.FloatField(
        min_value=0, max_value=MAX_ROUTER_WEIGHT, initial=1.0, label="KV overlap weight", help_text="kv mode."
    )
    kv_queued_prefill_weight = forms.FloatField(
        min_value=0,
        max_value=1,
        initial=DEFAULT_QUEUED_PREFILL_WEIGHT,
        label="KV queued prefill weight",
        help_text="kv mode: how much (0..1) of the prompts already on their way to a worker counts.",
    )
    router_temperature = forms.FloatField(
        min_value=0, max_value=MAX_ROUTER_TEMPERATURE, initial=0.0, label="Router temperature", help_text="kv mode."
    )
    use_kv_events = forms.BooleanField(required=False, initial=True, label="Use KV events")
    kv_host_hit_weight = forms.FloatField(
        required=False,
        min_value=0,
        max_value=1,
        initial=DEFAULT_HOST_HIT_WEIGHT,
        label="KV host-tier hit weight",
        help_text="kv mode: what a prompt block in a worker's host memory is worth against one on its GPU (1).",
    )
    kv_disk_hit_weight = forms.FloatField(
        required=False,
        min_value=0,
        max_value=1,
        initial=DEFAULT_DISK_HIT_WEIGHT,
        label="KV disk-tier hit weight",
        help_text="kv mode: the same for a block on a disk or in a store outside the node.",
    )
    kv_host_cache_gib = forms.FloatField(
        required=False,
        min_value=0,
        max_value=MAX_HOST_CACHE_GIB,
        initial=0,
        label="Host KV cache per replica (GiB)",
        help_text="A KV cache tier in host memory below each replica's GPU (mocker, vllm, sglang); the node must "
        "have it free. 0 or empty: none.",
    )
    disagg_policy = forms.ChoiceField(
        required=False,
        choices=DisaggPolicy.choices,
        initial=DisaggPolicy.ALWAYS,
        label="Where prompts are computed",
        help_text="Disaggregated only (docs/disaggregation.md).",
    )
    disagg_isl_threshold = forms.IntegerField(
        required=False,
        min_value=0,
        max_value=MAX_ISL_THRESHOLD,
        initial=DEFAULT_ISL_THRESHOLD,
        label="isl: tokens left to compute",
        help_text="isl: a prompt with fewer left to compute on its decode worker (and under the share below) "
        "stays there.",
    )
    disagg_isl_ratio = forms.FloatField(
        required=False, min_value=0, max_value=1, initial=DEFAULT_ISL_RATIO, label="isl: share left to compute"
    )
    disagg_prefill_busy = forms.FloatField(
        required=False,
        min_value=0.001,
        max_value=MAX_PREFILL_BUSY,
        initial=DEFAULT_PREFILL_BUSY,
        label="load: prefill busy at (engine steps)",
    )
    disagg_decode_busy = forms.FloatField(
        required=False,
        min_value=0,
        max_value=1,
        label="Decode gate (KV share)",
        help_text="isl and load: a decode worker fuller than this computes no prompt of its own. Empty: no gate.",
    )
    engine_args = JsonObjectField(label="Engine args (JSON)")
    placement_policy = forms.ChoiceField(choices=PlacementPolicy.choices, initial=PlacementPolicy.SPREAD)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["engine"].choices = [("", "the model's engine"), *engine_choices()]

    def submit(self, actor: Actor) -> Pipeline | None:
        """Deploy the pipeline; None when the input or the action refused (the errors are on the form)."""
        if not self.is_valid():
            return None
        data = self.cleaned_data
        engine, engine_args = data["engine"] or None, data["engine_args"]
        group = GroupSpec(
            replicas=data["replicas"], gpus_per_replica=data["gpus_per_replica"], engine=engine, engine_args=engine_args
        )
        groups = [group]
        if data["serving"] == DISAGGREGATED:
            prefill = GroupSpec(
                role=WorkerGroup.Role.PREFILL,
                replicas=1 if data["prefill_replicas"] is None else data["prefill_replicas"],
                gpus_per_replica=data["prefill_gpus_per_replica"] or 0,
                engine=engine,
                engine_args=engine_args,
            )
            groups = [prefill, dataclasses.replace(group, role=WorkerGroup.Role.DECODE)]
        try:
            return pipeline_actions.deploy_pipeline(
                actor,
                name=data["name"],
                model=data["model"],
                groups=groups,
                router_mode=data["router_mode"],
                kv_overlap_score_weight=data["kv_overlap_score_weight"],
                kv_queued_prefill_weight=data["kv_queued_prefill_weight"],
                router_temperature=data["router_temperature"],
                use_kv_events=data["use_kv_events"],
                kv_host_hit_weight=_or(data["kv_host_hit_weight"], DEFAULT_HOST_HIT_WEIGHT),
                kv_disk_hit_weight=_or(data["kv_disk_hit_weight"], DEFAULT_DISK_HIT_WEIGHT),
                kv_host_cache_gib=_or(data["kv_host_cache_gib"], 0.0),
                disagg_policy=data["disagg_policy"] or DisaggPolicy.ALWAYS,
                disagg_isl_threshold=_or(data["disagg_isl_threshold"], DEFAULT_ISL_THRESHOLD),
                disagg_isl_ratio=_or(data["disagg_isl_ratio"], DEFAULT_ISL_RATIO),
                disagg_prefill_busy=_or(data["disagg_prefill_busy"], DEFAULT_PREFILL_BUSY),
                disagg_decode_busy=data["disagg_decode_busy"],
                placement_policy=data["placement_policy"],
            )
        except (Invalid, Conflict, Forbidden) as error:
            self.refuse(error)
            return None


class ScaleForm(forms.Form):
    """A worker group's new replica count (``role``: which group, when the pipeline has several)."""

    replicas = forms.IntegerField(min_value=0, max_value=MAX_REPLICAS)
    role = forms.ChoiceField(choices=WorkerGroup.Role.choices, required=False)


class AuditFilterForm(forms.Form):
    """The audit log's filters; every one is optional and they combine."""

    actor = forms.CharField(max_length=160, required=False, help_text="alice, agent:gpu-a, system:reconciler")
    action = forms.CharField(max_length=64, required=False, label="Kind", help_text="pipeline. or pipeline.scale")
    target_type = forms.ChoiceField(required=False, label="Object type")
    target = forms.CharField(max_length=255, required=False, label="Object", help_text="its name or id")

    def __init__(self, *args: Any, target_types: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["target_type"].choices = [("", "any"), *((kind, kind) for kind in target_types)]


def _or(value: Any, default: Any) -> Any:
    """``value``, or ``default`` for a field left empty (None)."""
    return default if value is None else value
