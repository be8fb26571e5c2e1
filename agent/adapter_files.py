"""The LoRA adapters of the pipelines this node runs: fetched, then written to each pipeline's adapter file.

A pipeline's workers on this node share one file, ``<models folder>/adapter-sets/<pipeline namespace>.json``:
an ``AdapterSet`` (runtime/lora.py) with each adapter's local path, which every worker of the pipeline is
given as ``--lora-file`` and watches, loading and unloading adapters as it changes. It is in the models folder
because that is what a worker running as another user may read (agent/workers/worker_user.py).

The set comes with a worker's start (``WorkerSpec.adapters``) and with each SetAdapters task, which the control
plane re-sends periodically. A set older than the file's (a lower generation) is ignored; the same set already
applied, every adapter fetched, is not fetched again. The file is written atomically (a temporary file, then a
rename), and only when its content changes, so a worker never reads half a file or reloads for nothing.

An adapter comes from a Hugging Face repo, downloaded as models are (agent/downloads.py: the same folder, lock
and ``HF_TOKEN``), or from a local path, checked: a PEFT folder (``adapter_config.json``) or a GGUF file. One
that cannot be fetched is left out of the file and logged at warning with the reason; the others are written,
the worker keeps running, and the next re-sent task tries again. Meanwhile the node's heartbeat tells the
control plane which adapters it could not fetch and why (``failures``), and the pipeline's Adapters panel says so.
"""

import asyncio
import logging
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import msgspec

from agent.downloads import ModelDownloader
from agent.errors import DownloadError, LocalModelInvalid, LocalModelMissing
from runtime.fleet_contract.reports import AdapterFailure
from runtime.fleet_contract.tasks import AdapterSource, LocalSource
from runtime.lora import AdapterSet, LoraAdapter

log = logging.getLogger(__name__)

#: The folder of the adapter files, inside the models folder.
FOLDER = "adapter-sets"
#: What a heartbeat says of adapters that could not be fetched, at most (the control plane takes no more).
MAX_FAILURES_REPORTED = 64
#: An adapter file of a pipeline no worker here runs is deleted once it is this old (seconds).
UNUSED_AGE_S = 600.0
MAX_REASON = 500
#: What makes a folder a PEFT adapter.
ADAPTER_CONFIG = "adapter_config.json"


class AdapterFiles:
    """Fetches pipelines' adapters with ``downloader`` and writes their adapter files under its models folder."""

    def __init__(self, downloader: ModelDownloader) -> None:
        self._downloader = downloader
        self.folder = downloader.models_dir / FOLDER
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # pipeline -> the set last applied with every adapter fetched: a re-sent copy of it does nothing.
        self._complete: dict[str, tuple[int, list[AdapterSource]]] = {}
        # pipeline -> (its row id, adapter -> why it could not be fetched) as of its last set applied: the
        # heartbeat tells the control plane, whose Adapters panel shows it.
        self._failures: dict[str, tuple[int, dict[str, str]]] = {}

    def forget_unused(self, in_use: set[str], now: float, min_age_s: float = UNUSED_AGE_S) -> list[Path]:
        """Delete the adapter files of the pipelines no worker here runs (``in_use``: ``pipeline.pipeline_id``
        keys, as ``key``) untouched for ``min_age_s``, and forget what was said of their adapters; returns the
        files deleted. A deleted pipeline's file would stay for ever otherwise; one placed here again gets its file
        with its start. The age spares a file written for a start whose worker is not running yet."""
        deleted = []
        try:
            paths = sorted(self.folder.glob("*.json"))
        except OSError:
            paths = []
        for path in paths:
            key = path.name.removesuffix(".json")
            try:
                if key in in_use or now - path.stat().st_mtime < min_age_s:
                    continue
                path.unlink()
            except OSError:
                continue
            deleted.append(path)
            log.info("adapter file %s deleted: no worker here runs its pipeline", path)
        for key in list(self._failures):
            if key not in in_use and not (self.folder / f"{key}.json").exists():
                del self._failures[key]
                self._complete.pop(key, None)
        return deleted

    @staticmethod
    def key(pipeline: str, pipeline_id: int) -> str:
        """The name of a pipeline's file (and of its entries here), without ``.json``."""
        return f"{pipeline}.{pipeline_id}"

    def failures(self) -> list[AdapterFailure]:
        """The adapters left out of their pipelines' files, with why, as the last set of each pipeline had them
        (at most ``MAX_FAILURES_REPORTED``, each reason at most ``MAX_REASON`` characters)."""
        found = [
            AdapterFailure(pipeline_id=pipeline_id, adapter=name, reason=reason[:MAX_REASON])
            for pipeline_id, failed in self._failures.values()
            for name, reason in sorted(failed.items())
        ]
        return sorted(found, key=lambda f: (f.pipeline_id, f.adapter))[:MAX_FAILURES_REPORTED]

    def path(self, pipeline: str, pipeline_id: int = 0) -> Path:
        """The adapter file of ``pipeline`` (its namespace: letters, digits, '-' and '_') of row id ``pipeline_id``:
        a pipeline that takes the namespace of a deleted one has a file of its own, never the other's adapters or
        its later generations."""
        return self.folder / f"{self.key(pipeline, pipeline_id)}.json"

    def generation(self, pipeline: str, pipeline_id: int = 0) -> int | None:
        """The generation the pipeline's file holds; None when it has none (or cannot be read)."""
        try:
            return msgspec.json.decode(self.path(pipeline, pipeline_id).read_bytes(), type=AdapterSet).generation
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None

    async def apply(self, pipeline: str, adapters: list[AdapterSource], generation: int, pipeline_id: int = 0) -> Path:
        """Make the pipeline's file hold ``adapters`` (those that could be fetched) at ``generation``, unless it
        holds a newer generation. Returns the file's path. Raises OSError when the file cannot be written."""
        key = self.key(pipeline, pipeline_id)
        async with self._locks[key]:
            path = self.path(pipeline, pipeline_id)
            held = await asyncio.to_thread(self.generation, pipeline, pipeline_id)
            if held is not None and held > generation:
                log.info(
                    "pipeline %s: its adapter set %d is older than the one applied (%d)", pipeline, generation, held
                )
                return path
            if held == generation and self._complete.get(key) == (generation, adapters):
                return path
            loaded, failed = [], {}
            for adapter in adapters:
                try:
                    local = await self._fetch(adapter)
                except DownloadError as exc:
                    log.warning("pipeline %s: adapter %s left out of its workers' set: %s", pipeline, adapter.name, exc)
                    failed[adapter.name] = str(exc)
                    continue
                loaded.append(LoraAdapter(name=adapter.name, path=str(local)))
            content = msgspec.json.encode(AdapterSet(adapters=loaded, generation=generation))
            await asyncio.to_thread(_write_atomically, path, content)
            if failed:
                self._complete.pop(key, None)  # the next copy of the task tries them again
                self._failures[key] = (pipeline_id, failed)
            else:
                self._complete[key] = (generation, adapters)
                self._failures.pop(key, None)
            log.info(
                "pipeline %s: adapter set %d written (%s)%s",
                pipeline,
                generation,
                ", ".join(a.name for a in loaded) or "no adapters",
                f"; not fetched: {', '.join(failed)}" if failed else "",
            )
            return path

    async def _fetch(self, adapter: AdapterSource) -> Path:
        if isinstance(adapter.source, LocalSource):
            return await asyncio.to_thread(check_local_adapter, Path(adapter.source.path))
        return await self._downloader.fetch(adapter.source)


def check_local_adapter(path: Path) -> Path:
    """``path`` if it is a PEFT adapter folder or a GGUF file. Raises LocalModelMissing (retryable: a file system
    not mounted yet) or LocalModelInvalid."""
    if not path.exists():
        raise LocalModelMissing(f"adapter path {str(path)!r} does not exist on this node")
    if path.is_dir():
        if not (path / ADAPTER_CONFIG).is_file():
            raise LocalModelInvalid(f"folder {str(path)!r} has no {ADAPTER_CONFIG}, so it is not a LoRA adapter")
        return path
    if not path.name.lower().endswith(".gguf"):
        raise LocalModelInvalid(f"{str(path)!r} is neither an adapter folder nor a .gguf file")
    return path


def _write_atomically(path: Path, content: bytes) -> None:
    """Write ``content`` to ``path`` by a rename, unless the file has it already; readable by the workers' group."""
    try:
        if path.read_bytes() == content:
            return
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(content)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o640)  # the agent's umask may be 077: the workers' group reads it
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
