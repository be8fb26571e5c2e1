from django.apps import AppConfig


class ApiKeysConfig(AppConfig):
    name = "controlplane.apikeys"
    label = "apikeys"
    verbose_name = "API keys for the OpenAI endpoint"
