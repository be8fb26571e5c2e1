"""The error hierarchy shared by all Flotilla programs.

Foreign exceptions are translated into these at the boundary (``raise ... from exc``) so that each
program has one place that turns them into an exit message or an HTTP status.
"""


class FlotillaError(Exception):
    """Base class of every error Flotilla raises on purpose."""


class ConfigError(FlotillaError):
    """A flag or an environment variable has a value we cannot use."""


class ModelError(FlotillaError):
    """A model could not be found, downloaded or loaded."""


class ModelUnreachable(ModelError):
    """The model's hub could not be reached (the network may come back: a supervisor should retry)."""


class EngineError(FlotillaError):
    """An engine failed while generating."""


class EngineUnavailable(EngineError):
    """No engine can take the request now (no instance, or the network is down): retry later."""


class EngineBusy(EngineUnavailable):
    """Every instance is past its busy threshold or refused the request as busy: retry in a moment."""


class EngineStalled(EngineError):
    """The engine sent no output within the progress deadline (the gateway answers 504)."""


class TemplateError(FlotillaError):
    """A chat template failed to compile or render (the gateway answers 400)."""


class DiscoveryUnavailable(FlotillaError):
    """etcd cannot be reached ("cannot reach etcd at ...; start it with `make services` or set ETCD_ENDPOINTS")."""


class RequestPlaneUnavailable(FlotillaError):
    """NATS cannot be reached ("cannot reach NATS at ...; start it with `make services` or set NATS_SERVER")."""


class RequestRejected(EngineError):
    """The engine refused the request as one it cannot serve, e.g. a JSON schema it cannot turn into a
    grammar (the gateway answers 400 with the engine's reason)."""


class PayloadTooLarge(EngineError):
    """The engine refused the request as over its size limit (the gateway answers 413)."""


class BackgroundTaskFailed(FlotillaError):
    """A background task a process depends on failed, so the process stops (and exits non-zero)."""


class Fenced(FlotillaError):
    """The control plane retired this worker (its node was given up on, runtime/fleet_contract/fences.py): it exits."""
