"""Model downloads for the instances this node runs: Hugging Face repos into a models folder, local models checked.

A model comes from a Hugging Face repo at a revision (``HubSource``), downloaded with huggingface_hub
into ``models_dir`` (the hub's cache layout: files are shared between revisions, and an interrupted
download resumes from its ``.incomplete`` files), or from a local folder or GGUF file (``LocalSource``),
which is only checked. ``ModelDownloader.fetch`` returns the local path to give ``flotilla run``.

Two instances never write the same files: a download holds a file lock per repo (which also keeps two
agents on one machine, sharing a models folder, apart), and concurrent fetches of one model in this
process share one download. The second comes back with the first's result, finding the files in place.

Progress is the bytes present in the repo's blob folder against the total size of the files to fetch,
polled every ``progress_interval_s`` (throttled by construction; independent of the library's progress
bars). The settings of huggingface_hub apply: ``HF_TOKEN`` (or ``HF_TOKEN_FILE``), ``HF_ENDPOINT``,
``HF_HUB_OFFLINE=1`` (only what the models folder already holds).
"""

import asyncio
import errno
import fnmatch
import logging
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import filelock
import httpx2  # huggingface_hub's HTTP client; its transport errors mean the hub is unreachable
import msgspec
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    DisabledRepoError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from agent.errors import (
    DiskFull,
    DownloadError,
    HubUnreachable,
    LocalModelInvalid,
    RepoNotFound,
    RepoUnauthorized,
)
from runtime.config import env_bool, env_float, env_str
from runtime.errors import ModelError
from runtime.fleet_tasks import HubSource, LocalSource, ModelSource
from runtime.hub_download import SKIPPED_WITH_SAFETENSORS
from runtime.model_source import HF_FOLDER_FILES, parse_hub_model, resolve_model

log = logging.getLogger(__name__)


class DownloadProgress(msgspec.Struct, frozen=True):
    """Where a download stands. ``waiting``: another download of the same repo holds its lock."""

    bytes_done: int
    bytes_total: int | None
    waiting: bool = False


ProgressCallback = Callable[[DownloadProgress], None]


@dataclass(frozen=True)
class HubSettings:
    """How to reach the hub; ``from_environment()`` reads huggingface_hub's own variables."""

    endpoint: str | None = None
    token: str | None = None
    offline: bool = False
    timeout_s: float = 10.0

    @classmethod
    def from_environment(cls) -> "HubSettings":
        """HF_ENDPOINT, HF_TOKEN (or HF_TOKEN_FILE), HF_HUB_OFFLINE, HF_HUB_ETAG_TIMEOUT. Raises ConfigError."""
        return cls(
            endpoint=env_str("HF_ENDPOINT") or None,
            token=env_str("HF_TOKEN") or None,
            offline=env_bool("HF_HUB_OFFLINE", False),
            timeout_s=env_float("HF_HUB_ETAG_TIMEOUT", 10.0, minimum=0.1),
        )


class ModelDownloader:
    """Fetches models into ``models_dir``; one per agent."""

    def __init__(self, models_dir: Path, *, hub: HubSettings | None = None, progress_interval_s: float = 1.0) -> None:
        self.models_dir = models_dir
        self.hub = hub if hub is not None else HubSettings.from_environment()
        self.progress_interval_s = progress_interval_s
        # In-flight downloads by source, shared by every fetch of that source meanwhile.
        self._running: dict[ModelSource, asyncio.Future[Path]] = {}
        self._listeners: dict[ModelSource, list[ProgressCallback]] = {}

    async def fetch(self, source: ModelSource, on_progress: ProgressCallback | None = None) -> Path:
        """The local path of ``source``'s model, downloading it first if need be.

        ``on_progress`` is called on the event loop's thread, at most every ``progress_interval_s``.
        Raises a DownloadError subclass: HubUnreachable (retryable), RepoNotFound, RepoUnauthorized,
        DiskFull, LocalModelInvalid, or DownloadError for anything else the hub refused.
        """
        listeners = self._listeners.setdefault(source, [])
        if on_progress is not None:
            listeners.append(on_progress)
        running = self._running.get(source)
        if running is None:
            loop = asyncio.get_running_loop()

            def report(progress: DownloadProgress) -> None:
                # Called from the download's threads: hand it to the loop, where the listeners live.
                loop.call_soon_threadsafe(self._notify, source, progress)

            running = asyncio.ensure_future(asyncio.to_thread(self.fetch_blocking, source, report))
            self._running[source] = running
            running.add_done_callback(lambda _: self._forget(source))
        try:
            # Shielded: one caller giving up must not cancel the download the others wait for.
            return await asyncio.shield(running)
        finally:
            if on_progress is not None and on_progress in listeners:
                listeners.remove(on_progress)

    def _notify(self, source: ModelSource, progress: DownloadProgress) -> None:
        for listener in list(self._listeners.get(source, ())):
            try:
                listener(progress)
            except Exception:
                log.exception("a download progress callback failed")

    def _forget(self, source: ModelSource) -> None:
        self._running.pop(source, None)
        self._listeners.pop(source, None)

    def fetch_blocking(self, source: ModelSource, report: ProgressCallback | None = None) -> Path:
        """``fetch`` for a thread: blocks, and calls ``report`` from this and a polling thread."""
        if isinstance(source, LocalSource):
            return check_local_model(Path(source.path))
        return self._fetch_from_hub(source, report or _ignore)

    def lock_path(self, source: HubSource) -> Path:
        """The lock file of ``source``'s repo (every revision shares the repo's blobs)."""
        return self.models_dir / ".locks" / f"{_repo_folder(source.repo_id)}.lock"

    def _fetch_from_hub(self, source: HubSource, report: ProgressCallback) -> Path:
        if parse_hub_model(source.repo_id) is None or ":" in source.repo_id:
            raise DownloadError(f"{source.repo_id!r} is not a Hugging Face repo id (write org/name)")
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
        except Exception as exc:
            raise translate_hub_error(exc, source, self.hub, self.models_dir) from exc

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
        files, ignore = _plan(source, sorted(sizes))
        total = sum(sizes[name] for name in files)
        blobs = self.models_dir / _repo_folder(source.repo_id) / "blobs"
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
            # Pinned to the commit model_info saw, so that every file comes from one commit.
            if len(files) == 1 and ignore is None:
                path = hf_hub_download(
                    source.repo_id,
                    files[0],
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
                    ignore_patterns=ignore,
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


def _repo_folder(repo_id: str) -> str:
    """The hub cache's folder name of a model repo (``models--org--name``)."""
    return "models--" + repo_id.replace("/", "--")


def _plan(source: HubSource, files: list[str]) -> tuple[list[str], list[str] | None]:
    """(the files to fetch, the ignore patterns for a snapshot, or None to fetch one file). Raises RepoNotFound."""
    if source.file is not None:
        if source.file not in files:
            raise RepoNotFound(
                f"Hugging Face repo {source.repo_id!r} at {source.revision!r} has no file {source.file!r}"
            )
        return [source.file], None
    ggufs = [name for name in files if name.endswith(".gguf")]
    if not any(name in files for name in HF_FOLDER_FILES):
        if len(ggufs) == 1:
            return ggufs, None
        if ggufs:
            raise DownloadError(
                f"Hugging Face repo {source.repo_id!r} holds {len(ggufs)} GGUF files: name the one to serve "
                f"as the model's file (e.g. {ggufs[0]!r})"
            )
        raise DownloadError(
            f"Hugging Face repo {source.repo_id!r} has no config.json, tokenizer.json or .gguf file, "
            "so it is not a model Flotilla can run"
        )
    ignore = ["*.gguf"]
    if any(name.endswith(".safetensors") for name in files):
        ignore += SKIPPED_WITH_SAFETENSORS
    # The same matching as huggingface_hub's own filter of ignore_patterns (fnmatch on the whole path).
    kept = [name for name in files if not any(fnmatch.fnmatch(name, pattern) for pattern in ignore)]
    return kept, ignore


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
    """``path`` if it is a Hugging Face model folder or a GGUF file. Raises LocalModelInvalid."""
    if not path.exists():
        raise LocalModelInvalid(f"model path {str(path)!r} does not exist on this node")
    try:
        return resolve_model(str(path))
    except ModelError as exc:
        raise LocalModelInvalid(str(exc)) from exc


def translate_hub_error(exc: BaseException, source: HubSource, hub: HubSettings, models_dir: Path) -> DownloadError:
    """The DownloadError that says what to do about ``exc``, raised while fetching ``source``."""
    repo = source.repo_id
    where = hub.endpoint or "https://huggingface.co"
    # GatedRepoError is a RepositoryNotFoundError, and every HfHubHTTPError is an OSError: order matters.
    if isinstance(exc, GatedRepoError):
        return RepoUnauthorized(
            f"Hugging Face repo {repo!r} is gated: accept its terms on the hub, then set HF_TOKEN for the agent "
            "to a token of an account that has access"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return RepoNotFound(
            f"Hugging Face repo {repo!r} does not exist, or is private: check the name, or set HF_TOKEN for the "
            "agent to a token that can read it"
        )
    if isinstance(exc, RevisionNotFoundError):
        return RepoNotFound(f"Hugging Face repo {repo!r} has no revision {source.revision!r}")
    if isinstance(exc, RemoteEntryNotFoundError):
        return RepoNotFound(f"Hugging Face repo {repo!r} at {source.revision!r} lacks a file: {exc}")
    if isinstance(exc, DisabledRepoError):
        return RepoNotFound(f"Hugging Face repo {repo!r} has been disabled by its owner or the hub")
    if isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled)) and hub.offline:
        return LocalModelInvalid(
            f"HF_HUB_OFFLINE is set and {repo!r} at {source.revision!r} is not in {models_dir}: put it there, "
            "unset HF_HUB_OFFLINE to download it, or register the model as a local path"
        )
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            return RepoUnauthorized(
                f"the Hugging Face hub refused {repo!r} ({status}): set HF_TOKEN for the agent to a token that "
                "can read it"
            )
        if status is not None and status >= 500:
            return HubUnreachable(f"the Hugging Face hub failed on {repo!r} ({status}); try again later")
        return DownloadError(f"the Hugging Face hub refused {repo!r}: {exc}")
    if isinstance(exc, (httpx2.TransportError, LocalEntryNotFoundError, OfflineModeIsEnabled)):
        cause = exc.__cause__ if isinstance(exc, LocalEntryNotFoundError) and exc.__cause__ else exc
        return HubUnreachable(
            f"cannot reach the Hugging Face hub at {where} ({type(cause).__name__}: {cause}). If this node has no "
            "network to the hub, set HF_HUB_OFFLINE=1 for the agent and put the model in its models folder, or "
            "register the model as a local path"
        )
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return DiskFull(f"no space left in {models_dir} while downloading {repo!r}: free some space and retry")
    return DownloadError(f"downloading {repo!r} failed: {type(exc).__name__}: {exc}")
