"""Served model names to the ingress processes (``runtime/fleet_contract/served_names.py``): one record per pipeline,
and one per LoRA adapter loaded on it (with the pipeline's state), put after each change commits and checked
against the database by a Celery beat task."""

import msgspec
from django.db import transaction

from controlplane.deployments.models import Pipeline
from controlplane.etcd_records import SyncReport, put_now, sync_prefix
from runtime.fleet_contract.served_names import SERVED_NAMES_PREFIX, ServedName, etcd_key

_WHAT = "served model names"


def _value(pipeline: Pipeline) -> bytes:
    return msgspec.json.encode(ServedName(state=pipeline.state))


def _records(pipeline: Pipeline) -> dict[str, bytes]:
    """The pipeline's records: its name's and each loaded adapter's, all with its state."""
    value = _value(pipeline)
    names = [pipeline.name, *(adapter.name for adapter in pipeline.adapters.all())]
    return {etcd_key(name): value for name in names}


def publish_after_commit(pipeline: Pipeline) -> None:
    """Tell the ingresses the pipeline's name, its loaded adapters' and its state once the transaction commits."""
    records = _records(pipeline)
    transaction.on_commit(lambda: put_now(_WHAT, records), robust=True)


def withdraw_after_commit(name: str) -> None:
    """Tell the ingresses that ``name`` is served by no pipeline any more, once the transaction commits."""
    transaction.on_commit(lambda: put_now(_WHAT, {}, delete=[etcd_key(name)]), robust=True)


def sync() -> SyncReport:
    """Make etcd's records exactly the pipelines'. Raises DiscoveryUnavailable when etcd does not answer."""
    return sync_prefix(
        SERVED_NAMES_PREFIX,
        lambda: {
            key: value
            for pipeline in Pipeline.objects.prefetch_related("adapters")
            for key, value in _records(pipeline).items()
        },
    )
