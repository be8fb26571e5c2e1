"""Where files' bytes are kept: ``<data dir>/openai-files/<file id>``, and a batch's results while it runs in
``<data dir>/openai-files/work/<batch id>/`` (``output.jsonl``, ``errors.jsonl``, appended a line per result).

Files are written to a temporary name and renamed, so a file id never names half a file; a batch's work
files may end in half a line (the control plane was killed while writing it): ``finished_lines`` drops it,
and the runner writes that result again.
"""

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from django.conf import settings


def root() -> Path:
    return Path(settings.DATA_DIR) / "openai-files"


def path_of(file_id: str) -> Path:
    return root() / file_id


def work_dir(batch_id: str) -> Path:
    return root() / "work" / batch_id


def save(file_id: str, chunks: Iterable[bytes]) -> int:
    """Write ``chunks`` as the file ``file_id``; returns its size in bytes."""
    root().mkdir(parents=True, exist_ok=True)
    size = 0
    with tempfile.NamedTemporaryFile(dir=root(), prefix=".upload-", delete=False) as out:
        try:
            for chunk in chunks:
                out.write(chunk)
                size += len(chunk)
        except BaseException:
            os.unlink(out.name)
            raise
    os.replace(out.name, path_of(file_id))
    return size


def adopt(file_id: str, source: Path) -> int:
    """Make ``source`` (a batch's finished work file) the file ``file_id``; returns its size."""
    root().mkdir(parents=True, exist_ok=True)
    os.replace(source, path_of(file_id))
    return path_of(file_id).stat().st_size


def delete(file_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        path_of(file_id).unlink()


def remove_work(batch_id: str) -> None:
    shutil.rmtree(work_dir(batch_id), ignore_errors=True)


def finished_lines(path: Path) -> list[bytes]:
    """The whole lines of a work file (none when it does not exist); a partial last line is cut off the
    file, so that appending goes on from a line's start."""
    try:
        content = path.read_bytes()
    except FileNotFoundError:
        return []
    whole = content[: content.rfind(b"\n") + 1]
    if len(whole) != len(content):
        with path.open("r+b") as file:
            file.truncate(len(whole))
    return whole.splitlines()
