"""Editing a pipeline, deleting a pipeline or a model from the dashboard: the API's actions, the API's
refusals shown by the field or as the page's note, the rolling update's progress on the pipeline page, and
no controls (and a 403) for read-only people."""

import json

import pytest
from django.utils.html import escape

from controlplane.accounts.models import Role
from controlplane.audit.models import AuditEntry
from controlplane.catalog.models import LanguageModel
from controlplane.dashboard import partials
from controlplane.dashboard.pipeline_edit import PipelineEditForm
from controlplane.deployments import upkeep
from controlplane.deployments.instance_states import LIVE_STATES, InstanceState
from controlplane.deployments.models import Instance, Pipeline, WorkerGroup
from controlplane.deployments.pipelines import GroupSpec, deploy_pipeline, stop_pipeline
from tests.controlplane.factories import TEST_ACTOR, deploy, make_model, make_node, run_instance
from tests.controlplane.test_dashboard import logged_in
from tests.controlplane.test_dashboard_forms import field_errors

pytestmark = pytest.mark.django_db

HTMX = {"HTTP_HX_REQUEST": "true"}


def edit_form(pipeline: Pipeline, **changes: str) -> dict[str, str]:
    """The edit form's fields as the page fills them in for ``pipeline``, with ``changes`` typed over them."""
    form = PipelineEditForm(pipeline)
    data = {}
    for name, field in form.fields.items():
        value = form.initial.get(name, field.initial)
        if isinstance(value, bool):  # a checkbox sends its name only when ticked
            if value:
                data[name] = "on"
            continue
        data[name] = "" if value is None else str(value)
    return data | changes


def ready_pipeline(replicas: int = 1) -> Pipeline:
    """Pipeline "chat" (mocker, on CPU) with ``replicas`` ready instances on node cpu-a."""
    make_node("cpu-a", gpus_gib=())
    pipeline = deploy("chat", replicas=replicas)
    upkeep.place_pending_instances(TEST_ACTOR)
    for instance in Instance.objects.select_related("node", "pipeline", "group"):
        run_instance(instance)
    return pipeline


def test_an_operator_changes_engine_args_and_the_group_rolls_out_through_the_apis_update() -> None:
    pipeline = ready_pipeline()
    browser = logged_in(Role.OPERATOR, username="olga")
    data = edit_form(pipeline, **{"aggregated-engine_args": '{"speedup_ratio": 10}'})

    response = browser.post(f"/pipelines/{pipeline.pk}/edit/", data)

    assert (response.status_code, response["Location"]) == (302, f"/pipelines/{pipeline.pk}/")
    group = WorkerGroup.objects.get()
    assert group.engine_args == {"speedup_ratio": 10} and group.generation == 2
    entry = AuditEntry.objects.get(action="pipeline.update_group")
    assert entry.actor_name == "olga"
    assert not AuditEntry.objects.filter(action__in=["pipeline.update", "pipeline.scale"]).exists()
    page = browser.get(f"/pipelines/{pipeline.pk}/").content.decode()
    assert "chat updated: aggregated engine_args." in page and "replaced one at a time" in page


def test_router_settings_placement_and_replicas_change_together() -> None:
    pipeline = ready_pipeline()
    make_node("cpu-b", gpus_gib=())
    data = edit_form(
        pipeline,
        router_mode="kv",
        kv_overlap_score_weight="2.5",
        placement_policy="binpack",
        pinned_nodes="cpu-a, cpu-b",
        **{"aggregated-replicas": "3"},
    )

    response = logged_in(Role.ADMIN).post(f"/pipelines/{pipeline.pk}/edit/", data)

    assert response.status_code == 302
    pipeline.refresh_from_db()
    assert (pipeline.router_mode, pipeline.kv_overlap_score_weight) == ("kv", 2.5)
    assert (pipeline.placement_policy, pipeline.pinned_nodes) == ("binpack", ["cpu-a", "cpu-b"])
    assert pipeline.router_generation == 2 and WorkerGroup.objects.get().replicas == 3
    assert pipeline.instances.filter(state__in=LIVE_STATES).count() == 3
    assert set(AuditEntry.objects.filter(action__startswith="pipeline.").values_list("action", flat=True)) == {
        "pipeline.deploy",
        "pipeline.update",
        "pipeline.scale",
    }


def test_saving_the_form_unchanged_changes_nothing_and_says_so() -> None:
    pipeline = ready_pipeline()
    browser = logged_in(Role.OPERATOR)
    entries = AuditEntry.objects.count()
    response = browser.post(f"/pipelines/{pipeline.pk}/edit/", edit_form(pipeline))
    assert response.status_code == 302 and AuditEntry.objects.count() == entries
    assert "Nothing changed in chat." in browser.get(f"/pipelines/{pipeline.pk}/").content.decode()


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"aggregated-engine_args": "{not json"}, "aggregated-engine_args", "Not JSON"),
        ({"aggregated-engine_args": "[1, 2]"}, "aggregated-engine_args", "A JSON object"),
        ({"aggregated-replicas": "-1"}, "aggregated-replicas", "greater than or equal to 0"),
        ({"aggregated-replicas": "many"}, "aggregated-replicas", "Enter a whole number"),
        ({"kv_overlap_score_weight": "nan"}, "kv_overlap_score_weight", "Enter a number"),
        ({"router_mode": "fastest"}, "router_mode", "Select a valid choice"),
        ({"pinned_nodes": "Bad_Name"}, "pinned_nodes", "'Bad_Name'"),
        ({"pinned_gpus": "0, x"}, "pinned_gpus", "'x' is not a GPU index"),
        # Refused by the action, as the API refuses it, and put by the field the action names.
        ({"pinned_nodes": "gpu-z"}, "pinned_nodes", "no node is named 'gpu-z'"),
        ({"kv_host_cache_gib": "8"}, "kv_host_cache_gib", "kv_bytes_per_token"),
        ({"aggregated-gpus_per_replica": "2", "pinned_gpus": "0"}, "pinned_gpus", "cannot hold a replica"),
    ],
)
def test_bad_input_comes_back_with_the_reason_by_its_field_and_changes_nothing(
    changes: dict[str, str], field: str, message: str
) -> None:
    pipeline = ready_pipeline()
    browser = logged_in(Role.OPERATOR)
    entries = AuditEntry.objects.count()

    response = browser.post(f"/pipelines/{pipeline.pk}/edit/", edit_form(pipeline, **changes))

    assert response.status_code == 400
    errors = response.context["form"].errors
    assert field in errors and message in " ".join(errors[field]), errors
    assert field_errors(response.content.decode(), escape(message))
    assert AuditEntry.objects.count() == entries and WorkerGroup.objects.get().generation == 1


def test_a_refusal_of_a_later_change_undoes_the_earlier_ones() -> None:
    pipeline = ready_pipeline()
    # The router change goes through update_pipeline first; the engine args' refusal (remote code is an
    # admin's decision) comes after it.
    data = edit_form(pipeline, router_mode="kv", **{"aggregated-engine_args": '{"trust_remote_code": true}'})

    response = logged_in(Role.OPERATOR).post(f"/pipelines/{pipeline.pk}/edit/", data)

    assert response.status_code == 400
    assert "trust_remote_code" in " ".join(response.context["form"].errors["aggregated-engine_args"])
    pipeline.refresh_from_db()
    assert pipeline.router_mode == "round-robin" and pipeline.router_generation == 1
    assert not AuditEntry.objects.filter(action="pipeline.update").exists()


def test_the_rollout_shows_which_instances_are_old_and_new_and_which_are_ready() -> None:
    pipeline = ready_pipeline(replicas=2)
    browser = logged_in(Role.OPERATOR)
    browser.post(f"/pipelines/{pipeline.pk}/edit/", edit_form(pipeline, **{"aggregated-engine_args": '{"a": 1}'}))
    old = list(Instance.objects.order_by("replica"))

    page = browser.get(f"/pipelines/{pipeline.pk}/").content.decode()
    assert page.count("old settings") == 2 and "new settings" not in page
    assert "Rolling update: 2 old (2 ready), 0 new (0 ready)" in page

    # The reconciler's step: one replacement, which then becomes ready.
    assert upkeep.roll_out_updates(TEST_ACTOR) == 1
    upkeep.place_pending_instances(TEST_ACTOR)
    new = Instance.objects.select_related("node", "pipeline", "group").get(generation=2)
    assert new.replaces == old[0]
    page = browser.get(f"/pipelines/{pipeline.pk}/").content.decode()
    assert "Rolling update: 2 old (2 ready), 1 new (0 ready)" in page
    run_instance(new)
    # What a live push sends: each instance's row and the pipeline's row, rendered again.
    assert "new settings" in partials.render_instance(new.pk, can_act=True)
    assert "old settings" in partials.render_instance(old[1].pk, can_act=True)
    assert "2 old (2 ready), 1 new (1 ready)" in partials.render_pipeline_row(pipeline.pk, can_act=True)

    # Once no old instance is left, the labels and the summary go.
    Instance.objects.filter(generation=1).update(state=InstanceState.STOPPED)
    assert "settings" not in partials.render_instance(new.pk, can_act=True)
    assert "Rolling update" not in partials.render_pipeline_row(pipeline.pk, can_act=True)


def test_a_running_pipeline_is_not_deleted_and_the_note_says_stop_it_first() -> None:
    pipeline = ready_pipeline()
    response = logged_in(Role.OPERATOR).post(f"/pipelines/{pipeline.pk}/delete/", **HTMX)
    assert response.status_code == 409
    html = response.content.decode()
    assert html.startswith('<div id="flash"') and 'hx-swap-oob="true"' in html
    assert "chat not deleted: pipeline chat is running; stop it first." in html
    assert Pipeline.objects.filter(pk=pipeline.pk).exists()


def test_a_stopped_pipeline_is_deleted_and_the_browser_goes_to_the_list() -> None:
    pipeline = stop_pipeline(TEST_ACTOR, deploy("chat"))
    browser = logged_in(Role.OPERATOR, username="olga")

    response = browser.post(f"/pipelines/{pipeline.pk}/delete/", **HTMX)

    assert (response.status_code, response["HX-Redirect"]) == (204, "/pipelines/")
    assert not Pipeline.objects.exists()
    assert AuditEntry.objects.get(action="pipeline.delete").actor_name == "olga"
    assert "Pipeline chat deleted." in browser.get("/pipelines/").content.decode()


def test_without_htmx_a_delete_redirects_with_the_note() -> None:
    pipeline = ready_pipeline()
    browser = logged_in(Role.OPERATOR)
    response = browser.post(f"/pipelines/{pipeline.pk}/delete/")
    assert (response.status_code, response["Location"]) == (302, f"/pipelines/{pipeline.pk}/")
    assert "stop it first" in browser.get(response["Location"]).content.decode()


def test_a_model_with_pipelines_is_not_deleted_and_the_note_names_them() -> None:
    model = make_model("smol")
    deploy("chat", model)
    deploy("chat-2", model)
    browser = logged_in(Role.OPERATOR)

    response = browser.post(f"/models/{model.pk}/delete/", **HTMX)

    assert response.status_code == 409
    assert "smol not deleted: model &#x27;smol&#x27; is used by pipelines chat, chat-2" in response.content.decode()
    assert LanguageModel.objects.filter(pk=model.pk).exists()
    page = browser.get(f"/models/{model.pk}/").content.decode()
    assert f'href="/pipelines/{Pipeline.objects.get(name="chat").pk}/">chat</a>' in page


def test_a_model_without_pipelines_is_deleted() -> None:
    model = make_model("smol")
    browser = logged_in(Role.ADMIN, username="ada")
    response = browser.post(f"/models/{model.pk}/delete/", **HTMX)
    assert (response.status_code, response["HX-Redirect"]) == (204, "/models/")
    assert not LanguageModel.objects.exists()
    assert AuditEntry.objects.get(action="model.delete").actor_name == "ada"


def test_read_only_people_get_no_edit_or_delete_controls_in_the_html() -> None:
    pipeline = stop_pipeline(TEST_ACTOR, deploy("chat"))
    model = pipeline.model
    reader = logged_in(Role.READ_ONLY)
    for page in (f"/pipelines/{pipeline.pk}/", f"/models/{model.pk}/"):
        html = reader.get(page).content.decode()
        assert "/delete/" not in html and "/edit/" not in html, page
    operator = logged_in(Role.OPERATOR)
    assert f"/pipelines/{pipeline.pk}/edit/" in operator.get(f"/pipelines/{pipeline.pk}/").content.decode()
    assert f"/models/{model.pk}/delete/" in operator.get(f"/models/{model.pk}/").content.decode()
    edit_page = operator.get(f"/pipelines/{pipeline.pk}/edit/")
    assert edit_page.status_code == 200 and 'name="aggregated-engine_args"' in edit_page.content.decode()


def test_read_only_people_get_403_from_edit_and_delete_and_nothing_changes() -> None:
    pipeline = stop_pipeline(TEST_ACTOR, deploy("chat"))
    make_model("unused")
    unused = LanguageModel.objects.get(name="unused")
    reader = logged_in(Role.READ_ONLY)
    entries = AuditEntry.objects.count()
    data = edit_form(pipeline, router_mode="kv")
    assert reader.get(f"/pipelines/{pipeline.pk}/edit/").status_code == 403
    assert reader.post(f"/pipelines/{pipeline.pk}/edit/", data).status_code == 403
    assert reader.post(f"/pipelines/{pipeline.pk}/delete/", **HTMX).status_code == 403
    assert reader.post(f"/models/{unused.pk}/delete/", **HTMX).status_code == 403
    assert AuditEntry.objects.count() == entries
    assert Pipeline.objects.get().router_mode == "round-robin" and LanguageModel.objects.count() == 2


def test_deletes_need_the_csrf_token_and_are_posts_only() -> None:
    pipeline = stop_pipeline(TEST_ACTOR, deploy("chat"))
    browser = logged_in(Role.ADMIN, enforce_csrf_checks=True)
    assert browser.post(f"/pipelines/{pipeline.pk}/delete/", **HTMX).status_code == 403
    assert browser.get(f"/pipelines/{pipeline.pk}/delete/").status_code == 405
    assert browser.post(f"/pipelines/{pipeline.pk}/edit/", edit_form(pipeline, router_mode="kv")).status_code == 403
    assert Pipeline.objects.filter(pk=pipeline.pk, router_mode="round-robin").exists()


def test_a_disaggregated_pipeline_edits_each_group_and_its_prompt_policy() -> None:
    groups = [GroupSpec(role="prefill"), GroupSpec(role="decode")]
    pipeline = deploy_pipeline(TEST_ACTOR, name="split", model=make_model("split-model"), groups=groups)
    data = edit_form(pipeline, disagg_policy="isl", **{"decode-replicas": "2", "prefill-engine_args": '{"x": 1}'})

    response = logged_in(Role.OPERATOR).post(f"/pipelines/{pipeline.pk}/edit/", data)

    assert response.status_code == 302
    pipeline.refresh_from_db()
    by_role = {group.role: group for group in pipeline.groups.all()}
    assert pipeline.disagg_policy == "isl"
    assert by_role["decode"].replicas == 2 and by_role["decode"].engine_args == {}
    assert by_role["prefill"].engine_args == {"x": 1} and by_role["prefill"].replicas == 1
    # The prompt policy is a router setting both groups restart for; the engine args are the prefill group's.
    assert (by_role["prefill"].generation, by_role["decode"].generation) == (3, 2)


def test_the_edit_form_starts_from_the_pipelines_settings() -> None:
    pipeline = deploy("chat", router_mode="kv", kv_overlap_score_weight=3.0, pinned_gpus=[0, 1])
    WorkerGroup.objects.update(engine_args={"speedup_ratio": 5})
    data = edit_form(pipeline)
    assert (data["router_mode"], data["kv_overlap_score_weight"], data["pinned_gpus"]) == ("kv", "3.0", "0, 1")
    assert json.loads(data["aggregated-engine_args"]) == {"speedup_ratio": 5}
    assert "disagg_policy" not in data  # one aggregated group: no prompt policy to set
