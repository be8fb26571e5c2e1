"""The control plane's errors: what an action refuses, and why, in words a person can act on.

Actions raise these; the API's exception handler (``controlplane.api.exceptions``) maps them to HTTP:
``Invalid`` to 400 with the field named, ``Conflict`` to 409, ``Forbidden`` to 403, ``Missing`` to
404.
"""

from runtime.errors import FlotillaError


class ControlPlaneError(FlotillaError):
    """Base class of the errors control-plane actions raise on purpose."""


class Invalid(ControlPlaneError):
    """The request asks for something impossible; ``field`` names the input at fault (None: the whole)."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidDocument(Invalid):
    """A JSON document with several problems, each as (path inside it, what is wrong); the API answers them
    as field errors, the path as the field ("" is the whole document)."""

    def __init__(self, message: str, problems: list[tuple[str, str]]) -> None:
        super().__init__(message)
        self.problems = problems


class Conflict(ControlPlaneError):
    """The record is not in a state that allows the action (stop what is already stopped, ...)."""


class InvalidTransition(Conflict):
    """An instance was asked to move between two states its state machine does not connect."""


class Forbidden(ControlPlaneError):
    """The caller may not act on this record (an agent reporting on another node's instance)."""


class Missing(ControlPlaneError):
    """A record the action needs does not exist (an unregistered node, an unknown instance)."""
