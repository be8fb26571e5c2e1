"""LoRA adapters served by ``flotilla run in=http`` itself (no worker, no ingress): each a model of the process's
registry, whose requests run on the base model's engine with ``lora_name`` set.

The same ``AdapterManager`` (launcher/adapters.py) drives the engine as in a worker; registering an adapter adds
its model to the registry (``/v1/models`` lists it with its ``parent``), withdrawing it removes the model.
"""

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal, cast

from frontend_gateway.models.pipeline import ModelRegistry, ServedModel, TokenModel
from launcher.adapters import AdapterManager
from runtime.engine import Engine, RequestContext, TokenEngine
from runtime.errors import ConfigError
from runtime.fleet_contract.engine_names import LORA_ENGINES
from runtime.lora import LoraAdapter, LoraEngine
from runtime.protocol import EngineOutput, PreprocessedRequest

log = logging.getLogger(__name__)


class AdapterEngine:
    """The base model's ``engine``, running every request with adapter ``name``. Starting and closing it is the
    base model's business: these do nothing."""

    kind: Literal["token"] = "token"

    def __init__(self, engine: TokenEngine, name: str) -> None:
        self.engine = engine
        self.name = name
        self.skip_special_tokens = engine.skip_special_tokens

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def generate(self, request: PreprocessedRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        request.lora_name = self.name
        async for output in self.engine.generate(request, context):
            yield output


async def serve_local_adapters(
    registry: ModelRegistry,
    model: ServedModel,
    engine: Engine,
    loras: tuple[LoraAdapter, ...],
    lora_file: Path | None,
) -> asyncio.Task[None] | None:
    """Load the adapters and add each to ``registry`` beside ``model``; return the task watching ``lora_file``
    (the caller cancels it), if there is one. Raises ConfigError for an engine that takes no adapters or a
    ``--lora`` adapter it cannot serve."""
    if not isinstance(engine, LoraEngine) or not isinstance(model, TokenModel) or engine.kind != "token":
        raise ConfigError(f"this engine does not load LoRA adapters; engines that do: {', '.join(LORA_ENGINES)}")
    base, card, token_engine = model.name, model.card, cast(TokenEngine, engine)
    if any(adapter.name == base for adapter in loras):
        raise ConfigError(f"--lora {base}=...: the adapter needs a name of its own, not the base model's")

    async def publish(adapter: LoraAdapter) -> None:
        served = TokenModel(card.replace(name=adapter.name), AdapterEngine(token_engine, adapter.name))
        served.parent = base
        registry.add(served)

    async def withdraw(name: str) -> None:
        registry.remove(name)

    manager = AdapterManager(engine, fixed=loras, file=lora_file, publish=publish, withdraw=withdraw)
    await manager.start()
    if lora_file is None:
        return None
    task = asyncio.create_task(manager.watch(), name=f"LoRA adapter file {lora_file}")
    task.add_done_callback(_log_failure)
    return task


def _log_failure(task: "asyncio.Task[None]") -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("watching the --lora-file failed; adapters no longer follow it", exc_info=exc)
