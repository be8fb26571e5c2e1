from django.contrib.auth import views as auth_views
from django.urls import path, register_converter

from controlplane.api.base import ID_PATTERN
from controlplane.dashboard import (
    adapters,
    alerts,
    api_keys,
    audit_entries,
    batches,
    controls,
    edits,
    health_banner,
    hub_search,
    instance_page,
    metrics_history,
    people,
    playground,
    request_log,
    views,
)
from controlplane.dashboard.login import LoginView


class RowId:
    """A row id in a URL: digits that fit the database's integers (more is a 404, not an overflow)."""

    regex = ID_PATTERN

    def to_python(self, value: str) -> int:
        return int(value)

    def to_url(self, value: int) -> str:
        return str(value)


register_converter(RowId, "row_id")
app_name = "dashboard"
urlpatterns = [
    path("", views.overview_page, name="overview"),
    path("login/", LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("gateway/", views.gateway_section, name="gateway"),
    path("models/", views.models_page, name="models"),
    path("models/hub-search/", hub_search.hub_search, name="hub-search"),
    path("models/hub-details/", hub_search.hub_details, name="hub-details"),
    path("models/<row_id:pk>/", views.model_page, name="model"),
    path("models/<row_id:pk>/delete/", edits.model_delete, name="model-delete"),
    path("models/<row_id:pk>/adapters/", adapters.model_adapter_add, name="model-adapter-add"),
    path("models/<row_id:pk>/adapters/delete/", adapters.model_adapter_delete, name="model-adapter-delete"),
    path("pipelines/", views.pipelines_page, name="pipelines"),
    path("pipelines/<row_id:pk>/", views.pipeline_page, name="pipeline"),
    path("pipelines/<row_id:pk>/router-view/", views.pipeline_router_view, name="pipeline-router-view"),
    path("pipelines/<row_id:pk>/edit/", edits.pipeline_edit, name="pipeline-edit"),
    path("pipelines/<row_id:pk>/delete/", edits.pipeline_delete, name="pipeline-delete"),
    path("pipelines/<row_id:pk>/scale/", controls.pipeline_scale, name="pipeline-scale"),
    path("pipelines/<row_id:pk>/planner/", controls.pipeline_planner, name="pipeline-planner"),
    path("pipelines/<row_id:pk>/stop/", controls.pipeline_stop, name="pipeline-stop"),
    path("pipelines/<row_id:pk>/adapters/load/", adapters.pipeline_adapter_load, name="pipeline-adapter-load"),
    path("pipelines/<row_id:pk>/adapters/unload/", adapters.pipeline_adapter_unload, name="pipeline-adapter-unload"),
    path("pipelines/<row_id:pk>/start/", controls.pipeline_start, name="pipeline-start"),
    path("instances/<row_id:pk>/", instance_page.instance_page, name="instance"),
    path("instances/<row_id:pk>/restart/", controls.instance_restart, name="instance-restart"),
    path("instances/<row_id:pk>/log/", views.instance_log, name="instance-log"),
    path("nodes/", views.nodes_page, name="nodes"),
    path("nodes/<row_id:pk>/drain/", controls.node_drain, name="node-drain"),
    path("nodes/<row_id:pk>/undrain/", controls.node_undrain, name="node-undrain"),
    path("nodes/<row_id:pk>/cordon/", controls.node_cordon, name="node-cordon"),
    path("nodes/<row_id:pk>/uncordon/", controls.node_uncordon, name="node-uncordon"),
    path("audit/", views.audit_page, name="audit"),
    path("audit/newer/", audit_entries.audit_newer, name="audit-newer"),
    path("audit/<row_id:pk>/", audit_entries.audit_entry_page, name="audit-entry"),
    path("requests/", request_log.requests_page, name="requests"),
    path("metrics/history/", metrics_history.metrics_history, name="metrics-history"),
    path("requests/rows/", request_log.request_rows, name="request-rows"),
    path("requests/<row_id:pk>/", request_log.request_detail, name="request"),
    path("health-banner/", health_banner.health_banner, name="health-banner"),
    path("people/", people.people_page, name="people"),
    path("people/<row_id:pk>/edit/", people.person_edit, name="person-edit"),
    path("people/<row_id:pk>/deactivate/", people.person_deactivate, name="person-deactivate"),
    path("people/<row_id:pk>/reactivate/", people.person_reactivate, name="person-reactivate"),
    path("people/<row_id:pk>/reset-password/", people.person_reset_password, name="person-reset-password"),
    path("account/", people.account_page, name="account"),
    path("account/tokens/", people.own_token_create, name="own-token-create"),
    path("account/tokens/<row_id:pk>/revoke/", people.own_token_revoke, name="own-token-revoke"),
    path("api-keys/", api_keys.api_keys_page, name="api-keys"),
    path("api-keys/<row_id:pk>/revoke/", api_keys.api_key_revoke, name="api-key-revoke"),
    path("usage/", api_keys.usage_page, name="usage"),
    path("batches/", batches.batches_page, name="batches"),
    path("playground/", playground.playground_page, name="playground"),
    path("alerts/", alerts.alerts_page, name="alerts"),
    path("alerts/badge/", alerts.alerts_badge, name="alerts-badge"),
    path("alerts/summary/", alerts.alerts_summary, name="alerts-summary"),
    path("alerts/silences/", alerts.silence_create, name="silence-create"),
    path("alerts/silences/<row_id:pk>/expire/", alerts.silence_expire, name="silence-expire"),
]
