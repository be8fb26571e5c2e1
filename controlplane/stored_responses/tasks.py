"""The beat task that deletes stored responses past their keeping time (reads ignore them already)."""

import logging

from celery import shared_task
from django.utils import timezone

from controlplane.celery_app import EXPIRE_RESPONSES_TASK
from controlplane.stored_responses.models import StoredResponse

log = logging.getLogger(__name__)


@shared_task(name=EXPIRE_RESPONSES_TASK, ignore_result=True)
def expire_responses() -> int:
    deleted, _ = StoredResponse.objects.filter(expires_at__lte=timezone.now()).delete()
    if deleted:
        log.info("stored responses: deleted %d past their keeping time", deleted)
    return deleted
