"""The Models page's "Find on Hugging Face": a search of the hub, and a repo's size, context and memory
estimate against the fleet's free GPUs, before it is added to the catalog.

Both only read public data from the hub (with the control plane's HF_TOKEN, when set, for private repos
it can read), so every role may use them; adding the model stays the operators' (views.models_page). A
hub that cannot be reached, a timeout, an error or an answer in an unknown form is a sentence on the page
(hub_lookup's HubLookupFailed), never a 500; bad input is a 400 with the form's errors, which htmx swaps
in all the same (base.html).
"""

import re
from types import ModuleType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from django import forms
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_GET

from controlplane.catalog.engines import PROJECTOR_ENGINE
from controlplane.catalog.errors import HubLookupFailed
from controlplane.catalog.memory import context_tokens, estimate_memory_bytes, kv_shape
from controlplane.catalog.models import LanguageModel
from controlplane.dashboard.access import can_act
from controlplane.dashboard.model_fit import engine_fits, serving_engines
from controlplane.deployments.inventory import fleet_inventory
from runtime.errors import ConfigError

if TYPE_CHECKING:
    from runtime.models.hub_download import HubSettings

# huggingface_hub's rules for a repo id, revision and file (catalog/actions.py checks the same when it is added).
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$")
_FILENAME = re.compile(r"^[A-Za-z0-9._-][A-Za-z0-9._ /-]{0,254}$")
_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9._-]+")
MAX_QUERY_LENGTH = 100


class HubSearchForm(forms.Form):
    q = forms.CharField(
        max_length=MAX_QUERY_LENGTH,
        strip=True,
        label="Find on Hugging Face",
        error_messages={"required": "Type part of a repo's name, such as SmolLM2 or Qwen2.5-0.5B."},
    )


class HubRepoForm(forms.Form):
    repo = forms.RegexField(_REPO_ID, max_length=193, error_messages={"invalid": "A repo id is owner/name."})
    revision = forms.RegexField(_REVISION, required=False, max_length=255)
    file = forms.RegexField(_FILENAME, required=False, max_length=255)

    def clean_file(self) -> str:
        name: str = self.cleaned_data["file"]
        if name and not name.lower().endswith(".gguf"):
            raise forms.ValidationError("The file to serve of a repo is one of its GGUF files (ending in .gguf).")
        return name


@login_required
@require_GET
def hub_search(request: HttpRequest) -> HttpResponse:
    """The hub's repos matching ``q`` (a partial for the Models page's search box)."""
    form = HubSearchForm(request.GET)
    context: dict[str, Any] = {"form": form, "results": None, "problem": ""}
    if not form.is_valid():
        return render(request, "dashboard/partials/hub_search.html", context, status=400)
    try:
        hub_lookup = _hub_lookup()
        context["results"] = hub_lookup.search(_hub_settings(), form.cleaned_data["q"])
    except (ConfigError, HubLookupFailed) as exc:
        context["problem"] = str(exc)
    return render(request, "dashboard/partials/hub_search.html", context)


@login_required
@require_GET
def hub_details(request: HttpRequest) -> HttpResponse:
    """One repo's size, context, KV shape and memory estimate per engine against the fleet's free GPUs."""
    form = HubRepoForm(request.GET)
    context: dict[str, Any] = {"form": form, "facts": None, "problem": "", "can_act": can_act(request)}
    if not form.is_valid():
        return render(request, "dashboard/partials/hub_details.html", context, status=400)
    repo, revision, file = (form.cleaned_data[name] for name in ("repo", "revision", "file"))
    try:
        facts = _hub_lookup().repo_facts(_hub_settings(), repo, revision or None, file or None)
    except (ConfigError, HubLookupFailed) as exc:
        context["problem"] = str(exc)
        return render(request, "dashboard/partials/hub_details.html", context)
    context["facts"] = facts
    if not facts.pick_problem:
        is_gguf = facts.file is not None and facts.file.endswith(".gguf")
        # A GGUF file served by llama.cpp takes the repo's projector (images), which llama.cpp loads beside the
        # weights: its row of the table counts it, and the form names it when it offers llama.cpp.
        projector = facts.projector if is_gguf else None
        projector_bytes = facts.projector_sizes.get(projector) if projector else None
        engines = serving_engines(is_gguf)
        context |= estimate_context(
            facts.size_bytes, facts.config, facts.gguf_context_length, engines, projector_bytes=projector_bytes
        )
        # The form offers first the engine that fits somewhere (the first the dashboard lists, else).
        offered = next((fit for fit in context["fits"] if fit.fits), context["fits"][0])
        if offered.engine == PROJECTOR_ENGINE:
            context["need"] = offered.memory_bytes
        else:
            projector = None
            context["projector_bytes"] = None
        context["projector"] = projector
        context["add_url"] = _add_url(repo, revision, facts.file, offered.engine, projector)
    return render(request, "dashboard/partials/hub_details.html", context)


def estimate_context(
    size_bytes: int | None,
    config: dict[str, Any],
    context_length: int | None,
    engines: list[str],
    *,
    projector_bytes: int | None = None,
) -> dict[str, Any]:
    """What partials/model_fit.html shows: the context, the KV shape, the estimate and where it fits. A projector's
    size (``projector_bytes``) counts in the need of the engine that loads one, and is shown."""
    need = estimate_memory_bytes(size_bytes, config, context_length)
    needs = {engine: need for engine in engines}
    if projector_bytes is not None and PROJECTOR_ENGINE in needs:
        needs[PROJECTOR_ENGINE] = estimate_memory_bytes(size_bytes, config, context_length, projector_bytes)
    context = _fit_context(size_bytes, config, context_length, need, needs)
    context["projector_bytes"] = projector_bytes
    return context


def model_estimate_context(model: LanguageModel) -> dict[str, Any]:
    """The same for a model of the catalog, from what the catalog holds of it (its memory need: the operator's
    figure, else its estimate), for its own engine; no hub is asked."""
    need = model.memory_bytes if model.loads_weights else None
    needs = {model.engine: need} if model.loads_weights else {}
    context = _fit_context(model.size_bytes, model.config, model.context_length, need, needs)
    context["projector_bytes"] = model.projector_bytes if model.projector else None
    return context


def _fit_context(
    size_bytes: int | None,
    config: dict[str, Any],
    context_length: int | None,
    need: int | None,
    needs: dict[str, int | None],
) -> dict[str, Any]:
    """``need`` is the one the page names; ``needs`` each engine's, where it may fit."""
    inventory = fleet_inventory()
    return {
        "size_bytes": size_bytes,
        "tokens": context_tokens(config, context_length),
        "shape": kv_shape(config),
        "need": need,
        "fits": [fit for engine, each in needs.items() for fit in engine_fits(each, [engine], inventory)],
    }


def _hub_lookup() -> ModuleType:
    """catalog/hub_lookup.py, imported on first use: huggingface_hub (which its file picking imports) takes
    ~0.35 s to import, which every control-plane process would pay at start for a box a person may never use.
    Raises HubLookupFailed when huggingface_hub refuses this environment (it reads its variables on import)."""
    try:
        from controlplane.catalog import hub_lookup
    except ValueError as exc:  # HF_HUB_ETAG_TIMEOUT=0.5: huggingface_hub wants whole seconds
        raise HubLookupFailed(
            f"huggingface_hub cannot start with the control plane's environment ({exc}): check its HF_HUB_* "
            "variables (HF_HUB_ETAG_TIMEOUT and HF_HUB_DOWNLOAD_TIMEOUT are whole seconds)"
        ) from exc
    return hub_lookup


def _hub_settings() -> "HubSettings":
    from runtime.models.hub_download import HubSettings  # see _hub_lookup

    return HubSettings.from_environment()


def _add_url(repo: str, revision: str, file: str | None, engine: str, projector: str | None = None) -> str:
    """The Models page with its Add-model form filled with this repo (and its GGUF file and projector)."""
    name = _NOT_IN_NAME.sub("-", repo.rsplit("/", 1)[-1]).strip("-._")[:100] or "model"
    fields = {"source_kind": LanguageModel.SourceKind.HUGGING_FACE, "source": repo, "name": name}
    if revision:
        fields["revision"] = revision
    if file:
        fields["filename"] = file
    if engine:
        fields["engine"] = engine
    if projector:
        fields["projector"] = projector
    return f"{reverse('dashboard:models')}?{urlencode(fields)}#add-model"
