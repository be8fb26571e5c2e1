from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "controlplane.accounts"
    label = "accounts"
    verbose_name = "Accounts and API tokens"

    def ready(self) -> None:
        # Registers the token scheme with drf-spectacular (extensions register on import).
        from controlplane.api import schema  # noqa: F401
