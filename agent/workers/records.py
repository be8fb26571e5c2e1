"""The supervisor's memory across its own restarts: one small JSON file per running worker.

A record says which process runs which spec (pid, start time, boot id: see agent/workers/processes.py) and
where its log is, so that a new agent adopts the workers the previous one left running. Written
atomically (a temporary file renamed over the old one): a crash mid-write leaves the old record.
"""

import logging
import os
from pathlib import Path

import msgspec

from runtime.fleet_contract.tasks import WorkerSpec

log = logging.getLogger(__name__)


class WorkerRecord(msgspec.Struct, kw_only=True):
    """One running worker, as the agent that started it recorded it."""

    spec: WorkerSpec
    pid: int
    start_time: int  # clock ticks since boot (/proc/<pid>/stat)
    boot_id: str
    log_path: str
    endpoint_instance_id: int | None = None
    #: The mark in its processes' environment (runtime/process_tree.py); "" in records of older agents.
    tree_mark: str = ""
    # Records of older agents also carry ``restarts`` (restarts by the agent itself, always 0 since the
    # control plane decides restarts): an unknown field, ignored when they are read.


_decoder = msgspec.json.Decoder(WorkerRecord)


def record_path(state_dir: Path, instance_id: int) -> Path:
    return state_dir / f"worker-{instance_id}.json"


def save_record(state_dir: Path, record: WorkerRecord) -> None:
    """Write ``record`` atomically. Raises OSError (a full or read-only disk)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = record_path(state_dir, record.spec.instance_id)
    temporary = path.with_suffix(".tmp")
    temporary.write_bytes(msgspec.json.encode(record))
    os.replace(temporary, path)


def remove_record(state_dir: Path, instance_id: int) -> None:
    record_path(state_dir, instance_id).unlink(missing_ok=True)


def load_records(state_dir: Path) -> list[WorkerRecord]:
    """Every readable record in ``state_dir``; an unreadable one is logged and left for a person to look at."""
    records = []
    for path in sorted(state_dir.glob("worker-*.json")):
        try:
            records.append(_decoder.decode(path.read_bytes()))
        except (OSError, msgspec.DecodeError) as exc:
            log.warning("cannot read the worker record %s (%s): its worker, if any, is not adopted", path, exc)
    return records
