"""The dashboard's forms (add a model, deploy a pipeline): they call the actions, show the actions'
refusals next to the field, and refuse read-only people and requests without a CSRF token."""

import json

import pytest

from controlplane.accounts.models import Role
from controlplane.audit.models import AuditEntry
from controlplane.catalog.models import LanguageModel
from controlplane.deployments.models import Instance, Pipeline
from tests.controlplane.factories import make_model
from tests.controlplane.test_dashboard import logged_in

pytestmark = pytest.mark.django_db

A_MODEL = {
    "name": "smol",
    "source_kind": "hf",
    "source": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "revision": "main",
    "filename": "",
    "engine": "mocker",
    "default_engine_args": '{"max_num_seqs": 64}',
}
A_PIPELINE = {
    "name": "chat",
    "model": "smol",
    "engine": "",
    "replicas": "2",
    "gpus_per_replica": "0",
    "router_mode": "kv",
    "kv_overlap_score_weight": "1.5",
    "kv_queued_prefill_weight": "0.25",
    "router_temperature": "0.2",
    "use_kv_events": "on",
    "engine_args": "",
    "placement_policy": "binpack",
}


def field_errors(html: str, text: str) -> bool:
    """Whether ``text`` is in one of the page's form error lists."""
    return any(text in block.split("</ul>", 1)[0] for block in html.split('class="errorlist')[1:])


def test_an_operator_adds_a_model_and_the_audit_log_says_who() -> None:
    response = logged_in(Role.OPERATOR, username="olga").post("/models/", A_MODEL)
    assert (response.status_code, response["Location"]) == (302, "/models/")
    model = LanguageModel.objects.get()
    assert (model.name, model.revision, model.default_engine_args) == ("smol", "main", {"max_num_seqs": 64})
    entry = AuditEntry.objects.get(action="model.create")
    assert (entry.actor_name, entry.target_name) == ("olga", "smol")


def test_the_add_model_form_chooses_llamacpp_first_not_the_simulated_engine() -> None:
    html = logged_in(Role.OPERATOR).get("/models/").content.decode()
    engine = html.split('name="engine"', 1)[1].split("</select>", 1)[0]
    assert '<option value="llamacpp" selected>' in engine and '<option value="mocker">' in engine, engine


def test_a_mocker_model_shows_no_memory_estimate_as_it_loads_no_weights() -> None:
    make_model("simulated", size_bytes=10 * 1024**3)  # the factory's engine is the mocker
    html = logged_in(Role.OPERATOR).get("/models/").content.decode()
    row = html.split('id="model-', 1)[1].split("</tr>", 1)[0]
    assert "none: mocker loads no weights" in row and "estimated" not in row, row


def test_a_gguf_file_and_a_local_folder_are_sources_too() -> None:
    browser = logged_in(Role.ADMIN)
    gguf = {**A_MODEL, "name": "tiny", "source_kind": "gguf", "source": "/models/tiny.gguf", "revision": ""}
    gguf["engine"] = "llamacpp"
    folder = {**A_MODEL, "name": "local", "source_kind": "folder", "source": "/models/smol", "revision": ""}
    assert browser.post("/models/", gguf).status_code == 302
    assert browser.post("/models/", folder).status_code == 302
    assert sorted(LanguageModel.objects.values_list("name", "source_kind")) == [("local", "folder"), ("tiny", "gguf")]


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"source": "not a repo id"}, "is not a Hugging Face repo id"),  # the action's Invalid, on its field
        ({"source_kind": "gguf", "source": "/models/smol.bin", "revision": ""}, "a path ending in .gguf"),
        ({"engine": "llamacpp"}, "llamacpp loads GGUF files"),
        ({"default_engine_args": "[1, 2]"}, "A JSON object"),  # the form's own check
        ({"default_engine_args": "{not json"}, "Not JSON"),
        ({"name": ""}, "This field is required."),
        ({"name": "-smol"}, "starting with a letter or digit"),
    ],
)
def test_an_invalid_model_is_shown_again_with_the_error_by_its_field_and_nothing_is_created(
    change: dict[str, str], error: str
) -> None:
    response = logged_in(Role.OPERATOR).post("/models/", {**A_MODEL, **change})
    assert response.status_code == 400
    html = response.content.decode()
    assert field_errors(html, error), html
    assert 'value="HuggingFaceTB' in html or change.get("source")  # what was typed comes back
    assert not LanguageModel.objects.exists()
    assert not AuditEntry.objects.filter(action="model.create").exists()


def test_a_taken_model_name_is_an_error_on_the_name() -> None:
    make_model("smol")
    response = logged_in(Role.OPERATOR).post("/models/", A_MODEL)
    assert response.status_code == 400 and field_errors(response.content.decode(), "already exists")
    assert LanguageModel.objects.count() == 1


def test_an_operator_deploys_a_pipeline_and_lands_on_its_page() -> None:
    make_model("smol")
    response = logged_in(Role.OPERATOR, username="olga").post("/pipelines/", A_PIPELINE)
    pipeline = Pipeline.objects.get()
    assert (response.status_code, response["Location"]) == (302, f"/pipelines/{pipeline.pk}/")
    assert (pipeline.router_mode, pipeline.kv_overlap_score_weight, pipeline.router_temperature) == ("kv", 1.5, 0.2)
    assert pipeline.kv_queued_prefill_weight == 0.25
    assert pipeline.use_kv_events and pipeline.placement_policy == "binpack"
    group = pipeline.groups.get()
    assert (group.engine, group.replicas, group.gpus_per_replica) == ("mocker", 2, 0)
    assert Instance.objects.filter(pipeline=pipeline, state="pending").count() == 2
    assert AuditEntry.objects.get(action="pipeline.deploy").actor_name == "olga"


def test_an_unticked_kv_events_box_turns_them_off_and_engine_args_reach_the_group() -> None:
    make_model("smol")
    body = {**A_PIPELINE, "engine_args": json.dumps({"speedup_ratio": 10})}
    del body["use_kv_events"]
    assert logged_in(Role.OPERATOR).post("/pipelines/", body).status_code == 302
    pipeline = Pipeline.objects.get()
    assert not pipeline.use_kv_events and pipeline.groups.get().engine_args == {"speedup_ratio": 10}


def test_the_deploy_form_takes_the_tier_hit_weights_and_a_host_tier_shown_on_the_pipeline_page() -> None:
    make_model("smol")
    body = {
        **A_PIPELINE,
        "engine_args": json.dumps({"kv_bytes_per_token": 1024}),
        "kv_host_hit_weight": "0.5",
        "kv_disk_hit_weight": "0.1",
        "kv_host_cache_gib": "4",
    }
    browser = logged_in(Role.OPERATOR)
    assert browser.post("/pipelines/", body).status_code == 302
    pipeline = Pipeline.objects.get()
    assert (pipeline.kv_host_hit_weight, pipeline.kv_disk_hit_weight, pipeline.kv_host_cache_gib) == (0.5, 0.1, 4.0)
    page = browser.get(f"/pipelines/{pipeline.pk}/").content.decode()
    assert "host-tier hits worth 0.5, disk-tier hits 0.1" in page
    assert "4 GiB of host memory per replica" in page


def test_the_deploy_form_left_empty_gives_dynamos_weights_and_no_host_tier() -> None:
    make_model("smol")
    browser = logged_in(Role.OPERATOR)
    assert browser.post("/pipelines/", A_PIPELINE).status_code == 302
    pipeline = Pipeline.objects.get()
    assert (pipeline.kv_host_hit_weight, pipeline.kv_disk_hit_weight, pipeline.kv_host_cache_gib) == (0.75, 0.25, 0.0)
    assert "the GPU only" in browser.get(f"/pipelines/{pipeline.pk}/").content.decode()


def test_the_deploy_form_puts_a_host_tier_the_engine_cannot_keep_next_to_its_field() -> None:
    make_model("smol")
    response = logged_in(Role.OPERATOR).post("/pipelines/", {**A_PIPELINE, "kv_host_cache_gib": "4"})
    assert response.status_code == 400 and not Pipeline.objects.exists()
    assert field_errors(response.content.decode(), "engine args need &#x27;kv_bytes_per_token&#x27;")


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("kv_host_hit_weight", "1.5", "less than or equal to 1"),
        ("kv_disk_hit_weight", "much", "Enter a number."),
        ("kv_host_cache_gib", "-1", "greater than or equal to 0"),
        ("kv_host_cache_gib", "5000", "less than or equal to 4096"),
    ],
)
def test_the_deploy_form_refuses_a_weight_or_tier_out_of_range(field: str, value: str, error: str) -> None:
    make_model("smol")
    response = logged_in(Role.OPERATOR).post("/pipelines/", {**A_PIPELINE, field: value})
    assert response.status_code == 400 and not Pipeline.objects.exists()
    assert field_errors(response.content.decode(), error)


def test_a_disaggregated_pipeline_gets_a_prefill_and_a_decode_group_sharing_the_engine_args() -> None:
    make_model("smol")
    body = {
        **A_PIPELINE,
        "serving": "disaggregated",
        "prefill_replicas": "1",
        "prefill_gpus_per_replica": "0",
        "engine_args": json.dumps({"kv_transfer_bandwidth": 64}),
        "disagg_policy": "isl",
        "disagg_isl_threshold": "512",
        "disagg_isl_ratio": "0.5",
        "disagg_decode_busy": "0.9",
    }
    browser = logged_in(Role.OPERATOR)
    assert browser.post("/pipelines/", body).status_code == 302
    pipeline = Pipeline.objects.get()
    assert (pipeline.disagg_policy, pipeline.disagg_isl_threshold, pipeline.disagg_isl_ratio) == ("isl", 512, 0.5)
    assert pipeline.disagg_prefill_busy == 1.0  # left empty: the default
    assert pipeline.disagg_decode_busy == 0.9
    page = browser.get(f"/pipelines/{pipeline.pk}/").content.decode()
    assert "under 512 tokens and 0.5 of the prompt left to compute" in page
    groups = {group.role: group for group in pipeline.groups.all()}
    assert set(groups) == {"prefill", "decode"}
    assert (groups["prefill"].replicas, groups["decode"].replicas) == (1, 2)
    assert groups["prefill"].engine_args == groups["decode"].engine_args == {"kv_transfer_bandwidth": 64}
    assert sorted(groups["prefill"].instances.values_list("state", flat=True)) == ["pending"]


def test_a_disaggregated_pipeline_of_an_engine_that_cannot_hand_kv_over_is_refused_saying_so() -> None:
    make_model("smol", engine="echo_core")
    response = logged_in(Role.OPERATOR).post("/pipelines/", {**A_PIPELINE, "serving": "disaggregated"})
    assert response.status_code == 400
    assert field_errors(response.content.decode(), "cannot hand a prompt&#x27;s KV cache between workers yet")
    assert not Pipeline.objects.exists()


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"engine": "vllm"}, "vllm runs on GPUs; set gpus_per_replica to 1 or more"),  # the action's, form-wide
        ({"replicas": "513"}, "less than or equal to 512"),
        ({"router_temperature": "-1"}, "greater than or equal to 0"),
        ({"kv_queued_prefill_weight": "1.5"}, "less than or equal to 1"),
        ({"model": "nope"}, "Select a valid choice"),
        ({"name": "bad name!"}, "1-200 letters, digits"),
        ({"engine_args": "3"}, "A JSON object"),
        ({"disagg_policy": "sometimes"}, "Select a valid choice"),
        ({"disagg_isl_ratio": "2"}, "less than or equal to 1"),
    ],
)
def test_an_invalid_pipeline_is_shown_again_with_the_error_and_nothing_is_deployed(
    change: dict[str, str], error: str
) -> None:
    make_model("smol")
    response = logged_in(Role.OPERATOR).post("/pipelines/", {**A_PIPELINE, **change})
    assert response.status_code == 400
    assert field_errors(response.content.decode(), error), response.content.decode()
    assert not Pipeline.objects.exists() and not Instance.objects.exists()


def test_a_taken_pipeline_name_is_an_error_on_the_name() -> None:
    make_model("smol")
    browser = logged_in(Role.OPERATOR)
    assert browser.post("/pipelines/", A_PIPELINE).status_code == 302
    again = browser.post("/pipelines/", A_PIPELINE)
    assert again.status_code == 400 and field_errors(again.content.decode(), "already exists")
    assert Pipeline.objects.count() == 1


@pytest.mark.parametrize(("page", "body"), [("/models/", A_MODEL), ("/pipelines/", A_PIPELINE)])
def test_read_only_people_may_not_post_a_form(page: str, body: dict[str, str]) -> None:
    if page == "/pipelines/":
        make_model("smol")
    browser = logged_in(Role.READ_ONLY)
    entries = AuditEntry.objects.count()
    response = browser.post(page, body)
    assert response.status_code == 403
    assert not Pipeline.objects.exists() and LanguageModel.objects.count() == (page == "/pipelines/")
    assert AuditEntry.objects.count() == entries


@pytest.mark.parametrize(("page", "body"), [("/models/", A_MODEL), ("/pipelines/", A_PIPELINE)])
def test_a_form_without_its_csrf_token_is_refused(page: str, body: dict[str, str]) -> None:
    if page == "/pipelines/":
        make_model("smol")
    browser = logged_in(Role.ADMIN, enforce_csrf_checks=True)
    assert browser.post(page, body).status_code == 403
    assert not Pipeline.objects.exists() and LanguageModel.objects.count() == (page == "/pipelines/")
    # With the token from the page's form, the same post goes through.
    token = browser.get(page).context["csrf_token"]
    assert browser.post(page, {**body, "csrfmiddlewaretoken": str(token)}).status_code == 302


def test_trust_remote_code_from_an_operators_form_is_refused_on_the_engine_args_field() -> None:
    browser = logged_in(Role.OPERATOR)
    trusting = '{"trust_remote_code": true}'
    response = browser.post("/models/", {**A_MODEL, "default_engine_args": trusting})
    assert response.status_code == 400 and field_errors(response.content.decode(), "Only an admin may allow that")
    make_model("smol")
    response = browser.post("/pipelines/", {**A_PIPELINE, "engine_args": trusting})
    assert response.status_code == 400 and field_errors(response.content.decode(), "Only an admin may allow that")
    assert not Pipeline.objects.exists() and LanguageModel.objects.get().default_engine_args == {}
