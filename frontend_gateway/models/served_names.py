"""The names the control plane's pipelines serve (``runtime/fleet_contract/served_names.py``), kept by an etcd watch, so
that a model with no instance registered is a 503 "no ready replica" when a pipeline serves that name
(stopped, or its replicas on their way) and a 404 only when nothing does."""

import logging
from http import HTTPStatus

import msgspec

from frontend_gateway.errors import GatewayError
from runtime.cluster.discovery import Discovery, WatchEvent
from runtime.fleet_contract.served_names import SERVED_NAMES_PREFIX, ServedName

log = logging.getLogger(__name__)
_decoder = msgspec.json.Decoder(ServedName)


class ModelNotReady(GatewayError):
    """A pipeline serves the model, but no replica of it is ready (503 with Retry-After)."""

    status = HTTPStatus.SERVICE_UNAVAILABLE
    error_type = "service_unavailable"
    code = "model_not_ready"
    retry_after = 5


class ServedNames:
    """Served model name -> its pipeline's state, as the control plane last said."""

    def __init__(self) -> None:
        self._states: dict[str, str] = {}
        self._seen: dict[str, bytes] = {}

    def state(self, name: str) -> str | None:
        return self._states.get(name)

    async def run(self, discovery: Discovery) -> None:
        """Apply what etcd holds, then its changes, until cancelled (the watch survives etcd outages)."""
        async for event in discovery.watch_prefix(SERVED_NAMES_PREFIX, known=self._seen):
            self.apply(event)

    def apply(self, event: WatchEvent) -> None:
        name = event.key.removeprefix(SERVED_NAMES_PREFIX)
        if event.kind == "delete" or event.value is None:
            self._states.pop(name, None)
            self._seen.pop(event.key, None)
            return
        try:
            record = _decoder.decode(event.value)
        except msgspec.DecodeError as exc:
            log.warning("ignored the served-name record at %s: %s", event.key, exc)
            return
        self._states[name] = record.state
        self._seen[event.key] = event.value


def not_ready(name: str, state: str) -> ModelNotReady:
    """The answer for a served ``name`` with no ready replica, saying why."""
    why = "its pipeline is stopped" if state == "stopped" else "its replicas are starting"
    return ModelNotReady(f"the model {name!r} has no ready replica ({why}); try again later", param="model")
