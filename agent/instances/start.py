"""Carrying out an accepted start, step by step: replace, fetch, check the GPUs, launch.

::

    a worker of an older attempt runs? ──► stop it (its "stopped" is not news: agent/instances/reports.py)
    a model source? ──► fetch it (agent/reported_downloads.py) ──► failed, permanent unless retryable
        and its projector (llama.cpp's mmproj), if it has one, as part of it ──► --mmproj
    the pipeline has had adapters, or its engine takes them at no cost? ──► fetch them, write its adapter file
        (agent/adapter_files.py; an adapter that cannot be fetched is left out and logged, the start goes on)
        ──► --lora-file
    GPUs given? ──► the node has them, with the UUIDs the control plane placed on ──► failed otherwise
    launch (agent/workers/supervisor.py) ──► starting ──► ready | failed, reported as the worker goes

Which starts to carry out, and in which order with the instance's other operations, is
agent/tasks/intake.py's.
"""

import asyncio
import logging

import msgspec

from agent.adapter_files import AdapterFiles
from agent.control_plane_client import InstanceReport
from agent.errors import DownloadError, WorkerError
from agent.gpu_check import GpuMismatch, check_gpus, named_by_uuid
from agent.instances.reports import InstanceReporter
from agent.inventory import Inventory
from agent.reported_downloads import ReportedDownloads
from agent.workers.supervisor import Supervisor
from runtime.errors import ConfigError
from runtime.fleet_contract.engine_names import LORA_AT_NO_COST_ENGINES, LORA_ENGINES
from runtime.fleet_contract.tasks import StartInstance

log = logging.getLogger(__name__)


class InstanceStarter:
    """Runs a start's steps; a step that fails reports the instance failed, saying whether for good."""

    def __init__(
        self,
        supervisor: Supervisor,
        downloads: ReportedDownloads,
        inventory: Inventory,
        reports: InstanceReporter,
        adapters: AdapterFiles,
    ) -> None:
        self._supervisor = supervisor
        self._adapters = adapters
        self._downloads = downloads
        self._inventory = inventory
        self._reports = reports

    async def start(self, request: StartInstance) -> None:
        spec = request.spec
        instance_id = spec.instance_id
        if self._supervisor.status(instance_id) is not None:
            log.info("instance %d: replacing its worker with attempt %d", instance_id, request.attempt)
            with self._reports.replacing(instance_id):
                await self._supervisor.stop(instance_id)
        if request.source is not None:
            try:
                fetched = await self._downloads.fetch(instance_id, request.source, request.projector)
            except DownloadError as exc:
                # Only a source that cannot be fetched as written is permanent: a hub that rate-limits or
                # does not answer, a path not mounted yet, a full disk may be fine on the next try.
                permanent = not exc.retryable
                self._reports.report(instance_id, InstanceReport(state="failed", reason=str(exc), permanent=permanent))
                return
            spec = msgspec.structs.replace(spec, model_path=str(fetched.path))
            if fetched.projector is not None:
                spec = msgspec.structs.replace(spec, projector_path=str(fetched.projector))
        if spec.engine in LORA_ENGINES and (spec.adapter_generation > 0 or spec.engine in LORA_AT_NO_COST_ENGINES):
            try:
                lora_file = await self._adapters.apply(
                    spec.pipeline, spec.adapters, spec.adapter_generation, spec.pipeline_id
                )
            except OSError as exc:
                reason = f"cannot write the adapter file: {exc}"
                self._reports.report(instance_id, InstanceReport(state="failed", reason=reason))
                return
            spec = msgspec.structs.replace(spec, lora_file=str(lora_file))
        if spec.gpu_indexes:
            inventory = await asyncio.to_thread(self._inventory.read, self._supervisor.gpu_memory_in_use())
            try:
                check_gpus(spec, inventory.gpus)
            except GpuMismatch as exc:
                log.warning("instance %d: not started: %s", instance_id, exc)
                self._reports.report(
                    instance_id, InstanceReport(state="failed", reason=f"cannot start the worker: {exc}")
                )
                return
            spec = named_by_uuid(spec, inventory.gpus)
        try:
            self._supervisor.start(spec)
        except (ConfigError, WorkerError) as exc:
            permanent = isinstance(exc, ConfigError)  # the spec itself is wrong: the same start fails again
            reason = f"cannot start the worker: {exc}"
            self._reports.report(instance_id, InstanceReport(state="failed", reason=reason, permanent=permanent))
