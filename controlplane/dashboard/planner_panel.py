"""The pipeline page's planner panel and its form, and the model page's profile: read and change them.

The panel (``partials/pipeline_planner.html``, element ``planner-<pipeline pk>``) shows the targets, what
the latest decision measured against them and predicted, and the recent decisions with their reasons; the
planner's loop pushes it again after each interval's decisions. Its form sets the common targets of every
group (``default``) and the mode (off, advisory, acting), keeping whatever else the document says (group
overrides, thresholds); the whole document is the API's (``PATCH /api/v1/pipelines/{id}/`` with
``planner``).
"""

import json
from dataclasses import dataclass
from typing import Any

from django import forms

from controlplane.deployments.models import Pipeline
from controlplane.planning.models import PlannerDecision
from planner.errors import SettingsError
from planner.settings import GroupTargets
from planner.targets_json import targets_from_dict

#: Decisions the panel lists (the API pages through the rest).
SHOWN_DECISIONS = 12
MODES = (("off", "off"), ("advisory", "advisory: record, do not act"), ("on", "on: act"))


@dataclass(frozen=True)
class Panel:
    pipeline: Pipeline
    mode: str  # off, advisory, on
    document: str  # the targets as JSON, for reading ("" when there are none)
    default: GroupTargets | None
    latest: PlannerDecision | None
    decisions: list[PlannerDecision]
    has_profile: bool
    form: "PlannerForm"


def panel(pipeline: Pipeline) -> Panel:
    """What the panel shows of ``pipeline`` (two queries)."""
    settings = pipeline.planner
    default = None
    if settings is not None:
        try:
            default = targets_from_dict(settings).default
        except SettingsError:
            default = None  # stored before a stricter check: the page shows the document as it is
    decisions = list(PlannerDecision.objects.filter(pipeline=pipeline).order_by("-at", "-id")[:SHOWN_DECISIONS])
    mode = mode_of(settings)
    initial: dict[str, Any] = {"mode": mode}
    if default is not None:
        initial |= {name: getattr(default, name) for name in ("ttft_s", "itl_s", "min_replicas", "max_replicas")}
    return Panel(
        pipeline=pipeline,
        mode=mode,
        document=json.dumps(settings, indent=2, sort_keys=True) if settings is not None else "",
        default=default,
        latest=decisions[0] if decisions else None,
        decisions=decisions,
        has_profile=pipeline.model.profile is not None,
        form=PlannerForm(initial=initial, auto_id=f"planner-{pipeline.pk}-%s"),
    )


def mode_of(settings: Any) -> str:
    if not isinstance(settings, dict) or not settings.get("enabled", True):
        return "off"
    return "advisory" if settings.get("advisory") else "on"


class PlannerForm(forms.Form):
    """The mode and the targets every group shares; a blank latency target is none (load mode for it)."""

    mode = forms.ChoiceField(choices=MODES)
    ttft_s = forms.FloatField(required=False, min_value=0.001, label="TTFT target (s)")
    itl_s = forms.FloatField(required=False, min_value=0.0001, label="ITL target (s)")
    min_replicas = forms.IntegerField(min_value=0, max_value=512, initial=1)
    max_replicas = forms.IntegerField(min_value=1, max_value=512, initial=8)

    def document(self, current: Any) -> dict[str, Any] | None:
        """The new targets document: ``current`` with the form's fields laid over it. Call after
        ``is_valid()``. Off keeps the targets (``enabled: false``) for the next time it is turned on."""
        data = self.cleaned_data
        document = dict(current) if isinstance(current, dict) else {}
        document["enabled"] = data["mode"] != "off"
        document["advisory"] = data["mode"] == "advisory"
        default = dict(document.get("default") or {})
        for name in ("ttft_s", "itl_s", "min_replicas", "max_replicas"):
            default[name] = data[name]
        document["default"] = default
        return document


class ProfileForm(forms.Form):
    """A model's profile, pasted as JSON (docs/planner.md, "A profile")."""

    profile = forms.CharField(widget=forms.Textarea(attrs={"rows": 14, "cols": 80}), max_length=64 * 1024)

    def clean_profile(self) -> Any:
        try:
            return json.loads(self.cleaned_data["profile"])
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
