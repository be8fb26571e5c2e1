"""OpenAPI description of the token authentication (imported by the accounts app when Django starts), and the
schema class that documents the API's error answers (settings.REST_FRAMEWORK's DEFAULT_SCHEMA_CLASS)."""

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import ResolvedComponent
from rest_framework.permissions import AllowAny


class TokenAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "controlplane.accounts.authentication.TokenAuthentication"
    name = "tokenAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A person's or an agent's token: `Authorization: Bearer flt_…` (`manage.py createtoken`)",
        }


# -- the error answers, documented on every operation that can give them ------------------------------------

_DETAIL = {
    "type": "object",
    "properties": {"detail": {"type": "string"}},
    "required": ["detail"],
}
# A serializer's or an action's Invalid: each field (or "non_field_errors") with its messages.
_FIELD_ERRORS = {
    "type": "object",
    "additionalProperties": {"type": "array", "items": {"type": "string"}},
    "description": "The fields at fault, each with its messages (`non_field_errors`: the request as a whole).",
}
_ERRORS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # code: (component, description, schema)
    "400": ("ValidationErrors", "Invalid input: the body names each field at fault.", _FIELD_ERRORS),
    "401": ("ErrorDetail", "No token, or an unknown, revoked or inactive person's token.", _DETAIL),
    "403": ("ErrorDetail", "The token's role (or agent) may not do this.", _DETAIL),
    "404": ("ErrorDetail", "No such record.", _DETAIL),
    "409": ("ErrorDetail", "The record's state does not allow this; the detail says why.", _DETAIL),
    "413": ("ErrorDetail", "The request body is over FLOTILLA_API_MAX_BODY_BYTES.", _DETAIL),
}
_WRITES = ("POST", "PUT", "PATCH", "DELETE")


class ErrorDocumentingSchema(AutoSchema):
    """drf-spectacular's schema, plus the error answers each operation can give (controlplane/api/exceptions.py
    makes them): 401 and 403 where a token is needed, 404 where the path names a record, 400 where a body or
    filters are read, 409 where something changes, 413 where a body is sent."""

    def _get_response_bodies(self, direction: Any = "response") -> dict[str, Any]:
        responses: dict[str, Any] = super()._get_response_bodies(direction)
        for code in self._error_codes():
            if code not in responses:
                component_name, description, schema = _ERRORS[code]
                component = ResolvedComponent(
                    name=component_name, type=ResolvedComponent.SCHEMA, object=component_name, schema=schema
                )
                self.registry.register_on_missing(component)
                content = {"application/json": {"schema": component.ref}}
                responses[code] = {"description": description, "content": content}
        return responses

    def _error_codes(self) -> list[str]:
        codes = []
        public = any(issubclass(permission, AllowAny) for permission in self.view.permission_classes)
        listing = self.method == "GET" and self._is_list_view()  # its filters are checked: a bad one is a 400
        if self.method in ("POST", "PUT", "PATCH") or listing:
            codes.append("400")
        if not public:
            codes += ["401", "403"]
        if "{" in self.path or (listing and getattr(self.view, "pagination_class", None)):  # a page past the end
            codes.append("404")
        if self.method in _WRITES and not public:
            codes.append("409")
        if self.method in ("POST", "PUT", "PATCH"):
            codes.append("413")
        return codes
