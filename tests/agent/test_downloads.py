"""Model downloads: local models checked, hub repos fetched under a lock with progress, errors explained.

The hub cannot be reached from the tests. Downloads go to a fake hub on loopback (tests/agent/fake_hub.py),
through the download process and the real library; the tests of what is decided before any file is
fetched (the space check, the translation of huggingface_hub's exceptions) fake ``HfApi.model_info`` and
call ``fetch_blocking``, what the download process runs, directly. An unreachable hub and offline mode go
through the real library.
"""

import asyncio
import errno
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx2
import pytest
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

from agent import downloads
from agent.downloads import DownloadProgress, HubSettings, ModelDownloader
from agent.errors import (
    DiskFull,
    DownloadError,
    HubUnreachable,
    LocalModelInvalid,
    LocalModelMissing,
    RepoNotFound,
    RepoUnauthorized,
)
from runtime.fleet_contract.tasks import HubSource, LocalSource
from tests.agent.fake_hub import SHA, FakeHub, running_hub
from tests.servers import free_port

REPO = "acme/tiny-llm"
HUB = HubSettings(endpoint="http://hub.invalid", token=None, offline=False, timeout_s=1)


class FakeHubApi:
    """huggingface_hub's HfApi as the downloader uses it, over a repo of ``files`` (name -> size), or raising
    ``error``: for what is decided before any file is fetched (the space check, the translation of errors).
    ``fetch_blocking`` is called directly: it is what the download process runs."""

    def __init__(self, files: dict[str, int], error: BaseException | None = None) -> None:
        self.files = files
        self.error = error

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        hub = self

        class FakeApi:
            def __init__(self, **kwargs: Any) -> None:
                pass

            def model_info(self, repo_id: str, **kwargs: Any) -> SimpleNamespace:
                if hub.error is not None:
                    raise hub.error
                siblings = [SimpleNamespace(rfilename=name, size=size) for name, size in hub.files.items()]
                return SimpleNamespace(sha=SHA, siblings=siblings)

        monkeypatch.setattr(downloads, "HfApi", FakeApi)


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with running_hub() as hub:
        yield hub


# -- local models --------------------------------------------------------------------------------


async def test_a_local_model_folder_or_gguf_file_is_checked_and_returned(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(16))
    downloader = ModelDownloader(tmp_path / "models", hub=HUB)
    assert await downloader.fetch(LocalSource(str(folder))) == folder
    assert await downloader.fetch(LocalSource(str(gguf))) == gguf


@pytest.mark.parametrize(
    ("make", "complaint"),
    [
        (lambda path: path.mkdir(), "neither config.json nor tokenizer.json"),
        (lambda path: path.write_bytes(b"PK\x03\x04"), "not a GGUF file"),
    ],
)
async def test_a_local_path_that_is_no_model_says_why(tmp_path: Path, make: Any, complaint: str) -> None:
    path = tmp_path / "thing"
    make(path)
    with pytest.raises(LocalModelInvalid, match=complaint) as raised:
        await ModelDownloader(tmp_path / "models", hub=HUB).fetch(LocalSource(str(path)))
    assert not raised.value.retryable  # only a changed source fixes it


async def test_a_local_path_that_is_not_there_yet_is_worth_another_try(tmp_path: Path) -> None:
    # A file system not mounted yet, a copy not finished: the control plane backs off and tries again.
    with pytest.raises(LocalModelMissing, match="does not exist on this node") as raised:
        await ModelDownloader(tmp_path / "models", hub=HUB).fetch(LocalSource(str(tmp_path / "thing")))
    assert raised.value.retryable


# -- hub downloads (a fake hub on loopback: tests/agent/fake_hub.py) ------------------------------


def on(hub: FakeHub) -> HubSettings:
    return HubSettings(endpoint=hub.url, timeout_s=10)


async def test_a_snapshot_skips_other_weight_formats_and_reports_progress_to_the_end(
    tmp_path: Path, hub: FakeHub
) -> None:
    models = tmp_path / "models"
    sizes = {"config.json": 100, "tokenizer.json": 400, "model.safetensors": 5000, "pytorch_model.bin": 9999}
    hub.repos[REPO] = {name: bytes(size) for name, size in sizes.items()}
    weights = hub.hold("model.safetensors", 0)
    reports: list[DownloadProgress] = []

    def on_progress(progress: DownloadProgress) -> None:
        reports.append(progress)
        # The poller saw the small files on disk: let the hub send the weights.
        if progress.bytes_done > 0:
            weights.go_on.set()

    downloader = ModelDownloader(models, hub=on(hub), progress_interval_s=0.01)
    path = await downloader.fetch(HubSource(REPO, revision="v1"), on_progress)
    assert path == models / "models--acme--tiny-llm" / "snapshots" / SHA
    assert sorted(entry.name for entry in path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert hub.gets("pytorch_model.bin") == []
    assert {get.revision for get in hub.served} == {SHA}  # pinned to the commit model_info saw
    assert reports[-1] == DownloadProgress(5500, 5500)
    assert all(report.bytes_total == 5500 for report in reports if not report.waiting)
    done = [report.bytes_done for report in reports]
    assert done == sorted(done) and any(0 < each < 5500 for each in done)  # a report came before the end


async def test_a_gguf_repo_fetches_its_one_gguf_or_the_file_named(tmp_path: Path, hub: FakeHub) -> None:
    hub.repos[REPO] = {"model-Q4_K_M.gguf": bytes(300), "README.md": b"a model"}
    downloader = ModelDownloader(tmp_path / "models", hub=on(hub))
    path = await downloader.fetch(HubSource(REPO))
    assert path.name == "model-Q4_K_M.gguf" and path.stat().st_size == 300
    assert [get.name for get in hub.served] == ["model-Q4_K_M.gguf"]
    hub.repos[REPO]["model-Q8_0.gguf"] = bytes(600)
    with pytest.raises(DownloadError, match="holds 2 GGUF files: name the one"):
        await downloader.fetch(HubSource(REPO))
    assert (await downloader.fetch(HubSource(REPO, file="model-Q8_0.gguf"))).name == "model-Q8_0.gguf"
    with pytest.raises(RepoNotFound, match=r"has no file 'nope\.gguf'"):
        await downloader.fetch(HubSource(REPO, file="nope.gguf"))


async def test_concurrent_fetches_of_one_model_share_one_download(tmp_path: Path, hub: FakeHub) -> None:
    hub.repos[REPO] = {"config.json": bytes(10), "model.safetensors": bytes(90)}
    weights = hub.hold("model.safetensors", 0)
    downloader = ModelDownloader(tmp_path / "models", hub=on(hub))
    first = asyncio.create_task(downloader.fetch(HubSource(REPO)))
    second = asyncio.create_task(downloader.fetch(HubSource(REPO)))
    assert await asyncio.to_thread(weights.reached.wait, 60)
    weights.go_on.set()
    assert await first == await second
    assert len(hub.gets("model.safetensors")) == 1


async def test_two_agents_sharing_a_models_folder_download_one_at_a_time(tmp_path: Path, hub: FakeHub) -> None:
    models = tmp_path / "models"
    hub.repos[REPO] = {"config.json": bytes(10), "model.safetensors": bytes(90)}
    weights = hub.hold("model.safetensors", 0)
    one, other = ModelDownloader(models, hub=on(hub)), ModelDownloader(models, hub=on(hub))
    first = asyncio.create_task(one.fetch(HubSource(REPO)))
    assert await asyncio.to_thread(weights.reached.wait, 60)
    waiting = asyncio.Event()
    second = asyncio.create_task(
        other.fetch(HubSource(REPO), lambda progress: waiting.set() if progress.waiting else None)
    )
    async with asyncio.timeout(60):
        await waiting.wait()  # it found the repo's lock held and said so
    assert not second.done()
    weights.go_on.set()
    assert await first == await second
    assert len(hub.gets("model.safetensors")) == 1  # the second found the files in place


def test_a_model_bigger_than_the_free_space_is_refused_before_downloading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    FakeHubApi({"config.json": 10, "model.safetensors": 1 << 60}).install(monkeypatch)
    with pytest.raises(DiskFull, match=r"needs .* GiB more in"):
        ModelDownloader(tmp_path / "models", hub=HUB).fetch_blocking(HubSource(REPO))
    assert not (tmp_path / "models" / "models--acme--tiny-llm" / "blobs").exists()


def _response(status: int) -> httpx2.Response:
    return httpx2.Response(status, request=httpx2.Request("GET", f"http://hub.invalid/api/models/{REPO}"))


@pytest.mark.parametrize(
    ("error", "translated", "says"),
    [
        (RepositoryNotFoundError("404", response=_response(404)), RepoNotFound, "does not exist or is private"),
        (GatedRepoError("403", response=_response(403)), RepoUnauthorized, "is gated"),
        (HfHubHTTPError("401", response=_response(401)), RepoUnauthorized, "HF_TOKEN"),
        (RevisionNotFoundError("404", response=_response(404)), RepoNotFound, "has no revision 'main'"),
        (HfHubHTTPError("503", response=_response(503)), HubUnreachable, "try again later"),
        (httpx2.ConnectError("Name or service not known"), HubUnreachable, "HF_HUB_OFFLINE=1"),
        (OSError(errno.ENOSPC, "No space left on device"), DiskFull, "no space left"),
        (HfHubHTTPError("429", response=_response(429)), DownloadError, "429"),
        (RuntimeError("something nobody foresaw"), DownloadError, "something nobody foresaw"),
    ],
)
def test_hub_errors_become_errors_that_say_what_to_do(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    error: BaseException,
    translated: type[DownloadError],
    says: str,
) -> None:
    FakeHubApi({}, error).install(monkeypatch)
    with pytest.raises(translated, match=says) as raised:
        ModelDownloader(tmp_path / "models", hub=HUB).fetch_blocking(HubSource(REPO))
    assert raised.value.__cause__ is error
    # Each may be fine later (a hub's incident, access granted, space freed): the control plane backs off and
    # tries again rather than giving the replica up at once.
    assert raised.value.retryable


async def test_a_bad_repo_id_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DownloadError, match="is not a Hugging Face repo id") as raised:
        await ModelDownloader(tmp_path, hub=HUB).fetch(HubSource("not a repo"))
    assert not raised.value.retryable  # only a changed source fixes it


# -- the real library, no network ----------------------------------------------------------------


async def test_an_unreachable_hub_is_reported_with_the_way_out(tmp_path: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    downloader = ModelDownloader(tmp_path / "models", hub=HubSettings(endpoint=closed, timeout_s=2))
    with pytest.raises(HubUnreachable, match=r"cannot reach the Hugging Face hub at http://127\.0\.0\.1") as raised:
        await downloader.fetch(HubSource(REPO))
    assert "HF_HUB_OFFLINE=1" in str(raised.value) and "local path" in str(raised.value)


async def test_offline_a_model_not_in_the_models_folder_says_so(tmp_path: Path) -> None:
    downloader = ModelDownloader(tmp_path / "models", hub=HubSettings(offline=True))
    with pytest.raises(LocalModelInvalid, match="HF_HUB_OFFLINE is set and 'acme/tiny-llm'"):
        await downloader.fetch(HubSource(REPO))
