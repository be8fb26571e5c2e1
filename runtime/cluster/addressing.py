"""Addresses of distributed services: ``dyn://namespace.component.endpoint``, and instance ids.

A namespace is a pipeline (usually one model), a component is a service in it (``backend``,
``prefill``), an endpoint is a callable (``generate``). Every process that serves an endpoint is an
instance with its own id; instances of the same endpoint are data-parallel replicas.
"""

import re
import secrets
from dataclasses import dataclass

from runtime.errors import ConfigError

DEFAULT_NAMESPACE = "flotilla"
DEFAULT_COMPONENT = "backend"
DEFAULT_ENDPOINT = "generate"
SCHEME = "dyn://"
# Each part becomes a NATS subject token and an etcd key segment: no dots, slashes or wildcards.
_PART = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True, slots=True)
class EndpointAddress:
    """namespace.component.endpoint, each part checked."""

    namespace: str = DEFAULT_NAMESPACE
    component: str = DEFAULT_COMPONENT
    endpoint: str = DEFAULT_ENDPOINT

    def __post_init__(self) -> None:
        for label, part in (("namespace", self.namespace), ("component", self.component), ("endpoint", self.endpoint)):
            if not _PART.match(part):
                raise ConfigError(f"{label} {part!r} must be 1-64 letters, digits, '-' or '_'")

    @classmethod
    def parse(cls, text: str) -> "EndpointAddress":
        """Parse ``dyn://ns.comp.ep``; missing parts get defaults (``dyn://test`` is test.backend.generate).

        Raises ConfigError for a malformed address.
        """
        if not text.startswith(SCHEME):
            raise ConfigError(f"{text!r} is not an endpoint address; write dyn://namespace.component.endpoint")
        parts = text.removeprefix(SCHEME).split(".")
        if len(parts) > 3 or not parts[0]:
            raise ConfigError(f"{text!r} is not an endpoint address; write dyn://namespace.component.endpoint")
        defaults = [DEFAULT_NAMESPACE, DEFAULT_COMPONENT, DEFAULT_ENDPOINT]
        namespace, component, endpoint = parts + defaults[len(parts) :]
        return cls(namespace, component, endpoint)

    def __str__(self) -> str:
        return f"{SCHEME}{self.namespace}.{self.component}.{self.endpoint}"

    @property
    def path(self) -> str:
        """``ns/comp/ep``: the etcd key segment of this endpoint."""
        return f"{self.namespace}/{self.component}/{self.endpoint}"

    def subject(self, instance_id: int) -> str:
        """The NATS subject one instance of this endpoint listens on."""
        return f"flotilla.{self.namespace}.{self.component}.{self.endpoint}.{instance_id:x}"

    def embed_subject(self, instance_id: int) -> str:
        """The NATS subject one instance answers embedding requests on (next to its generation subject)."""
        return f"{self.subject(instance_id)}.embed"

    def load_metrics_subject(self) -> str:
        """Where instances of this endpoint's component publish their load."""
        return f"flotilla.{self.namespace}.{self.component}.load_metrics"

    def kv_events_subject(self) -> str:
        """Where instances of this endpoint's component publish their KV-cache events."""
        return f"flotilla.{self.namespace}.{self.component}.kv_events"

    def kv_state_subject(self, instance_id: int) -> str:
        """Where one instance answers requests for its whole KV-cache state."""
        return f"flotilla.{self.namespace}.{self.component}.kv_state.{instance_id:x}"


def new_instance_id() -> int:
    """A random 63-bit instance id, unique per process for all practical purposes."""
    return secrets.randbits(63) or 1
