"""controlplane.dashboard.partials: each renders one element with its record's id (a list, its list's id),
and a deleted record raises that model's DoesNotExist (the contract with the live updates)."""

import functools
import re
from collections.abc import Callable

import msgspec
import pytest
from django.db import connection
from django.db.models import Model
from django.test.utils import CaptureQueriesContext

from controlplane.audit.models import AuditEntry
from controlplane.audit.records import Actor
from controlplane.dashboard import partials
from controlplane.deployments.evacuation import drain_node
from controlplane.deployments.models import Instance, Pipeline, WorkerGroup
from controlplane.deployments.pipelines import GroupSpec, deploy_pipeline, scale_pipeline, stop_pipeline
from controlplane.deployments.upkeep import place_pending_instances
from controlplane.fleet.actions import register_node, report_download
from controlplane.fleet.models import Download, Node
from runtime.fleet_contract.reports import DownloadReport
from tests.controlplane.factories import TEST_ACTOR, deploy, make_model, make_node, node_report, run_instance

pytestmark = pytest.mark.django_db


def top_level_tag(html: str) -> str:
    """The first element's opening tag."""
    match = re.match(r"\s*(<[a-z]+[^>]*>)", html)
    assert match, html[:200]
    return match.group(1)


def ready_instance() -> Instance:
    make_node("gpu-a", gpus_gib=(24, 24))
    deploy("chat", replicas=1, gpus_per_replica=2)
    place_pending_instances(TEST_ACTOR)
    return run_instance(Instance.objects.select_related("node", "pipeline", "group").get())


def test_a_node_renders_as_its_row_with_gpu_bars_and_a_drain_button() -> None:
    node = make_node("gpu-a", gpus_gib=(24, 80))
    html = partials.render_node(node.pk, can_act=True)
    assert top_level_tag(html) == f'<div id="node-{node.pk}" class="tr" role="row">'
    assert html.count("<meter") == 4  # memory and utilisation of each GPU
    assert "#1 Simulated GPU" in html and "80 GiB" in html
    assert f'hx-post="/nodes/{node.pk}/drain/"' in html and 'class="td act"' in html
    assert "csrfmiddlewaretoken" not in html  # the same HTML goes to every browser


def test_a_draining_node_offers_undrain() -> None:
    node = drain_node(TEST_ACTOR, make_node("gpu-a"))
    html = partials.render_node(node.pk, can_act=True)
    assert "draining" in html and f'hx-post="/nodes/{node.pk}/undrain/"' in html and "/drain/" not in html


def test_a_pipeline_row_shows_ready_over_desired_engine_router_and_its_controls() -> None:
    instance = ready_instance()
    html = partials.render_pipeline_row(instance.pipeline_id, can_act=True)
    assert top_level_tag(html) == f'<div id="pipeline-{instance.pipeline_id}" class="tr" role="row">'
    assert '<div class="td full" role="cell">1 / 1</div>' in html and "round-robin" in html
    assert '<div class="td" role="cell">mocker</div>' in html
    assert f'hx-post="/pipelines/{instance.pipeline_id}/scale/"' in html and 'name="replicas"' in html
    assert "/stop/" in html and "/start/" not in html


def test_a_stopped_pipeline_row_offers_start_instead_of_scale_and_stop() -> None:
    pipeline = stop_pipeline(TEST_ACTOR, deploy("chat"))
    html = partials.render_pipeline_row(pipeline.pk, can_act=True)
    assert "/start/" in html and "/stop/" not in html and "/scale/" not in html


def test_a_stopped_pipeline_row_shows_its_kept_replica_count_and_that_it_is_stopped() -> None:
    pipeline = stop_pipeline(TEST_ACTOR, deploy("chat", replicas=2))
    html = partials.render_pipeline_row(pipeline.pk, can_act=True)
    assert '<div class="td full" role="cell">0 / 2 <span class="hint">stopped</span></div>' in html, html


def test_an_instance_renders_state_node_gpus_restarts_and_its_buttons() -> None:
    instance = ready_instance()
    html = partials.render_instance(instance.pk, can_act=True)
    assert top_level_tag(html) == f'<div id="instance-{instance.pk}" class="tr" role="row">'
    assert "state-ready" in html and "gpu-a" in html and "#0, #1" in html
    assert f'hx-post="/instances/{instance.pk}/restart/"' in html and f'hx-get="/instances/{instance.pk}/log/"' in html


def test_a_downloading_instance_shows_its_progress() -> None:
    make_node("gpu-a")
    deploy("chat")
    place_pending_instances(TEST_ACTOR)
    instance = Instance.objects.get()
    Instance.objects.filter(pk=instance.pk).update(state="downloading", download_progress=0.25)
    html = partials.render_instance(instance.pk, can_act=True)
    assert '<progress max="1" value="0.25">' in html and "25%" in html


def test_an_instance_load_is_text_and_data_attributes_for_the_charts() -> None:
    instance = ready_instance()
    load = {
        "instance_id": 77,
        "kv_usage": 0.425,
        "prefix_hit_rate": 0.5,
        "running": 3,
        "waiting": 1,
        "at": 1700000000.5,
    }
    html = partials.render_instance_load(instance.pk, load)
    tag = top_level_tag(html)
    assert tag.startswith(f'<div id="load-{instance.pk}" class="load" data-instance="{instance.pk}"')
    for attribute in ('data-at="1700000000.500"', 'data-kv-usage="0.425"', 'data-prefix-hit-rate="0.5"'):
        assert attribute in tag
    assert 'data-running="3"' in tag and 'data-waiting="1"' in tag and "data-tokens-per-s" not in tag
    assert "KV cache <strong>42%</strong>" in html and "<strong>3</strong> running" in html


def test_an_instance_load_says_what_the_worker_did_in_disaggregated_serving() -> None:
    instance = ready_instance()
    prefill = partials.render_instance_load(instance.pk, {"prefills": 12, "prefill_ms": 41.26, "handoffs": 0})
    assert "<strong>12</strong> prompts prefilled, <strong>41.3</strong> ms each" in prefill
    assert "<strong>0</strong> KV handoffs taken</span>" in prefill
    decode = partials.render_instance_load(instance.pk, {"handoffs": 7, "handoff_first_token_ms": 9.0})
    assert "<strong>7</strong> KV handoffs taken, first token <strong>9.0</strong> ms" in decode
    assert "prefilled" not in decode


def disaggregated_groups() -> dict[str, WorkerGroup]:
    groups = [GroupSpec(role="prefill", replicas=2), GroupSpec(role="decode")]
    pipeline = deploy_pipeline(TEST_ACTOR, name="split", model=make_model("smol"), groups=groups)
    return {group.role: group for group in pipeline.groups.all()}


def test_a_prefill_groups_phases_show_its_prompts_their_rate_and_mean_time() -> None:
    group = disaggregated_groups()["prefill"]
    phases = {"instances": 2, "prefills": 120, "handoffs": 0, "prefills_per_s": 3.5, "prefill_ms": 41.26}
    html = partials.render_group_phases(group.pk, phases)
    assert (
        top_level_tag(html)
        == f'<div id="phases-{group.pk}" class="load phases" data-group="{group.pk}" data-role="prefill">'
    )
    assert "Prefill group" in html and "(2 instances)" in html
    assert "<strong>120</strong> prompts prefilled, <strong>3.5</strong>/s, <strong>41.3</strong> ms each" in html
    assert "handoffs" not in html  # a prefill group takes none


def test_a_decode_groups_phases_show_its_handoffs_and_without_any_in_the_interval_no_mean() -> None:
    group = disaggregated_groups()["decode"]
    busy = partials.render_group_phases(group.pk, {"handoffs": 7, "handoffs_per_s": 2.0, "handoff_first_token_ms": 9.0})
    assert "<strong>7</strong> KV handoffs taken, <strong>2.0</strong>/s, first token <strong>9.0</strong> ms" in busy
    assert "prefilled" not in busy
    quiet = partials.render_group_phases(group.pk, {"instances": 1, "handoffs": 7, "handoffs_per_s": 0.0})
    assert "<strong>7</strong> KV handoffs taken, <strong>0.0</strong>/s</span>" in quiet and "(1 instance)" in quiet


def test_a_groups_phases_before_any_count_say_so() -> None:
    group = disaggregated_groups()["decode"]
    html = partials.render_group_phases(group.pk, None)
    assert "Decode group" in html and "nothing counted yet" in html and "<strong>" not in html


def test_an_instance_load_shows_each_lower_tiers_use_and_hits_beside_the_devices() -> None:
    instance = ready_instance()
    load = {
        "kv_usage": 0.5,
        "prefix_hit_rate": 0.25,
        "tiers": [
            {"medium": "cpu", "used_blocks": 120, "total_blocks": 4000, "usage": 0.03, "hit_rate": 0.4},
            {"medium": "disk", "usage": 0.5},
        ],
    }
    html = partials.render_instance_load(instance.pk, load)
    prefix_hits = html.index("prefix hits <strong>25%</strong>")
    host_tier = '<span class="tier" data-tier="host">host tier <strong>3%</strong> (120 of 4000 blocks), '
    host = html.index(host_tier + "hits <strong>40%</strong></span>")
    assert prefix_hits < host  # next to the device's figures
    assert '<span class="tier" data-tier="disk">disk tier <strong>50%</strong></span>' in html


def test_an_instance_load_without_tiers_shows_none() -> None:
    instance = ready_instance()
    html = partials.render_instance_load(instance.pk, {"kv_usage": 0.5, "prefix_hit_rate": 0.25})
    assert "tier" not in html


def test_an_instance_load_skips_tiers_it_cannot_read() -> None:
    instance = ready_instance()
    tiers = [{"medium": "gpu", "usage": 0.5}, "cpu", {"medium": "cpu", "usage": "full", "hit_rate": 0.5}]
    html = partials.render_instance_load(instance.pk, {"tiers": tiers})
    assert html.count('class="tier"') == 1
    assert '<span class="tier" data-tier="host">host tier, hits <strong>50%</strong></span>' in html


def test_an_instance_load_leaves_out_what_is_missing_or_not_a_number() -> None:
    instance = ready_instance()
    html = partials.render_instance_load(instance.pk, {"active_requests": 2, "kv_usage": "lots", "tokens_per_s": 812.5})
    tag = top_level_tag(html)
    assert "data-kv-usage" not in tag and 'data-tokens-per-s="812.5"' in tag and "data-at=" in tag
    assert "<strong>2</strong> active" in html and "<strong>813</strong> tokens/s" in html


def test_an_audit_entry_comes_wrapped_to_go_to_the_top_of_the_feed() -> None:
    deploy("chat")
    entry = AuditEntry.objects.filter(action="pipeline.deploy").get()
    html = partials.render_audit_entry(entry.pk)
    assert html.startswith('<ul hx-swap-oob="afterbegin:#audit-feed"><li id="audit-')
    assert f'<li id="audit-{entry.pk}">' in html and "pipeline.deploy" in html and "system:tests" in html
    assert html.endswith("</li>\n</ul>")


def test_a_download_renders_its_progress_and_state() -> None:
    make_node("gpu-a")
    pipeline = deploy("chat")
    report = DownloadReport(state="downloading", bytes_done=1 << 30, bytes_total=4 << 30)
    report_download(Actor.agent("gpu-a"), "gpu-a", pipeline.model_id, report)
    download = Download.objects.get()
    html = partials.render_download(download.pk)
    assert top_level_tag(html) == f'<div id="download-{download.pk}" class="tr" role="row">'
    assert '<progress max="1" value="0.25">' in html and "1 GiB of 4 GiB" in html and "state-downloading" in html


def test_the_instances_of_a_pipeline_come_with_a_chart_panel_each() -> None:
    instance = ready_instance()
    html = partials.render_pipeline_instances(instance.pipeline_id, can_act=True)
    assert top_level_tag(html) == f'<div id="instances-{instance.pipeline_id}">'
    assert f'<div id="instance-{instance.pk}" class="tr"' in html and f'<div id="load-{instance.pk}"' in html
    assert html.count(f'data-instance="{instance.pk}" data-chart=') == 3


def test_the_node_table_holds_each_nodes_row_as_pushed_alone() -> None:
    a, b = make_node("gpu-a", gpus_gib=(24,)), make_node("gpu-b", gpus_gib=())
    html = partials.render_node_table(can_act=True)
    assert top_level_tag(html) == '<div id="nodes-table">'
    assert partials.render_node(a.pk, can_act=True) in html and partials.render_node(b.pk, can_act=True) in html
    assert html.index("gpu-a") < html.index("gpu-b")


def test_the_pipeline_table_holds_each_pipelines_row_as_pushed_alone() -> None:
    instance = ready_instance()
    other = deploy("another")
    html = partials.render_pipeline_table(can_act=True)
    assert top_level_tag(html) == '<div id="pipelines-table">'
    for pipeline_id in (instance.pipeline_id, other.pk):
        assert partials.render_pipeline_row(pipeline_id, can_act=True) in html


def test_the_download_table_holds_each_downloads_row_as_pushed_alone() -> None:
    make_node("gpu-a")
    make_node("gpu-b")
    model = make_model("smol")
    for node in ("gpu-a", "gpu-b"):
        report_download(Actor.agent(node), node, model.pk, DownloadReport(state="downloading", bytes_done=1))
    html = partials.render_download_table()
    assert top_level_tag(html) == '<div id="downloads-table">'
    for download in Download.objects.all():
        assert partials.render_download(download.pk) in html


def test_the_model_table_lists_the_catalog_with_each_models_pipeline_count() -> None:
    used, unused = make_model("used"), make_model("unused")
    deploy("chat", used)
    html = partials.render_model_table()
    assert top_level_tag(html) == '<div id="models-table">'
    for model, count in ((used, 1), (unused, 0)):
        row = re.search(rf'<tr id="model-{model.pk}">(.*?)</tr>', html, re.DOTALL)
        assert row and re.findall(r"<td>([^<]*)</td>", row.group(1))[-1] == str(count)


@pytest.mark.parametrize(
    ("render", "empty"),
    [
        (functools.partial(partials.render_node_table, can_act=True), "No nodes yet: start an agent with"),
        (
            functools.partial(partials.render_pipeline_table, can_act=True),
            "No pipelines yet: deploy a model with the form on the",
        ),
        (partials.render_download_table, "No downloads yet"),
        (partials.render_model_table, "No models yet."),  # the hint about the form is for pages that have it
    ],
)
def test_an_empty_list_renders_its_element_with_what_to_do(render: Callable[[], str], empty: str) -> None:
    html = render()
    assert top_level_tag(html).startswith('<div id="') and empty in html


def test_no_list_id_starts_like_a_rows_so_that_a_selector_of_rows_finds_rows_only() -> None:
    lists = (partials.NODE_TABLE_ID, partials.PIPELINE_TABLE_ID, partials.DOWNLOAD_TABLE_ID, partials.MODEL_TABLE_ID)
    for list_id in lists:
        for row_prefix in ("node-", "pipeline-", "download-", "model-", "instance-", "instances-"):
            assert not list_id.startswith(row_prefix)


DELETIONS: list[tuple[str, Callable[[int], str]]] = [
    ("node", functools.partial(partials.render_node, can_act=True)),
    ("pipeline", functools.partial(partials.render_pipeline_row, can_act=True)),
    ("pipeline", functools.partial(partials.render_pipeline_instances, can_act=True)),
    ("instance", functools.partial(partials.render_instance, can_act=True)),
    ("instance", lambda pk: partials.render_instance_load(pk, {"kv_usage": 0.1})),
    ("group", lambda pk: partials.render_group_phases(pk, {"prefills": 1})),
    ("entry", partials.render_audit_entry),
    ("download", partials.render_download),
]


@pytest.mark.parametrize(("kind", "render"), DELETIONS)
def test_a_deleted_record_raises_its_models_does_not_exist(kind: str, render: Callable[[int], str]) -> None:
    instance = ready_instance()
    report_download(Actor.agent("gpu-a"), "gpu-a", instance.pipeline.model_id, DownloadReport(state="done"))
    records: dict[str, Model] = {
        "node": Node.objects.get(),
        "pipeline": Pipeline.objects.get(),
        "instance": Instance.objects.get(),
        "group": WorkerGroup.objects.get(),
        "entry": AuditEntry.objects.latest("id"),
        "download": Download.objects.get(),
    }
    record = records[kind]
    assert f"-{record.pk}" in render(record.pk)  # renders while the record exists
    record.delete()
    with pytest.raises(type(record).DoesNotExist):
        render(record.pk)


def controls(render: Callable[..., str]) -> dict[str, bool]:
    """The arguments a partial with controls needs (those of a person who may act)."""
    with_controls = (
        partials.render_node,
        partials.render_pipeline_row,
        partials.render_instance,
        partials.render_node_table,
        partials.render_pipeline_table,
    )
    return {"can_act": True} if render in with_controls else {}


@pytest.mark.parametrize(
    ("render", "most"),
    [
        (partials.render_node, 3),  # the node, its GPUs, its instances (links to their pages)
        (partials.render_pipeline_row, 3),
        (partials.render_instance, 1),
        (partials.render_download, 1),
        (partials.render_audit_entry, 1),
    ],
)
def test_each_partial_reads_in_a_fixed_handful_of_queries(render: Callable[[int], str], most: int) -> None:
    instance = ready_instance()
    report_download(Actor.agent("gpu-a"), "gpu-a", instance.pipeline.model_id, DownloadReport(state="done"))
    ids = {
        partials.render_node: instance.node_id,
        partials.render_pipeline_row: instance.pipeline_id,
        partials.render_instance: instance.pk,
        partials.render_download: Download.objects.get().pk,
        partials.render_audit_entry: AuditEntry.objects.latest("id").pk,
    }
    with CaptureQueriesContext(connection) as queries:
        render(ids[render], **controls(render))
    assert len(queries) <= most, [query["sql"] for query in queries]


def test_no_partial_has_table_markup_so_that_any_of_them_can_share_a_websocket_message() -> None:
    # The HTML parser drops a <tr> after a <div> and misplaces a <table> after a <tr>: rows are <div>s.
    instance = ready_instance()
    report_download(Actor.agent("gpu-a"), "gpu-a", instance.pipeline.model_id, DownloadReport(state="done"))
    html = "".join(
        [
            partials.render_node_table(can_act=True),
            partials.render_pipeline_table(can_act=True),
            partials.render_download_table(),
            partials.render_node(instance.node_id, can_act=True),
            partials.render_pipeline_row(instance.pipeline_id, can_act=True),
            partials.render_pipeline_instances(instance.pipeline_id, can_act=True),
            partials.render_instance(instance.pk, can_act=True),
            partials.render_instance_load(instance.pk, {"kv_usage": 0.5}),
            partials.render_audit_entry(AuditEntry.objects.latest("id").pk),
            partials.render_download(Download.objects.get().pk),
        ]
    )
    assert not re.search(r"<(table|thead|tbody|tr|td|th)\b", html)


@pytest.mark.parametrize(
    ("render", "most", "row_id", "rows"),
    [
        (partials.render_node_table, 3, 'id="node-', 2),
        (partials.render_pipeline_table, 3, 'id="pipeline-', 2),
        (partials.render_download_table, 1, 'id="download-', 4),
        (partials.render_model_table, 1, 'id="model-', 2),
    ],
)
def test_each_list_reads_in_a_fixed_handful_of_queries_however_long(
    render: Callable[[], str], most: int, row_id: str, rows: int
) -> None:
    for name in ("gpu-a", "gpu-b"):
        make_node(name, gpus_gib=(24, 24))
    for name in ("alpha", "beta"):
        pipeline = deploy(name, replicas=2)
        for node in ("gpu-a", "gpu-b"):
            report_download(Actor.agent(node), node, pipeline.model_id, DownloadReport(state="done"))
    place_pending_instances(TEST_ACTOR)
    with CaptureQueriesContext(connection) as queries:
        html = render(**controls(render))
    assert len(queries) <= most, [query["sql"] for query in queries]
    assert html.count(row_id) == rows


def test_the_model_table_is_a_whole_table_inside_its_element() -> None:
    # Its rows are <tr>s and never pushed alone: whole, the table parses the same anywhere in a message.
    make_model("smol")
    html = partials.render_model_table()
    inside = re.fullmatch(r'\s*<div id="models-table">\s*<table>(.*)</table>\s*</div>\s*', html, re.DOTALL)
    assert inside and "<table" not in inside.group(1) and "</div>" not in inside.group(1)


def test_a_pending_gpu_instance_on_a_fleet_without_gpus_shows_what_it_asked_for_and_why_it_waits() -> None:
    make_node("cpu-a", ())
    pipeline = deploy("chat", gpus_per_replica=2)
    place_pending_instances(TEST_ACTOR)
    html = partials.render_instance(pipeline.instances.get().pk, can_act=True)
    assert "2 GPUs asked" in html and ">CPU<" not in html, html
    assert "needs 2 unused GPUs" in html and "no node that can take new instances has a GPU" in html, html


def test_more_cpu_instances_than_a_nodes_cpus_are_placed_with_a_warning_on_the_node_and_the_instances() -> None:
    node = register_node(Actor.agent("cpu-a"), "cpu-a", msgspec.structs.replace(node_report(()), cpu_count=2))
    pipeline = deploy("chat", replicas=4)
    place_pending_instances(TEST_ACTOR)
    assert pipeline.instances.filter(node=node).count() == 4  # a warning, not a refusal
    warning = "4 CPU instances on 2 CPUs"
    assert warning in partials.render_node(node.pk, can_act=True)
    assert warning in partials.render_instance(pipeline.instances.first().pk, can_act=True)  # type: ignore[union-attr]
    scale_pipeline(TEST_ACTOR, pipeline, 2)
    assert "CPU instances on" not in partials.render_node(node.pk, can_act=True)  # the 2 stopping ones no longer count


def test_an_engine_that_reports_no_kv_figures_says_so_instead_of_leaving_the_charts_unexplained() -> None:
    instance = ready_instance()
    llama_cpp = partials.render_instance_load(instance.pk, {"at": 1700000000.0, "active_requests": 2})
    assert "the engine reports no KV cache figures" in llama_cpp and "<strong>2</strong> active" in llama_cpp
    mocker = partials.render_instance_load(instance.pk, {"kv_usage": 0.5, "prefix_hit_rate": 0.25})
    assert "reports no KV" not in mocker
