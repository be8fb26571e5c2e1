"""A hub download in a process of its own, so that it can be stopped: killed once no start waits for it.

huggingface_hub has no way to stop a download, and a thread cannot be stopped from outside: a download run
in a thread went on after its start was stopped or replaced (holding the repo's lock, the bandwidth and the
disk), and one stalled on a silent connection until its read timed out. So ModelDownloader
(agent/downloads.py) runs each hub download as ``python -m agent.download_process``:

* the job (the source, the models folder, the hub's settings, the token among them) comes on its stdin,
  never in its command line, which every user of the machine can read;
* progress and the outcome go out on its stdout, one JSON message a line; its log goes to the agent's stderr;
* killing it stops the transfer at once (the hub sees the connection closed), and leaves the partial files
  for the next download of the model to resume (agent/hub_files.py);
* it is killed by the kernel when the agent dies (a parent-death signal), so that an agent killed in the
  middle of a download leaves no download running to race the next agent's.
"""

import asyncio
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import msgspec

from agent import errors
from agent.errors import DownloadError
from runtime.fleet_contract.tasks import HubSource
from runtime.models.hub_download import HubSettings

log = logging.getLogger(__name__)


class DownloadJob(msgspec.Struct, frozen=True, kw_only=True):
    """What the download process is to fetch, and how (sent on its stdin)."""

    source: HubSource
    models_dir: str
    endpoint: str | None
    token: str | None
    offline: bool
    timeout_s: float
    progress_interval_s: float
    #: The agent's pid: the process ends at once if the agent is gone before it could ask to die with it.
    parent_pid: int


class Progress(msgspec.Struct, frozen=True, tag="progress"):
    bytes_done: int
    bytes_total: int | None
    waiting: bool = False


class Done(msgspec.Struct, frozen=True, tag="done"):
    path: str


class Failed(msgspec.Struct, frozen=True, tag="failed"):
    #: The name of the agent.errors class the error is (DownloadError for one it does not know).
    kind: str
    message: str


Message = Progress | Done | Failed

# The errors a download may end with, by name: the process sends the name, the agent raises the class.
_ERRORS: dict[str, type[DownloadError]] = {
    cls.__name__: cls for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, DownloadError)
}


async def run_download(job: DownloadJob, on_progress: Callable[[Progress], None]) -> Path:
    """Run ``job`` in a download process; its model's local path. ``on_progress`` is called on the loop.

    Raises the DownloadError subclass the process reports, or DownloadError when it ends without a word.
    Cancelled, it kills the process and waits for it to end: the partial files stay for the next download.
    """
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agent.download_process",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdin is not None and process.stdout is not None  # both asked for as pipes
    outcome: Done | Failed | None = None
    try:
        process.stdin.write(msgspec.json.encode(job) + b"\n")
        await process.stdin.drain()
        process.stdin.close()
        decoder = msgspec.json.Decoder(Message)
        async for line in process.stdout:
            try:
                message = decoder.decode(line)
            except msgspec.DecodeError:
                log.warning("the download process of %s wrote a line that is no message: %r", job.source, line[:200])
                continue
            if isinstance(message, Progress):
                on_progress(message)
            else:
                outcome = message
        code = await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    if isinstance(outcome, Done):
        return Path(outcome.path)
    if isinstance(outcome, Failed):
        raise _ERRORS.get(outcome.kind, DownloadError)(outcome.message)
    raise DownloadError(
        f"the download process of {job.source.repo_id!r} ended (exit status {code}) without saying how it went; "
        "see the agent's log"
    )


# -- the process ---------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _die_with(parent_pid: int) -> None:
    """SIGKILL when the agent's thread that started this process ends (the agent's main thread), and an
    exit at once if the agent is gone already."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)


def main() -> None:
    """The download process: a job on stdin, messages on stdout. Always exits 0 once it has sent the outcome."""
    from huggingface_hub.utils.tqdm import disable_progress_bars

    from agent.downloads import DownloadProgress, ModelDownloader  # here: agent.downloads imports this module
    from runtime.logging import configure_logging

    configure_logging(os.environ.get("FLOTILLA_LOG"))
    try:
        job = msgspec.json.decode(sys.stdin.buffer.readline(), type=DownloadJob)
    except msgspec.DecodeError as exc:
        # Not started by the agent (or it died before it wrote the job): nothing to do.
        log.error("the download process needs a job on its stdin, as the node agent sends it: %s", exc)
        sys.exit(2)
    _die_with(job.parent_pid)
    disable_progress_bars()  # the agent reports progress itself; bars would fill its log
    out = sys.stdout.buffer
    lock = threading.Lock()  # progress comes from a polling thread too

    def send(message: Message) -> None:
        with lock:
            out.write(msgspec.json.encode(message) + b"\n")
            out.flush()

    def report(progress: DownloadProgress) -> None:
        send(Progress(progress.bytes_done, progress.bytes_total, progress.waiting))

    hub = HubSettings(endpoint=job.endpoint, token=job.token, offline=job.offline, timeout_s=job.timeout_s)
    downloader = ModelDownloader(Path(job.models_dir), hub=hub, progress_interval_s=job.progress_interval_s)
    outcome: Done | Failed
    try:
        outcome = Done(str(downloader.fetch_blocking(job.source, report)))
    except DownloadError as exc:
        outcome = Failed(type(exc).__name__, str(exc))
    except Exception as exc:
        log.exception("downloading %s failed", job.source.repo_id)
        outcome = Failed("DownloadError", f"downloading {job.source.repo_id!r} failed: {type(exc).__name__}: {exc}")
    send(outcome)
    # Without waiting for file downloads still running after a failure (agent/hub_files.py): they are left
    # partial, to be resumed.
    os._exit(0)


if __name__ == "__main__":
    main()
