"""The request log and the metric samples.

``RequestRecord`` rows come from the gateways' records on NATS (runtime/fleet_contract/request_records.py),
stored by the live bridge (controlplane/live/bridge.py) and kept ``FLOTILLA_REQUEST_LOG_RETENTION`` (24 h by
default). They are display data a gateway sent: shown and summed, trusted for nothing else.

``MetricSample`` rows are written by the same bridge every ``SAMPLE_INTERVAL_S`` (10 s): one fleet-wide, one per
running pipeline, one per node. They are the history behind the dashboard's charts (and what alerts read, e.g.
"TTFT over a pipeline's target": ``scope=pipeline``, ``ttft_p95_s``), kept ``FLOTILLA_METRICS_RETENTION`` (24 h
by default). A figure nothing reported in the window is None, never 0: no request is not a TTFT of 0.
"""

from typing import ClassVar

from django.db import models

#: Bounds of the stored text: what the record contract allows (runtime/fleet_contract/request_records.py).
NAME_LENGTH = 256
SHORT_LENGTH = 64


class RequestRecord(models.Model):
    """One request a gateway finished (successfully or not)."""

    at = models.DateTimeField(db_index=True)  # its arrival at the gateway
    request_id = models.CharField(max_length=NAME_LENGTH, db_index=True)
    model = models.CharField(max_length=NAME_LENGTH, blank=True)  # the served name asked for
    endpoint = models.CharField(max_length=SHORT_LENGTH)  # chat, completions, responses, embeddings
    status = models.PositiveSmallIntegerField()  # the HTTP status answered
    error = models.CharField(max_length=SHORT_LENGTH, blank=True)  # OpenAI error type, "cancelled", "" on success
    api_key_id = models.BigIntegerField(null=True, blank=True)  # the ApiKey row's id; None: keys are off
    # The pipeline and instance that served it, as the bridge knew the worker's endpoint id (None: not one of
    # the control plane's, or no worker was chosen).
    pipeline = models.ForeignKey(
        "deployments.Pipeline", null=True, blank=True, on_delete=models.SET_NULL, related_name="request_records"
    )
    instance = models.ForeignKey(
        "deployments.Instance", null=True, blank=True, on_delete=models.SET_NULL, related_name="request_records"
    )
    # The router's decision (RouteChoice): the worker's endpoint id and rank, and for the KV router the chosen
    # worker's overlap, the prompt's blocks, its cost and how many workers were weighed.
    router_mode = models.CharField(max_length=SHORT_LENGTH, blank=True)
    endpoint_instance_id = models.BigIntegerField(null=True, blank=True)
    dp_rank = models.PositiveIntegerField(null=True, blank=True)
    overlap_blocks = models.PositiveIntegerField(null=True, blank=True)
    prompt_blocks = models.PositiveIntegerField(null=True, blank=True)
    cost = models.FloatField(null=True, blank=True)
    candidates = models.PositiveIntegerField(null=True, blank=True)
    prompt_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(null=True, blank=True)
    completion_tokens = models.PositiveIntegerField(default=0)
    ttft_s = models.FloatField(null=True, blank=True)
    itl_s = models.FloatField(null=True, blank=True)  # mean time between tokens after the first
    duration_s = models.FloatField(default=0.0)

    class Meta:
        ordering: ClassVar = ["-at", "-pk"]
        indexes: ClassVar = [models.Index(fields=["pipeline", "-at"], name="traffic_record_pipeline_at")]

    def __str__(self) -> str:
        return f"{self.request_id} ({self.model}, {self.status})"

    @property
    def succeeded(self) -> bool:
        return self.status < 400 and not self.error


class MetricSample(models.Model):
    """One window's figures (``window_s`` seconds ending at ``at``) for one scope.

    ``scope`` says which: ``fleet`` (pipeline and node None), ``pipeline`` (pipeline set) or ``node`` (node
    set). Request figures come from the request log's rows of the window (``requests_per_s``, ``error_rate``:
    the share of requests answered >= 400 or ended by an error, TTFT and ITL percentiles in seconds,
    ``prefix_hit_rate``: cached / prompt tokens); load figures from the workers' latest load reports
    (``queue_depth``: requests waiting, ``kv_usage`` 0..1); node figures from the agents' heartbeats (bytes, GPU
    utilisation in percent, the mean over the node's GPUs, and CPU utilisation in percent of all its CPUs).
    """

    class Scope(models.TextChoices):
        FLEET = "fleet"
        PIPELINE = "pipeline"
        NODE = "node"

    at = models.DateTimeField(db_index=True)
    window_s = models.FloatField()
    scope = models.CharField(max_length=8, choices=Scope.choices)
    pipeline = models.ForeignKey(
        "deployments.Pipeline", null=True, blank=True, on_delete=models.CASCADE, related_name="metric_samples"
    )
    node = models.ForeignKey(
        "fleet.Node", null=True, blank=True, on_delete=models.CASCADE, related_name="metric_samples"
    )
    # Requests (fleet and pipeline scopes).
    requests = models.PositiveIntegerField(default=0)
    requests_per_s = models.FloatField(null=True, blank=True)
    error_rate = models.FloatField(null=True, blank=True)
    ttft_p50_s = models.FloatField(null=True, blank=True)
    ttft_p95_s = models.FloatField(null=True, blank=True)
    ttft_p99_s = models.FloatField(null=True, blank=True)
    itl_p50_s = models.FloatField(null=True, blank=True)
    itl_p95_s = models.FloatField(null=True, blank=True)
    prefix_hit_rate = models.FloatField(null=True, blank=True)
    # Load (fleet and pipeline scopes).
    queue_depth = models.FloatField(null=True, blank=True)
    kv_usage = models.FloatField(null=True, blank=True)
    # A node (node scope).
    memory_used_bytes = models.BigIntegerField(null=True, blank=True)
    memory_total_bytes = models.BigIntegerField(null=True, blank=True)
    gpu_memory_used_bytes = models.BigIntegerField(null=True, blank=True)
    gpu_memory_total_bytes = models.BigIntegerField(null=True, blank=True)
    gpu_utilization_percent = models.FloatField(null=True, blank=True)
    cpu_utilization_percent = models.FloatField(null=True, blank=True)

    class Meta:
        ordering: ClassVar = ["at", "pk"]
        indexes: ClassVar = [
            models.Index(fields=["scope", "at"], name="traffic_sample_scope_at"),
            models.Index(fields=["pipeline", "at"], name="traffic_sample_pipeline_at"),
            models.Index(fields=["node", "at"], name="traffic_sample_node_at"),
        ]

    def __str__(self) -> str:
        return f"{self.scope} sample at {self.at:%H:%M:%S}"
