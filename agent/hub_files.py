"""A repo's files fetched into the hub cache's blob folder, each resumed from where an interrupted download left it.

huggingface_hub (2.4) downloads each file into a temporary file whose name is unique to that download, and
deletes it when the download fails: a download that is stopped, or an agent killed in the middle of one,
leaves a partial file that no later download reads, and the next one fetches the file from its first byte.
So the agent fetches each file itself: into ``blobs/<etag>.incomplete`` (one name per version of the file,
the same for every try), appending from its size with an HTTP range request, and renamed to ``blobs/<etag>``
once whole. huggingface_hub then lays out the snapshot around blobs that are already there (agent/downloads.py),
downloading nothing more. A file's ETag names its content, so a partial file only ever grows into the
version it was started for.

The caller holds the repo's lock (agent/downloads.py): two downloads never append to one partial file.
Errors are huggingface_hub's and httpx2's, untranslated (agent/downloads.py translates them).
"""

import logging
import os
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from urllib.parse import urlsplit

from huggingface_hub import get_hf_file_metadata, hf_hub_url
from huggingface_hub.file_download import http_get
from huggingface_hub.utils._headers import build_hf_headers

from agent.errors import DownloadError
from runtime.models.hub_download import HubSettings

log = logging.getLogger(__name__)

#: Files fetched at once, as snapshot_download does by default.
PARALLEL_FILES = 8


def repo_folder(repo_id: str) -> str:
    """The hub cache's folder name of a model repo (``models--org--name``)."""
    return "models--" + repo_id.replace("/", "--")


def fetch_blobs(repo_id: str, names: Sequence[str], *, commit: str, cache: Path, hub: HubSettings) -> None:
    """Put each of ``names`` (files of ``repo_id`` at ``commit``) in the cache's blob folder of the repo,
    resuming the partial files earlier downloads left. Raises the first failure; the files still downloading
    then are left to the process's end (it is a download process of its own: agent/download_process.py)."""
    pool = ThreadPoolExecutor(max_workers=max(1, min(PARALLEL_FILES, len(names))), thread_name_prefix="hub file")
    futures = [pool.submit(_fetch_blob, repo_id, name, commit, cache, hub) for name in names]
    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    for future in done:
        if (error := future.exception()) is not None:
            pool.shutdown(wait=False, cancel_futures=True)
            raise error
    pool.shutdown()


def _fetch_blob(repo_id: str, name: str, commit: str, cache: Path, hub: HubSettings) -> None:
    url = hf_hub_url(repo_id, name, revision=commit, endpoint=hub.endpoint)
    metadata = get_hf_file_metadata(url, token=hub.token, timeout=hub.timeout_s, endpoint=hub.endpoint)
    if metadata.etag is None:
        raise DownloadError(f"the hub sent no ETag for {name!r} of {repo_id!r}, so it cannot be stored or resumed")
    blobs = cache / repo_folder(repo_id) / "blobs"
    blob = blobs / metadata.etag
    if blob.exists():
        return
    blobs.mkdir(parents=True, exist_ok=True)
    partial = blobs / f"{metadata.etag}.incomplete"
    done = partial.stat().st_size if partial.exists() else 0
    if metadata.size is not None and done > metadata.size:
        log.warning("%s of %s: a partial file longer than the file (%d bytes); fetching it afresh", name, repo_id, done)
        partial.unlink()
        done = 0
    headers = build_hf_headers(token=hub.token)
    target = url
    # As huggingface_hub does: go straight to where the hub redirects (a CDN), without the token if that is
    # another host; a Xet-stored file is fetched through the hub's URL, which redirects to its bridge.
    if metadata.xet_file_data is None and metadata.location != url:
        target = metadata.location
        if urlsplit(target).netloc != urlsplit(url).netloc:
            headers.pop("authorization", None)
    if done:
        log.info("resuming %s of %s at byte %d of %s", name, repo_id, done, metadata.size or "?")
    with partial.open("ab") as file:
        http_get(target, file, resume_size=done, headers=headers, expected_size=metadata.size, displayed_filename=name)
    os.replace(partial, blob)
