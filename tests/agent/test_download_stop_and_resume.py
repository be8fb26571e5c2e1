"""A hub download that nothing waits for any more stops at once, and the next one resumes its partial files.

The hub is tests/agent/fake_hub.py's, a real HTTP server on loopback that counts the bytes it sends and holds
a transfer at a given byte. huggingface_hub writes a file in chunks of DOWNLOAD_CHUNK_SIZE (10 MiB), so the
files are bigger than one chunk and held at the end of the first: the partial file then holds exactly what
the hub sent.
"""

import asyncio
import os
import sys
import threading
import traceback
from pathlib import Path

import pytest
from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE

from agent.downloads import DownloadProgress, HubSettings, ModelDownloader
from runtime.fleet_contract.tasks import HubSource
from tests.agent.fake_hub import FakeHub, running_hub
from tests.process_trees import descendants

pytestmark = pytest.mark.timeout(120)

REPO = "acme/big-gguf"
FILE = "model.gguf"
SIZE = 2 * DOWNLOAD_CHUNK_SIZE + 12345


def download_processes() -> list[int]:
    """This test's download processes still running (agent/download_process.py)."""
    found = []
    for pid in descendants(os.getpid()):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"agent.download_process" in command:
            found.append(pid)
    return found


def downloading_threads() -> list[str]:
    """The threads of this process that are inside a download (huggingface_hub's code, or the agent's)."""
    found = []
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        stack = traceback.extract_stack(frame)
        if any("huggingface_hub" in step.filename or "agent/downloads.py" in step.filename for step in stack):
            found.append(names.get(ident, str(ident)))
    return found


def partial_file(models: Path) -> Path:
    return models / "models--acme--big-gguf" / "blobs" / f"{FakeHub.etag(FILE)}.incomplete"


async def test_a_stopped_download_hangs_up_at_once_and_the_next_fetch_resumes_its_partial_file(tmp_path: Path) -> None:
    content = os.urandom(SIZE)
    models = tmp_path / "models"
    with running_hub() as hub:
        hub.repos[REPO] = {FILE: content, "README.md": b"a model"}
        hold = hub.hold(FILE, DOWNLOAD_CHUNK_SIZE)
        downloader = ModelDownloader(models, hub=HubSettings(endpoint=hub.url, timeout_s=10), progress_interval_s=0.05)
        first_chunk_written = asyncio.Event()

        def on_progress(progress: DownloadProgress) -> None:
            if progress.bytes_done >= DOWNLOAD_CHUNK_SIZE:
                first_chunk_written.set()

        start = asyncio.create_task(downloader.fetch(HubSource(REPO), on_progress))
        async with asyncio.timeout(60):
            await first_chunk_written.wait()
        start.cancel()  # the start is stopped: nothing else waits for this download
        with pytest.raises(asyncio.CancelledError):
            await start
        # The transfer ends without the hold being lifted: the hub sees the connection closed, and sends no more.
        assert await asyncio.to_thread(hold.hung_up.wait, 30)
        assert hub.bytes_served(FILE) == DOWNLOAD_CHUNK_SIZE
        assert partial_file(models).stat().st_size == DOWNLOAD_CHUNK_SIZE
        await downloader.close()
        assert download_processes() == []
        assert downloading_threads() == []  # nothing of the download goes on in this process either

        path = await ModelDownloader(models, hub=HubSettings(endpoint=hub.url, timeout_s=10)).fetch(HubSource(REPO))
        assert path.read_bytes() == content
        # Resumed where the partial file ended: no byte of the file was sent twice.
        assert [(get.start, get.sent) for get in hub.gets(FILE)] == [
            (0, DOWNLOAD_CHUNK_SIZE),
            (DOWNLOAD_CHUNK_SIZE, SIZE - DOWNLOAD_CHUNK_SIZE),
        ]
        assert not partial_file(models).exists()


async def test_a_download_goes_on_while_one_of_two_starts_waiting_for_it_remains(tmp_path: Path) -> None:
    content = os.urandom(SIZE)
    models = tmp_path / "models"
    with running_hub() as hub:
        hub.repos[REPO] = {FILE: content}
        hold = hub.hold(FILE, DOWNLOAD_CHUNK_SIZE)
        downloader = ModelDownloader(models, hub=HubSettings(endpoint=hub.url, timeout_s=10))
        first = asyncio.create_task(downloader.fetch(HubSource(REPO)))
        second = asyncio.create_task(downloader.fetch(HubSource(REPO)))
        assert await asyncio.to_thread(hold.reached.wait, 60)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        hold.go_on.set()
        assert (await second).read_bytes() == content
        assert not hold.hung_up.is_set()
        assert [(get.start, get.sent) for get in hub.gets(FILE)] == [(0, SIZE)]
        await downloader.close()
