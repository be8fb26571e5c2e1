"""Model downloads for the instances this node runs: Hugging Face repos into a models folder, local models checked.

A model comes from a Hugging Face repo at a revision (``HubSource``), downloaded with huggingface_hub
into ``models_dir`` (the hub's cache layout: files are shared between revisions), or from a local folder
or GGUF file (``LocalSource``), which is only checked. ``ModelDownloader.fetch`` returns the local path to
give ``flotilla run``.

A hub download runs in a process of its own (agent/download_process.py), which is killed when no start
waits for it any more (each was stopped or replaced, or the agent stops). Its files are fetched so that
an interrupted download, stopped or killed with the agent, resumes where it was (agent/hub_files.py).

Two instances never write the same files: a download holds a file lock per repo (which also keeps two
agents on one machine, sharing a models folder, apart), and concurrent fetches of one model in this
process share one download. The second comes back with the first's result, finding the files in place.

Progress is the bytes present in the repo's blob folder (partial files included) against the total size
of the files to fetch, polled every ``progress_interval_s`` (throttled by construction; independent of the
library's progress bars). The settings of huggingface_hub apply: ``HF_TOKEN`` (or ``HF_TOKEN_FILE``),
``HF_ENDPOINT``, ``HF_HUB_OFFLINE=1`` (only what the models folder already holds).
"""

import asyncio
import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import filelock
import msgspec
from huggingface_hub import HfApi, hf_hub_download, snapshot_download

from agent.download_process import DownloadJob, Progress, run_download
from agent.errors import (
    DiskFull,
    DownloadError,
    HubUnreachable,
    LocalModelInvalid,
    LocalModelMissing,
    RepoNotFound,
    RepoUnauthorized,
    SourceRefused,
)
from agent.hub_files import fetch_blobs, repo_folder
from runtime.errors import ModelError
from runtime.fleet_contract.tasks import HubSource, LocalSource, ModelSource
from runtime.models.hub_download import HubCaller, HubError, HubProblem, HubSettings, hub_error, pick_files
from runtime.models.source import HubModel, parse_hub_model, resolve_model

log = logging.getLogger(__name__)


class DownloadProgress(msgspec.Struct, frozen=True):
    """Where a download stands. ``waiting``: another download of the same repo holds its lock."""

    bytes_done: int
    bytes_total: int | None
    waiting: bool = False


ProgressCallback = Callable[[DownloadProgress], None]


class _Download:
    """One hub download under way, shared by every fetch of its source meanwhile."""

    def __init__(self) -> None:
        self.task: asyncio.Task[Path] | None = None
        self.waiters = 0
        self.listeners: list[ProgressCallback] = []


class ModelDownloader:
    """Fetches models into ``models_dir``; one per agent. ``close()`` stops the downloads under way."""

    def __init__(self, models_dir: Path, *, hub: HubSettings | None = None, progress_interval_s: float = 1.0) -> None:
        self.models_dir = models_dir
        self.hub = hub if hub is not None else HubSettings.from_environment()
        self.progress_interval_s = progress_interval_s
        self._caller = HubCaller(
            quant_tags=False,
            local_path="register the model as a local path",
            cache=str(models_dir),
            who=" for the agent",
        )
        self._running: dict[HubSource, _Download] = {}
        # Every download's task, those being stopped included, for close() to wait for.
        self._tasks: set[asyncio.Task[Path]] = set()

    async def fetch(self, source: ModelSource, on_progress: ProgressCallback | None = None) -> Path:
        """The local path of ``source``'s model, downloading it first if need be.

        ``on_progress`` is called on the event loop's thread, at most every ``progress_interval_s``. A
        download that every fetch of it gave up (cancelled) is stopped: its process is killed.
        Raises a DownloadError subclass: HubUnreachable, RepoNotFound, RepoUnauthorized, DiskFull,
        LocalModelMissing, DownloadError for anything else the hub refused (all retryable), or SourceRefused
        (LocalModelInvalid, a malformed repo id), which only a changed source fixes.
        """
        if isinstance(source, LocalSource):
            return await asyncio.to_thread(check_local_model, Path(source.path))
        download = self._running.get(source)
        if download is None:
            download = self._running[source] = _Download()
            download.task = asyncio.create_task(self._download_in_process(source, download), name=f"download {source}")
            download.task.add_done_callback(lambda task: self._finished(source, download, task))
            self._tasks.add(download.task)
        assert download.task is not None
        if on_progress is not None:
            download.listeners.append(on_progress)
        download.waiters += 1
        try:
            # Shielded: one caller giving up must not cancel the download the others wait for.
            return await asyncio.shield(download.task)
        finally:
            download.waiters -= 1
            if on_progress is not None and on_progress in download.listeners:
                download.listeners.remove(on_progress)
            if download.waiters == 0 and not download.task.done():
                log.info("stopping the download of %s: nothing waits for it any more (its partial files stay)", source)
                self._forget(source, download)
                download.task.cancel()

    async def close(self) -> None:
        """Stop the downloads under way and wait until their processes have ended."""
        self._running.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _download_in_process(self, source: HubSource, download: _Download) -> Path:
        def notify(progress: Progress) -> None:
            reported = DownloadProgress(progress.bytes_done, progress.bytes_total, progress.waiting)
            for listener in list(download.listeners):
                try:
                    listener(reported)
                except Exception:
                    log.exception("a download progress callback failed")

        job = DownloadJob(
            source=source,
            models_dir=str(self.models_dir),
            endpoint=self.hub.endpoint,
            token=self.hub.token,
            offline=self.hub.offline,
            timeout_s=self.hub.timeout_s,
            progress_interval_s=self.progress_interval_s,
            parent_pid=os.getpid(),
        )
        return await run_download(job, notify)

    def _finished(self, source: HubSource, download: _Download, task: "asyncio.Task[Path]") -> None:
        self._forget(source, download)
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a download nobody waits for any more may still fail

    def _forget(self, source: HubSource, download: _Download) -> None:
        """Let the next fetch of ``source`` start a download of its own, unless another one took its place."""
        if self._running.get(source) is download:
            del self._running[source]

    def fetch_blocking(self, source: ModelSource, report: ProgressCallback | None = None) -> Path:
        """``fetch`` in the download process (or a thread): blocks, and calls ``report`` from this and a
        polling thread. Raises what ``fetch`` raises."""
        if isinstance(source, LocalSource):
            return check_local_model(Path(source.path))
        return self._fetch_from_hub(source, report or _ignore)

    def lock_path(self, source: HubSource) -> Path:
        """The lock file of ``source``'s repo (every revision shares the repo's blobs)."""
        return self.models_dir / ".locks" / f"{repo_folder(source.repo_id)}.lock"

    def _fetch_from_hub(self, source: HubSource, report: ProgressCallback) -> Path:
        if parse_hub_model(source.repo_id) is None or ":" in source.repo_id:
            raise SourceRefused(f"{source.repo_id!r} is not a Hugging Face repo id (write org/name)")
        try:
            lock_file = self.lock_path(source)
            lock_file.parent.mkdir(parents=True, exist_ok=True)
            lock = filelock.FileLock(lock_file)
            try:
                lock.acquire(timeout=0)
            except filelock.Timeout:
                log.info("waiting for another download of %s to finish", source.repo_id)
                report(DownloadProgress(0, None, waiting=True))
                lock.acquire()
            try:
                return self._download(source, report)
            finally:
                lock.release()
        except DownloadError:
            raise
        except HubError as exc:
            raise _AGENT_ERRORS[exc.problem](str(exc)) from exc
        except Exception as exc:
            error = hub_error(exc, _hub_model(source), self.hub, self._caller)
            if error is None:
                raise DownloadError(f"downloading {source.repo_id!r} failed: {type(exc).__name__}: {exc}") from exc
            raise _AGENT_ERRORS[error.problem](str(error)) from exc

    def _download(self, source: HubSource, report: ProgressCallback) -> Path:
        """Download under the repo's lock. huggingface_hub's exceptions go out untranslated."""
        hub = self.hub
        cache = str(self.models_dir)
        if hub.offline:
            if source.file:
                path = hf_hub_download(
                    source.repo_id, source.file, revision=source.revision, cache_dir=cache, local_files_only=True
                )
            else:
                path = snapshot_download(
                    source.repo_id, revision=source.revision, cache_dir=cache, local_files_only=True
                )
            return Path(path)
        api = HfApi(endpoint=hub.endpoint, token=hub.token)
        info = api.model_info(source.repo_id, revision=source.revision, files_metadata=True, timeout=hub.timeout_s)
        sizes = {sibling.rfilename: sibling.size or 0 for sibling in info.siblings or []}
        plan = pick_files(_hub_model(source), sorted(sizes), self._caller)
        total = sum(sizes[name] for name in plan.names)
        blobs = self.models_dir / repo_folder(source.repo_id) / "blobs"
        _check_space(self.models_dir, needed=total - _bytes_in(blobs), what=source.repo_id)
        stop_polling = threading.Event()
        poller = threading.Thread(
            target=_poll_progress,
            args=(blobs, total, report, stop_polling, self.progress_interval_s),
            name=f"progress of {source.repo_id}",
            daemon=True,
        )
        poller.start()
        try:
            # Pinned to the commit model_info saw, so that every file comes from one commit. The files go
            # into the blob folder first, resuming what an interrupted download left; huggingface_hub then
            # lays out the snapshot around them.
            fetch_blobs(source.repo_id, plan.names, commit=info.sha or "main", cache=self.models_dir, hub=hub)
            if plan.file is not None:
                path = hf_hub_download(
                    source.repo_id,
                    plan.file,
                    revision=info.sha,
                    cache_dir=cache,
                    endpoint=hub.endpoint,
                    token=hub.token,
                    etag_timeout=hub.timeout_s,
                )
            else:
                path = snapshot_download(
                    source.repo_id,
                    revision=info.sha,
                    cache_dir=cache,
                    ignore_patterns=plan.ignore,
                    endpoint=hub.endpoint,
                    token=hub.token,
                    etag_timeout=hub.timeout_s,
                )
        finally:
            stop_polling.set()
            poller.join()
        report(DownloadProgress(total, total))
        log.info("downloaded %s@%s (%d bytes) into %s", source.repo_id, info.sha, total, path)
        return Path(path)


def _ignore(progress: DownloadProgress) -> None:
    del progress


def _hub_model(source: HubSource) -> HubModel:
    return HubModel(source.repo_id, source.file, source.revision)


# What each problem the hub module names is to the agent (all but a malformed source are worth a retry).
_AGENT_ERRORS: dict[HubProblem, type[DownloadError]] = {
    HubProblem.UNREACHABLE: HubUnreachable,
    HubProblem.NOT_FOUND: RepoNotFound,
    HubProblem.UNAUTHORIZED: RepoUnauthorized,
    HubProblem.NOT_CACHED: LocalModelInvalid,
    HubProblem.DISK_FULL: DiskFull,
    HubProblem.REFUSED: DownloadError,
}


def _bytes_in(folder: Path) -> int:
    """Bytes of the files in ``folder`` (partial downloads included); 0 if it does not exist."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    total = 0
    for entry in entries:
        try:
            total += entry.stat(follow_symlinks=False).st_size
        except OSError:
            continue  # renamed from .incomplete meanwhile: counted at the next poll
    return total


def _poll_progress(blobs: Path, total: int, report: ProgressCallback, stop: threading.Event, interval_s: float) -> None:
    while not stop.wait(interval_s):
        # Blobs of other revisions count too: an estimate, clamped to the total.
        report(DownloadProgress(min(total, _bytes_in(blobs)), total))


def _check_space(models_dir: Path, *, needed: int, what: str) -> None:
    """Raise DiskFull when ``models_dir``'s file system has less than ``needed`` bytes free."""
    free = shutil.disk_usage(models_dir).free
    if needed > free:
        raise DiskFull(
            f"{what} needs {_gib(needed)} more in {models_dir}, which has {_gib(free)} free: free some space "
            "or give the agent another models folder"
        )


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.1f} GiB"


def check_local_model(path: Path) -> Path:
    """``path`` if it is a Hugging Face model folder or a GGUF file. Raises LocalModelMissing (retryable: a
    file system not mounted yet) or LocalModelInvalid."""
    if not path.exists():
        raise LocalModelMissing(f"model path {str(path)!r} does not exist on this node")
    try:
        return resolve_model(str(path))
    except ModelError as exc:
        raise LocalModelInvalid(str(exc)) from exc
