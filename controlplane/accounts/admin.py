from django.contrib import admin
from django.contrib.auth.admin import UserAdmin

from controlplane.accounts.forms import ThrottledAdminLogin
from controlplane.accounts.models import ApiToken, User


@admin.register(User)
class FlotillaUserAdmin(UserAdmin):
    list_display = ("username", "role", "is_active", "is_superuser", "last_login")
    list_filter = ("role", "is_active", "is_superuser")
    fieldsets = (*UserAdmin.fieldsets, ("Flotilla", {"fields": ("role",)}))


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Tokens are listed and revoked here; they are created with the API or `manage.py createtoken`."""

    list_display = ("key_start", "kind", "user", "node_name", "description", "created_at", "last_used_at")
    list_filter = ("kind",)
    readonly_fields = ("kind", "user", "node_name", "key_start", "created_at", "last_used_at")

    def has_add_permission(self, request: object) -> bool:
        return False


# The admin's login counts failed logins with the dashboard's (controlplane/accounts/throttle.py).
admin.site.login_form = ThrottledAdminLogin
