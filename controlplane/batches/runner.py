"""A batch run over the fleet: its requests sent to the gateway as the key that made it, a slice at a time.

``run_slice`` is one Celery task's work on one batch (``tasks.py``): it takes the batch's lease
(``Batch.runner_until``), validates a new batch, sends the requests not yet answered for up to
``BATCH_SLICE_S`` seconds, ``BATCH_CONCURRENCY`` at a time, and says whether the batch needs another
slice. Slices keep a long batch from holding a Celery worker for hours, and make a restart cheap: the
results are appended to the batch's work files as they come (``storage.py``), so a runner that died
(the control plane restarted mid-batch) is followed, once its lease lapses, by one that sends only the
requests without a result.

The requests go to the gateway (``FLOTILLA_GATEWAY_URL``) with a credential for the batch's key
(runtime/fleet_contract/batch_credentials.py): the key's models, limits and usage apply as if the key had
sent them, and revoking the key stops the batch. An answer is a result (the output file for 2xx, the
error file for the rest), except one that says "later" (429 for a rate limit, 502/503/504, or no
connection): that request waits, with a growing pause, and is sent again, so a gateway restart or a
busy fleet costs a batch time, not results.
"""

import asyncio
import datetime
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.apikeys.publication import secret_file
from controlplane.batches import storage, validation
from controlplane.batches.models import Batch, StoredFile
from runtime.fleet_contract import batch_credentials
from runtime.fleet_contract.api_keys import read_secret

log = logging.getLogger(__name__)

OUTPUT = "output.jsonl"
ERRORS = "errors.jsonl"
_PROGRESS_EVERY_S = 1.0
_RETRY_FIRST_S = 0.5
_RETRY_MAX_S = 10.0
_REQUEST_TIMEOUT = httpx.Timeout(600.0, connect=5.0)
_LATER = frozenset({429, 502, 503, 504})


def run_slice(batch_id: str) -> bool:
    """Work on ``batch_id`` for up to one slice; returns whether it needs another (False as well when
    another runner holds it, or it is over)."""
    if not _claim(batch_id):
        return False
    try:
        batch = Batch.objects.select_related("api_key", "input_file").get(pk=batch_id)
        if batch.status == Batch.Status.VALIDATING:
            _validate(batch)
        if batch.status == Batch.Status.IN_PROGRESS:
            if batch.expires_at <= timezone.now():
                _finish(batch, Batch.Status.EXPIRED)
            else:
                _send_pending(batch)
        if batch.status in (Batch.Status.CANCELLING, Batch.Status.FINALIZING):
            _finish(
                batch, Batch.Status.CANCELLED if batch.status == Batch.Status.CANCELLING else Batch.Status.COMPLETED
            )
        return batch.status in Batch.RUNNING
    finally:
        Batch.objects.filter(pk=batch_id).update(runner_until=None)


def _claim(batch_id: str) -> bool:
    now = timezone.now()
    lease = now + datetime.timedelta(seconds=settings.BATCH_LEASE_S)
    free = Q(runner_until__isnull=True) | Q(runner_until__lt=now)
    return bool(Batch.objects.filter(free, pk=batch_id, status__in=Batch.RUNNING).update(runner_until=lease))


def _validate(batch: Batch) -> None:
    try:
        requests = validation.parse(storage.path_of(batch.input_file_id).read_bytes(), batch.endpoint)
    except validation.Invalid as exc:
        _set(batch, status=Batch.Status.FAILED, failed_at=timezone.now(), errors=exc.errors)
        log.info("batch %s failed validation: %d error(s)", batch.id, len(exc.errors))
        return
    except FileNotFoundError:
        error = {"code": "file_missing", "message": "the input file's content is gone", "line": None, "param": None}
        _set(batch, status=Batch.Status.FAILED, failed_at=timezone.now(), errors=[error])
        return
    _set(batch, status=Batch.Status.IN_PROGRESS, in_progress_at=timezone.now(), total=len(requests))


def _set(batch: Batch, **fields: Any) -> None:
    """Change ``fields`` of ``batch`` unless it was cancelled meanwhile (a cancel always wins)."""
    updated = (
        Batch.objects.filter(pk=batch.pk)
        .exclude(status__in=(Batch.Status.CANCELLING, Batch.Status.CANCELLED))
        .update(**fields)
    )
    batch.refresh_from_db()
    if updated:
        return
    if batch.status == Batch.Status.CANCELLING and "total" in fields:
        Batch.objects.filter(pk=batch.pk).update(total=fields["total"])
        batch.refresh_from_db()


def pending(batch: Batch) -> list[validation.Request]:
    """The batch's requests with no result in its work files yet."""
    requests = validation.parse(storage.path_of(batch.input_file_id).read_bytes(), batch.endpoint)
    work = storage.work_dir(batch.id)
    answered = {_custom_id(line) for name in (OUTPUT, ERRORS) for line in storage.finished_lines(work / name)}
    return [request for request in requests if request.custom_id not in answered]


def _custom_id(line: bytes) -> str:
    return str(msgspec.json.decode(line).get("custom_id"))


def _send_pending(batch: Batch) -> None:
    todo = pending(batch)
    if todo:
        if not settings.BATCH_GATEWAY_URL:
            log.warning("batch %s waits: FLOTILLA_GATEWAY_URL names no gateway to send it to", batch.id)
            return
        secret = read_secret(secret_file())
        expiry = int(batch.expires_at.timestamp()) + 3600
        credential = batch_credentials.sign(batch.api_key.key_hash, batch.id, expiry, secret)
        work = storage.work_dir(batch.id)
        work.mkdir(parents=True, exist_ok=True)
        sender = _Sender(batch, credential, work, time.monotonic() + settings.BATCH_SLICE_S)
        _run_beside(sender, todo)
        batch.refresh_from_db()
        if sender.left:
            return
    if batch.status == Batch.Status.IN_PROGRESS:
        _set(batch, status=Batch.Status.FINALIZING, finalizing_at=timezone.now())


def _run_beside(sender: "_Sender", todo: list[validation.Request]) -> None:
    """Send ``todo`` on an event loop in a thread of its own while this one (the ORM's, which refuses to run
    in an event loop) writes the progress every second and tells the sender when the batch is cancelled."""
    failure: list[BaseException] = []

    def send() -> None:
        try:
            asyncio.run(sender.run(todo))
        except BaseException as exc:  # re-raised below, in the task's own thread
            failure.append(exc)

    thread = threading.Thread(target=send, name=f"batch {sender.batch.id}", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(_PROGRESS_EVERY_S)
        if _progress(sender.batch.pk, sender.work) != Batch.Status.IN_PROGRESS:
            sender.stop = True  # cancelled: what is in flight finishes, nothing new is sent
    if failure:
        raise failure[0]


@dataclass
class _Sender:
    """One slice's sending: results appended to the work files as they come. ``stop`` (set from the task's
    thread) ends it early: nothing new is sent."""

    batch: Batch
    credential: str
    work: Path
    deadline: float
    left: int = 0
    stop: bool = False
    _files: dict[str, Any] = field(default_factory=dict)

    async def run(self, todo: list[validation.Request]) -> None:
        queue: asyncio.Queue[validation.Request] = asyncio.Queue()
        for request in todo:
            queue.put_nowait(request)
        self.left = len(todo)
        headers = {"Authorization": f"Bearer {self.credential}", "Content-Type": "application/json"}
        width = settings.BATCH_CONCURRENCY
        limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
        with (self.work / OUTPUT).open("ab") as output, (self.work / ERRORS).open("ab") as errors:
            self._files = {OUTPUT: output, ERRORS: errors}
            async with httpx.AsyncClient(
                base_url=settings.BATCH_GATEWAY_URL.rstrip("/"),
                headers=headers,
                timeout=_REQUEST_TIMEOUT,
                limits=limits,
            ) as client:
                await asyncio.gather(*(self._work(client, queue) for _ in range(width)))

    def _over(self) -> bool:
        return self.stop or time.monotonic() >= self.deadline

    async def _work(self, client: httpx.AsyncClient, queue: "asyncio.Queue[validation.Request]") -> None:
        while not self._over():
            try:
                request = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            pause = _RETRY_FIRST_S
            while True:
                result = await self._send(client, request)
                if result is not None:
                    self._write(*result)
                    self.left -= 1
                    break
                if self._over():
                    return  # left for the next slice
                await asyncio.sleep(min(pause, max(0.0, self.deadline - time.monotonic())))
                pause = min(pause * 2, _RETRY_MAX_S)

    async def _send(self, client: httpx.AsyncClient, request: validation.Request) -> tuple[str, bytes] | None:
        """The result line of ``request`` and the work file it goes to; None: try it again later."""
        try:
            response = await client.post(self.batch.endpoint, content=request.body)
        except httpx.HTTPError as exc:
            log.info("batch %s: %s not sent (%s); trying again", self.batch.id, request.custom_id, exc)
            return None
        if response.status_code in _LATER and not _out_of_quota(response):
            return None
        try:
            body: Any = response.json()
        except ValueError:
            body = {"error": {"message": response.text[:1000], "type": "server_error"}}
        ok = 200 <= response.status_code < 300
        line = {
            "id": "batch_req_" + secrets.token_hex(12),
            "custom_id": request.custom_id,
            "response": {
                "status_code": response.status_code,
                "request_id": body.get("id", "") if isinstance(body, dict) else "",
                "body": body,
            },
            "error": None,
        }
        return (OUTPUT if ok else ERRORS), msgspec.json.encode(line) + b"\n"

    def _write(self, name: str, line: bytes) -> None:
        file = self._files[name]
        file.write(line)
        file.flush()


def _progress(batch_id: str, work: Path) -> str:
    """Write the counts of ``work``'s results and renew the lease; returns the batch's status."""
    completed, failed = (_count_lines(work / name) for name in (OUTPUT, ERRORS))
    lease = timezone.now() + datetime.timedelta(seconds=settings.BATCH_LEASE_S)
    Batch.objects.filter(pk=batch_id).update(completed=completed, failed=failed, runner_until=lease)
    return str(Batch.objects.values_list("status", flat=True).get(pk=batch_id))


def _count_lines(path: Path) -> int:
    try:
        with path.open("rb") as file:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: file.read(1 << 20), b""))
    except FileNotFoundError:
        return 0


def _out_of_quota(response: httpx.Response) -> bool:
    """A 429 that waiting does not cure: the key's monthly budget is spent (a result, not a retry)."""
    try:
        return bool(response.json()["error"]["code"] == "insufficient_quota")
    except (ValueError, KeyError, TypeError):
        return False


def _finish(batch: Batch, status: str) -> None:
    """End ``batch`` as ``status``: requests without a result are written to the error file (as OpenAI
    does for an expired batch), and the work files become its output and error files."""
    work = storage.work_dir(batch.id)
    work.mkdir(parents=True, exist_ok=True)
    if status in (Batch.Status.EXPIRED, Batch.Status.CANCELLED):
        code = "batch_expired" if status == Batch.Status.EXPIRED else "batch_cancelled"
        message = (
            "the batch's completion window ended before this request was sent"
            if status == Batch.Status.EXPIRED
            else "the batch was cancelled before this request was sent"
        )
        with (work / ERRORS).open("ab") as errors:
            for request in pending(batch):
                line = {
                    "id": "batch_req_" + secrets.token_hex(12),
                    "custom_id": request.custom_id,
                    "response": None,
                    "error": {"code": code, "message": message},
                }
                errors.write(msgspec.json.encode(line) + b"\n")
    completed, failed = (_count_lines(work / name) for name in (OUTPUT, ERRORS))
    with transaction.atomic():
        output = _adopt(batch, work / OUTPUT, "output") if completed else None
        error = _adopt(batch, work / ERRORS, "errors") if failed else None
        now = timezone.now()
        stamp: dict[str, Any] = {
            Batch.Status.COMPLETED: {"completed_at": now},
            Batch.Status.EXPIRED: {"expired_at": now},
            Batch.Status.CANCELLED: {"cancelled_at": now},
        }[status]
        Batch.objects.filter(pk=batch.pk).update(
            status=status, output_file=output, error_file=error, completed=completed, failed=failed, **stamp
        )
    storage.remove_work(batch.id)
    batch.refresh_from_db()
    log.info("batch %s %s: %d completed, %d failed", batch.id, status, completed, failed)


def _adopt(batch: Batch, path: Path, kind: str) -> StoredFile:
    file = StoredFile(api_key_id=batch.api_key_id, purpose="batch_output", filename=f"{batch.id}_{kind}.jsonl")
    file.bytes = storage.adopt(file.id, path)
    file.save()
    return file
