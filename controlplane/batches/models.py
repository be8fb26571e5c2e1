"""OpenAI's files and batches (``/v1/files``, ``/v1/batches``), each owned by the API key that made it.

A file's bytes are kept on disk (``storage.py``), its record here. A batch moves through OpenAI's states::

    validating -> in_progress -> finalizing -> completed
    validating -> failed                     (its input file is not a batch: ``errors`` says why, by line)
    in_progress -> cancelling -> cancelled    (what finished before is in its output file)
    in_progress -> expired                   (its completion window passed; what finished is kept)

It is run by Celery on the control plane (``runner.py``, ``tasks.py``), a slice at a time; ``runner_until``
is the lease of the runner working on it, so that a batch whose runner died (the control plane restarted)
is taken up again by the next upkeep pass, from the results already written.
"""

import secrets
from typing import ClassVar

from django.db import models

from controlplane.apikeys.models import ApiKey


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


class StoredFile(models.Model):
    """An uploaded file (purpose ``batch``), or one a batch wrote (``batch_output``)."""

    id = models.CharField(primary_key=True, max_length=40, default=new_file_id, editable=False)
    api_key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="files")
    purpose = models.CharField(max_length=32)
    filename = models.CharField(max_length=255)
    bytes = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering: ClassVar = ["-created_at", "id"]

    def __str__(self) -> str:
        return f"{self.id} ({self.filename})"


class Batch(models.Model):
    class Status(models.TextChoices):
        VALIDATING = "validating"
        FAILED = "failed"
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    #: The states a runner works in; the others are final, or waiting on nothing.
    RUNNING: ClassVar = (Status.VALIDATING, Status.IN_PROGRESS, Status.FINALIZING, Status.CANCELLING)

    id = models.CharField(primary_key=True, max_length=40, default=new_batch_id, editable=False)
    api_key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="batches")
    endpoint = models.CharField(max_length=64)
    input_file = models.ForeignKey(StoredFile, on_delete=models.PROTECT, related_name="+")
    completion_window = models.CharField(max_length=8, default="24h")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.VALIDATING)
    output_file = models.ForeignKey(StoredFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    error_file = models.ForeignKey(StoredFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    #: Why the input is not a batch (validation), as OpenAI lists them: [{code, message, line, param}].
    errors = models.JSONField(null=True, blank=True)
    metadata = models.JSONField(null=True, blank=True)
    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    #: The lease of the runner working on it: another takes it up only once this has passed.
    runner_until = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering: ClassVar = ["-created_at", "id"]
        verbose_name_plural = "batches"

    def __str__(self) -> str:
        return f"{self.id} ({self.status})"

    @property
    def done(self) -> int:
        return self.completed + self.failed
