from django.apps import AppConfig


class StoredResponsesConfig(AppConfig):
    name = "controlplane.stored_responses"
    label = "stored_responses"
    verbose_name = "Stored responses"
