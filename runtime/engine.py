"""The one small interface every engine implements.

An engine is an object with an async ``generate`` that takes one request and yields a stream of
outputs, plus ``start``/``close`` for its lifecycle. A *token* engine takes token ids (the gateway
pre/post-processes for it); a *text* engine takes OpenAI-level requests and does its own. The same
engine object runs inside ``flotilla run`` or, later, behind a networked worker.
"""

from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from runtime.fleet_contract.request_records import RouteChoice
from runtime.protocol import EmbedInput, EngineOutput, PreprocessedRequest, TextOutput, TextRequest


class RequestContext:
    """Per-request control shared between the caller and the engine.

    ``stop()`` may be called from any thread or task; engines poll ``stopped`` between steps (a
    plain attribute so that engine threads can read it without touching the event loop).
    """

    __slots__ = ("disagg", "prefilled_by", "request_id", "route", "served_by", "stopped")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.stopped = False
        #: The instance that answered, when the engine is remote (for the x-flotilla-instance header).
        self.served_by: str | None = None
        #: The instance that computed the prompt, when a prefill worker did (x-flotilla-prefill-instance).
        self.prefilled_by: str | None = None
        #: The client's x-flotilla-disagg: "local" or "remote" overrides where the prompt is computed; None.
        self.disagg: str | None = None
        #: The router's decision for the attempt that answered (remote engines), for the request log.
        self.route: RouteChoice | None = None

    def stop(self) -> None:
        """Ask the engine to stop producing outputs for this request."""
        self.stopped = True


@runtime_checkable
class TokenEngine(Protocol):
    """An engine fed token ids by Flotilla's preprocessor."""

    kind: Literal["token"]
    #: False for engines whose point is to show special tokens (echo_core shows the chat template).
    skip_special_tokens: bool

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def generate(self, request: PreprocessedRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        """Yield outputs until a finish reason, or until ``context.stopped`` is set."""
        ...


@runtime_checkable
class TextEngine(Protocol):
    """An engine that takes OpenAI-level requests and does its own templating and tokenizing."""

    kind: Literal["text"]

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def generate(self, request: TextRequest, context: RequestContext) -> AsyncIterator[TextOutput]:
        """Yield text pieces until a finish reason, or until ``context.stopped`` is set."""
        ...


Engine = TokenEngine | TextEngine


@runtime_checkable
class Embedder(Protocol):
    """An engine that also embeds text (``POST /v1/embeddings``); its model's card says ``embeddings``."""

    async def embed(self, inputs: Sequence[EmbedInput]) -> tuple[list[list[float]], int]:
        """One unit-length vector per input (a text, or the model's token ids as given), and the tokens they
        took. Raises EngineError."""
        ...


@runtime_checkable
class EngineMetricsSource(Protocol):
    """An engine that keeps Prometheus metrics of its own (vLLM's ``vllm:*``): a worker's ``--metrics-port``
    serves them after its own ``flotilla_worker_*``."""

    def prometheus_registry(self) -> Any:
        """The ``prometheus_client`` registry holding the engine's metrics; None: none (not started, or off)."""
        ...
