"""Served model names to the ingress processes (``runtime/fleet_contract/served_names.py``): one record per pipeline,
put after each change commits and checked against the database by a Celery beat task."""

import msgspec
from django.db import transaction

from controlplane.deployments.models import Pipeline
from controlplane.etcd_records import SyncReport, put_now, sync_prefix
from runtime.fleet_contract.served_names import SERVED_NAMES_PREFIX, ServedName, etcd_key

_WHAT = "served model names"


def _value(pipeline: Pipeline) -> bytes:
    return msgspec.json.encode(ServedName(state=pipeline.state))


def publish_after_commit(pipeline: Pipeline) -> None:
    """Tell the ingresses the pipeline's name and state once the current transaction commits."""
    key, value = etcd_key(pipeline.name), _value(pipeline)
    transaction.on_commit(lambda: put_now(_WHAT, {key: value}), robust=True)


def withdraw_after_commit(name: str) -> None:
    """Tell the ingresses that ``name`` is served by no pipeline any more, once the transaction commits."""
    transaction.on_commit(lambda: put_now(_WHAT, {}, delete=[etcd_key(name)]), robust=True)


def sync() -> SyncReport:
    """Make etcd's records exactly the pipelines'. Raises DiscoveryUnavailable when etcd does not answer."""
    return sync_prefix(
        SERVED_NAMES_PREFIX, lambda: {etcd_key(pipeline.name): _value(pipeline) for pipeline in Pipeline.objects.all()}
    )
