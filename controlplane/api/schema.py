"""OpenAPI description of the token authentication (imported by the accounts app when Django starts)."""

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class TokenAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "controlplane.accounts.authentication.TokenAuthentication"
    name = "tokenAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A person's or an agent's token: `Authorization: Bearer flt_…` (`manage.py createtoken`)",
        }
