"""Responses API answers kept for ``previous_response_id`` and ``responses.retrieve`` (``store``, OpenAI's
default), each owned by the API key that made it and kept ``FLOTILLA_RESPONSES_KEEP_S`` (30 days).

The gateway writes one as it answers (before the answer's last bytes, so that the client's next turn
finds it) and reads a conversation back when a request names it. ``conversation`` is every item up to and
including this response's output, so that a chain of turns is read in one row, not walked.
"""

from typing import ClassVar

from django.db import models

from controlplane.apikeys.models import ApiKey


class StoredResponse(models.Model):
    id = models.CharField(primary_key=True, max_length=100, editable=False)
    api_key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="stored_responses")
    #: The response object as the client got it.
    response = models.JSONField()
    #: This request's input, as items (each with an id).
    input_items = models.JSONField()
    #: The items of the whole conversation so far: the previous response's, this input, this output.
    conversation = models.JSONField()
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(db_index=True)

    class Meta:
        ordering: ClassVar = ["-created_at"]

    def __str__(self) -> str:
        return self.id
