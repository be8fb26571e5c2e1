"""A start's model brought to a local path, its download's progress reported to the control plane.

A hub download is reported twice over: as the instance's state (``downloading``, with the fraction
done), which the control plane shows per instance, and as the model's download (bytes done and in all,
then done or failed), which it shows per model. The latter needs the control plane's id of the model,
which the agent learns from its list of the node's instances; when that list cannot be had, the
download is reported per instance only. A local path is checked, not copied, and reports nothing.

A llama.cpp model's multimodal projector is part of the model's download: fetched after the weights, its
progress reported per instance, and the model's "done" sent once both are there, with the projector's size on
disk (``projector_bytes``), which the catalog counts in the model's memory estimate.
"""

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

from agent.control_plane_client import (
    AgentInstance,
    ControlPlaneRefused,
    ControlPlaneUnreachable,
    DownloadReport,
    InstanceReport,
)
from agent.downloads import DownloadProgress, ModelDownloader
from agent.errors import DownloadError
from runtime.fleet_contract.tasks import LocalSource, ModelSource

log = logging.getLogger(__name__)


class DownloadReportSink(Protocol):
    """What the downloads need of the control plane: its list of the node's instances, and where a
    model's download is reported."""

    async def list_instances(self) -> list[AgentInstance]: ...

    def report_download(self, model_id: int, report: DownloadReport) -> None: ...


@dataclass(frozen=True, slots=True)
class FetchedModel:
    """Where a start's model files are on this node: its weights, and its projector when it has one."""

    path: Path
    projector: Path | None = None


class ReportedDownloads:
    """Fetches a start's model through the ModelDownloader and reports its progress, per instance (through
    ``report``) and per model; owns what the agent knows of each instance's model id."""

    def __init__(
        self,
        client: DownloadReportSink,
        downloader: ModelDownloader,
        report: Callable[[int, InstanceReport], None],
    ) -> None:
        self._client = client
        self._downloader = downloader
        self._report = report
        self._model_ids: dict[int, int] = {}  # instance id -> the control plane's model id

    def learn_models(self, rows: Iterable[AgentInstance]) -> None:
        """Note the model ids of a list of the node's instances, fetched for another reason."""
        self._model_ids.update({row.id: row.model.id for row in rows if row.model is not None})

    async def fetch(self, instance_id: int, source: ModelSource, projector: ModelSource | None = None) -> FetchedModel:
        """The local paths of a start's model and of its projector (when it has one); a hub download reports its
        progress. Raises DownloadError, saying "the projector: ..." when that is what failed."""
        if isinstance(source, LocalSource):
            path = await self._downloader.fetch(source)
            return FetchedModel(path, await self._fetch_projector(instance_id, projector))
        self._report(instance_id, InstanceReport(state="downloading", download_progress=0.0))
        model_id = await self._model_id(instance_id)
        last = DownloadProgress(0, None)

        def on_progress(progress: DownloadProgress) -> None:
            nonlocal last
            last = progress
            self._report_progress(instance_id, progress)
            if model_id is not None:
                self._client.report_download(
                    model_id,
                    DownloadReport(
                        state="downloading", bytes_done=progress.bytes_done, bytes_total=progress.bytes_total
                    ),
                )

        try:
            path = await self._downloader.fetch(source, on_progress)
            projector_path = await self._fetch_projector(instance_id, projector)
        except DownloadError as exc:
            if model_id is not None:
                self._client.report_download(
                    model_id, DownloadReport(state="failed", bytes_done=last.bytes_done, error=str(exc))
                )
            raise
        if model_id is not None:
            total = last.bytes_total if last.bytes_total is not None else last.bytes_done
            done = DownloadReport(
                state="done", bytes_done=total, bytes_total=total, projector_bytes=_size_on_disk(projector_path)
            )
            self._client.report_download(model_id, done)
        return FetchedModel(path, projector_path)

    async def _fetch_projector(self, instance_id: int, projector: ModelSource | None) -> Path | None:
        """The projector's local path (None without one), its download's progress reported as the instance's: the
        model's figures stay its weights'. Raises DownloadError saying it is the projector's."""
        if projector is None:
            return None
        try:
            if isinstance(projector, LocalSource):
                return await self._downloader.fetch(projector)
            self._report(instance_id, InstanceReport(state="downloading", download_progress=0.0))
            return await self._downloader.fetch(projector, partial(self._report_progress, instance_id))
        except DownloadError as exc:
            failure = DownloadError(f"the projector: {exc}")
            failure.retryable = exc.retryable
            raise failure from exc

    def _report_progress(self, instance_id: int, progress: DownloadProgress) -> None:
        fraction = min(1.0, progress.bytes_done / progress.bytes_total) if progress.bytes_total else 0.0
        self._report(instance_id, InstanceReport(state="downloading", download_progress=fraction))

    async def _model_id(self, instance_id: int) -> int | None:
        """The control plane's id of the instance's model (for download reports), if it can be learnt now."""
        if instance_id not in self._model_ids:
            try:
                rows = await self._client.list_instances()
            except (ControlPlaneUnreachable, ControlPlaneRefused) as exc:
                log.info("instance %d's download is not reported per model: %s", instance_id, exc)
                return None
            self.learn_models(rows)
        return self._model_ids.get(instance_id)


def _size_on_disk(path: Path | None) -> int | None:
    """A fetched file's size (None without one, or when it cannot be read: the estimate then goes without it)."""
    if path is None:
        return None
    try:
        return path.stat().st_size
    except OSError:
        return None
